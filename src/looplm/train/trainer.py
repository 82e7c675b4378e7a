"""The training loop: depth draws, truncated backprop, accumulation, checkpoints, metrics.

One optimizer step = `grad_accum` microbatches. Each microbatch draws its own depth (the same
on every rank), runs the model with the configured backprop window, and adds its CE sum divided
by the global target count of the step, so the loss is a token mean over the global batch
(design §6). Data order, depth draws and initial-state noise are pure functions of (seed, step,
microbatch, global row), so a resumed run reproduces an uninterrupted one, and a run on N ranks
sees the same global batch as one process; a run resumed on another number of ranks keeps its
global batch (`looplm.train.layout`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from looplm import checkpoint as ckpt
from looplm.data import Batch, PackedDataset, Tokenizer, batch_indices, build_datasets, build_tokenizer
from looplm.data import is_pretokenized, iter_documents, load_tokenizer, open_pretokenized, pretokenized_info
from looplm.data.corpus import CORPORA
from looplm.data.packing import caches_ready
from looplm.data.record import DataRecord, absolute_source
from looplm.depth import DepthSampler, LearnedDepthPrior, build_sampler
from looplm.depth.learned import logits_from_run
from looplm.depth.plot import plot_prior
from looplm.errors import UserError
from looplm.model import LoopedLM
from looplm.model.blocks import FLEX_MIN_HEAD_DIM
from looplm.train import distributed as D
from looplm.train import parallelize as P
from looplm.train.checkpointing import Checkpointer, is_sharded_run
from looplm.train.checkpointing import verify as verify_checkpoint
from looplm.train.config import (
    check_choices,
    flat_diff,
    DataConfig,
    TrainConfig,
    TrainJob,
    job_from_dict,
    jsonable,
    vocab_size_for,
)
from looplm.train.flops import expected_flops_per_token, mean_flops_per_token
from looplm.train.layout import BatchLayout
from looplm.train.optim import param_groups
from looplm.train.loss import cross_entropy_sum, loss_kind, microbatch_loss, parse_kernel_options
from looplm.train.metrics import MetricsLogger
from looplm.train.noise import initial_state_noise
from looplm.train.schedule import wsd_multiplier
from looplm.train.startup import PAPER_PRESETS, count_params, cpu_warning, model_line, precision_name, preset_of
from looplm.train.startup import tokenizer_warning

# Settings that may change between a run and its resume; everything else must match. The global
# batch is the checkpoint's, so train.micro_batch only bounds the rows of one forward on resume; a
# run folder may be moved or copied (train.out_dir) and resumed where it lies.
RESUMABLE_CHANGES = {
    "train.resume",
    "train.progress",
    "train.log_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.eval_every",
    "train.eval_batches",
    "train.tensorboard",
    "train.wandb",
    "train.stop_after",
    "train.device",
    "data.cache_dir",
    "train.compile",
    "train.attention",
    "train.activation_checkpointing",
    "train.prefetch",
    "train.micro_batch",
    "train.async_checkpoint",
    "train.out_dir",
    "train.flex_kernel_options",
    "train.cross_entropy",
    "train.steps",  # steps: a longer (or shorter) schedule, see Trainer._check_steps
    "train.parallel",  # where the checkpoint's form loads, see Trainer._check_form
}
RESUMABLE_PREFIXES = ("eval.",)


def refuse_rank0_preparation(
    world_size: int, d: DataConfig, *, seed: int, tokenizer: Tokenizer | None, resumed: bool = False
) -> None:
    """Refuse (a UserError naming the `looplm tokenize` command) a run on several ranks whose rank 0
    would first train a BPE tokenizer on the corpus (`tokenizer` None) or tokenize it into the token
    cache: the other ranks would wait in a collective that times out (LOOPLM_DIST_TIMEOUT_S, 600 s)
    on a corpus of real size. `looplm tokenize` folders, the task generator and the built-in corpora
    (generated or read in seconds) pass, as does a corpus whose cache an earlier run built."""
    if world_size == 1 or d.source in ("tasks", *CORPORA) or is_pretokenized(d.source):
        return
    kw = dict(
        holdout=d.holdout,
        cache_dir=d.cache_dir,
        text_field=d.text_field,
        task_config=d.tasks,
        n_task_examples=d.n_task_examples,
        seed=seed,
    )
    if tokenizer is not None and caches_ready(d.source, tokenizer, **kw):
        return
    src = str(d.source)
    if resumed:  # the run's data.source stays; only the cache can be built (or found) elsewhere
        raise UserError(
            f"data.source {src} on {world_size} ranks: its token cache is not in data.cache_dir "
            f"{d.cache_dir}, and rank 0 would tokenize the corpus while the other ranks wait in a collective "
            "that times out; resume once on one process to build it, or point --data.cache-dir at the "
            "cache the run was started with"
        )
    out = (
        src.removeprefix("hf:").replace("/", "-").replace(":", "-")
        if src.startswith("hf:")
        else str(Path(src).with_suffix(""))
    ) + "-tokenized"
    cmd = ["looplm", "tokenize", src, out, "--tokenizer", str(d.tokenizer)]
    if d.tokenizer == "bpe":
        cmd += ["--bpe-vocab-size", str(d.bpe_vocab_size)]
    cmd += ["--holdout", f"{d.holdout:g}"]
    if src.startswith("hf:") or src.endswith(".jsonl"):
        cmd += ["--text-field", d.text_field]
    cmd += ["--seed", str(seed)]
    work = "train the BPE tokenizer on and tokenize" if tokenizer is None else "tokenize"
    raise UserError(
        f"data.source {src} on {world_size} ranks: rank 0 would {work} the corpus while the other ranks "
        f"wait in a collective that times out; tokenize it once with `{shlex.join(cmd)}` and train with "
        f"--data.source {shlex.quote(out)}"
    )


def resolve_dtype(precision: str, device: torch.device) -> torch.dtype:
    if precision == "fp32":
        return torch.float32
    if precision == "bf16":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cuda" else torch.float32  # auto: fp32 on every CPU


def use_compile(t: TrainConfig, device: torch.device) -> bool:
    return t.compile == "on" or (t.compile == "auto" and device.type == "cuda")


def attention_kernel(t: TrainConfig, device: torch.device, head_dim: int) -> str:
    """FlexAttention block masks on CUDA (SDPA leaves the flash kernel for boolean masks), where the
    fused flex kernel takes the model's head size (`FLEX_MIN_HEAD_DIM`); else SDPA. An explicit
    `flex` on CUDA with smaller heads is refused here rather than failing inside the compiler."""
    fits = head_dim >= FLEX_MIN_HEAD_DIM
    if t.attention == "flex" and device.type == "cuda" and not fits:
        raise UserError(
            f"train.attention flex: torch's fused FlexAttention kernel needs head_dim >= {FLEX_MIN_HEAD_DIM}, "
            f"the model has {head_dim}; train with --train.attention sdpa (or auto)"
        )
    if t.attention != "auto":
        return t.attention
    return "flex" if device.type == "cuda" and fits else "sdpa"


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during `Trainer.fit`: the steps done, the step of the last checkpoint (None: none yet) and
    the step the first one is due at, for the caller to say how to resume."""

    def __init__(self, step: int, checkpoint_step: int | None, first_checkpoint: int):
        super().__init__(step, checkpoint_step, first_checkpoint)
        self.step, self.checkpoint_step, self.first_checkpoint = step, checkpoint_step, first_checkpoint


@dataclass
class StepResult:
    loss: float
    depths: list[int]
    n_targets: int
    grad_norm: float
    lr: float


class Trainer:
    def __init__(self, job: TrainJob, env: D.DistEnv | None = None):
        # The resolved job: `depth.bptt_window` is the window this run trains with ('auto' replaced by
        # full BPTT for a fixed depth, 10 for the sampled priors; design §3), so every use of
        # `self.job.depth.bptt_window` below, the FLOPs counts and config.json see the resolved value.
        self.job = job = job.resolved()
        self.env = env or D.init_distributed(job.train.device)
        t, m = job.train, job.model
        self._validate()
        self.out_dir = Path(t.out_dir)
        self.ckpt_root = self.out_dir / "checkpoints"
        self._saved: dict | None = None  # the resumed checkpoint's job, its step and data record
        resume_from = self._find_resume()
        job = self.job  # _find_resume may have replaced its data section: the source as the run recorded it
        self.sampler: DepthSampler = self._depth_sampler(resume_from)
        self.data = d = self._run_data()
        self.layout = self._plan_layout(resume_from)
        saved_tok = load_tokenizer(resume_from) if resume_from else None
        self._warn_cpu(saved_tok)  # before the tokenizer, data and model are built, which may take long
        refuse_rank0_preparation(
            self.env.world_size,
            d,
            seed=t.seed,
            tokenizer=saved_tok
            or (None if d.tokenizer == "bpe" else build_tokenizer(d.tokenizer, None, d.bpe_vocab_size)),
            resumed=resume_from is not None,
        )
        self.tokenizer = saved_tok or self._build_tokenizer()
        m.vocab_size = vocab_size_for(m.vocab_size, self.tokenizer.vocab_size)
        self.train_data, self.val_data = self._build_data()
        change = self._saved["record"].split_change(self.train_data, self.val_data) if self._saved else None
        if change is not None:  # the held-out draw moved: former held-out documents would be trained on
            raise UserError(
                f"{change}: a resume would train on other documents; resume with the data as it was, or "
                "start a new run (another --train.out-dir)"
            )
        torch.manual_seed(t.seed)
        self.model = LoopedLM(m).to(self.env.device)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.dtype = resolve_dtype(t.precision, self.env.device)
        # Wrapped from outside, in torchtitan's order: checkpointing, compile, data parallelism.
        self.attention = attention_kernel(t, self.env.device, m.head_dim)
        self.loss_kind = loss_kind(t, self.env.device)
        self.flex_options = parse_kernel_options(t.flex_kernel_options) if self.attention == "flex" else None
        self.compiled = use_compile(t, self.env.device)
        P.apply_activation_checkpointing(self.model, t.activation_checkpointing)
        if self.compiled:
            P.apply_compile(self.model)
        self.wrapped = P.wrap_model(
            self.model, self.env, t.parallel, param_dtype=self.dtype if self.dtype != torch.float32 else None
        )
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, t.weight_decay),
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=1e-8,
            fused=self.env.device.type == "cuda",
        )
        self.checkpointer = Checkpointer(
            self.ckpt_root,
            self.env,
            self.model,
            self.optimizer,
            sharded=is_sharded_run(self.env, t.parallel),
            async_save=t.async_checkpoint,
            keep=t.keep_checkpoints,
        )
        self.recompiles_baseline: int | None = None  # graphs compiled by the end of warm-up
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="looplm-batches") if t.prefetch else None
        self._prefetched: tuple[int, Future] | None = None
        self.step = 0
        self.depth_metrics: dict[str, float] = {}
        self.tokens_seen = 0
        self.flops_seen = 0.0
        self.elapsed = 0.0
        self.window_depths: list[int] = []  # the depths of the steps since the last logged record
        self.logger = MetricsLogger(
            self.out_dir, enabled=self.env.is_main, tensorboard=t.tensorboard, wandb=t.wandb, config=job.to_dict()
        )
        if resume_from:
            self._load(resume_from)
        # fresh: an earlier attempt's log goes; at the resume step, what an uninterrupted run logs there
        self.logger.truncate_after(
            None if resume_from is None else self.step,
            lambda record: self._on_grid(self.step)["val_loss" in record],
        )
        self.start_step = self.step

    # -- setup ---------------------------------------------------------------------------------
    def _validate(self) -> None:
        j = self.job
        if not isinstance(j.data.source, str):  # the paper-size presets have no default corpus
            raise UserError(
                "data.source is required for this preset: give your corpus with --data.source (a "
                "`looplm tokenize` folder, text files, a .jsonl or hf:<name>)"
            )
        if j.model.vocab_size < 0:
            raise UserError(f"model.vocab_size must be >= 0 (0: the tokenizer's size), got {j.model.vocab_size}")
        dataclasses.replace(j.model, vocab_size=j.model.vocab_size or 1).validate()  # 0 is resolved later
        if j.model.exit_gate:  # its parameters would stay random, and DDP fails on unused parameters
            raise UserError(
                "model.exit_gate: looplm train has no exit objective, so the gate would never learn; "
                "train without it (a converted model brings its trained gate)"
            )
        if j.data.seq_len > j.model.max_seq_len:
            raise UserError(
                f"data.seq_len {j.data.seq_len} exceeds the model context max_seq_len {j.model.max_seq_len}"
            )
        for name in (
            "steps",
            "micro_batch",
            "grad_accum",
            "checkpoint_every",
            "log_every",
            "eval_batches",
            "keep_checkpoints",
        ):
            if getattr(j.train, name) < 1:
                raise UserError(f"train.{name} must be >= 1, got {getattr(j.train, name)}")
        if j.train.stop_after is not None and j.train.stop_after < 1:
            raise UserError(f"train.stop_after must be >= 1 (steps of the schedule) or unset, got {j.train.stop_after}")
        if j.train.eval_every < 0:
            raise UserError(f"train.eval_every must be >= 0 (0 disables), got {j.train.eval_every}")
        t = j.train
        check_choices(t, "train.")
        for name, ok, rule in (
            ("lr", lambda v: v > 0, "> 0"),
            ("warmup_frac", lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("decay_frac", lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("weight_decay", lambda v: v >= 0, ">= 0"),
            ("beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
            ("beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
            ("grad_clip", lambda v: v >= 0, ">= 0 (0 disables)"),
        ):
            if not ok(getattr(t, name)):
                raise UserError(f"train.{name} must be {rule}, got {getattr(t, name):g}")
        if t.warmup_frac + t.decay_frac > 1:
            raise UserError(f"train.warmup_frac + decay_frac must be <= 1, got {t.warmup_frac + t.decay_frac:g}")
        j.eval.validate(j.model.max_depth, j.model.max_seq_len, prefix="eval.", allow_no_depths=True)
        j.eval.check_span(j.data.seq_len, prefix="eval.")
        # Depth settings are checked here, before the (possibly long) data build; a prior read from
        # another run is checked once the resume is known (`_depth_sampler`).
        if j.depth.sampler != "learned" or j.depth.learned.init_from is None:
            build_sampler(j.depth)
        if j.model.max_depth < j.depth.cap:
            raise UserError(f"depth cap {j.depth.cap} exceeds the model's max_depth {j.model.max_depth}")
        if j.train.attention == "flex":
            device = D.resolve_device(j.train.device)
            if device.type != "cuda":
                raise UserError(
                    "train.attention flex: FlexAttention has no backward on CPU in torch; "
                    "train with --train.attention sdpa (or auto) on CPU"
                )
            attention_kernel(j.train, device, j.model.head_dim)  # refuses heads the fused kernel cannot take
        parse_kernel_options(j.train.flex_kernel_options)
        ckpt.refuse_file_out_dir(Path(j.train.out_dir), "--train.out-dir")

    def _depth_sampler(self, resume_from: Path | None) -> DepthSampler:
        """The run's depth sampler. A resumed learned prior that started from another run's
        (`depth.learned.init_from`) is built from its own checkpoint's logits, which its state then
        restores anyway: the source run may have moved or gone since."""
        d = self.job.depth
        own = resume_from is not None and d.sampler == "learned" and d.learned.init_from is not None
        return build_sampler(d, init_logits=logits_from_run(resume_from) if own else None)

    def _find_resume(self) -> Path | None:
        latest = self.ckpt_root / "latest"
        if not latest.exists():
            if self.job.train.resume and self.env.is_main:  # "resume if there is something": say which it was
                print(f"--train.resume: {self.out_dir} holds no checkpoint; starting a new run there", file=sys.stderr)
            return None
        if not self.job.train.resume:
            raise UserError(
                f"{self.out_dir} already holds checkpoints; pass --train.resume to continue "
                f"or choose another --train.out-dir"
            )
        path = self.ckpt_root / latest.read_text().strip()
        self._check_form(path)
        verify_checkpoint(path, self.env)
        # fills fields added since, and resolves the window (checkpoints record it resolved; explicit
        # values of older ones stay as they are, so they resume into the same explicit or 'auto' window)
        saved = job_from_dict(ckpt.read_json(path, "config.json")).resolved().to_dict()
        now = self.job.to_dict()
        if now["model"]["vocab_size"] == 0:  # the tokenizer's size, as the checkpoint's was
            now["model"]["vocab_size"] = saved["model"]["vocab_size"]
        # data.json holds the source as it resolved where the run started (older checkpoints: config.json's,
        # read from here); another spelling of the same file or folder is the same source
        record = ckpt.load_data(path)
        source = now["data"]["source"]
        if source != saved["data"]["source"] and absolute_source(str(source)) == record.source:
            now["data"]["source"] = saved["data"]["source"]
            self.job = dataclasses.replace(
                self.job, data=dataclasses.replace(self.job.data, source=saved["data"]["source"])
            )
        diffs = [
            d
            for d in flat_diff(saved, now)
            if d.split(":")[0] not in RESUMABLE_CHANGES and not d.startswith(RESUMABLE_PREFIXES)
        ]
        if diffs:
            raise ckpt.CheckpointError(f"cannot resume into a different config ({'; '.join(diffs[:4])})")
        done = ckpt.read_json(path, "trainer_state.json")["step"]
        self._saved = {"job": saved, "step": done, "record": record}
        self._check_steps(saved["train"]["steps"], done)
        return path

    def _run_data(self) -> DataConfig:
        """The data section this run reads: a local source and the token-cache folder as absolute paths.
        A resume reads the run's own (as data.json records them, resolved where the run started), so it
        runs from any working folder; a cache folder given anew is taken from here."""
        d = self.job.data
        source, cache = absolute_source(str(d.source)), Path(os.path.abspath(d.cache_dir))
        if self._saved is not None:
            source = self._saved["record"].source  # config.json's source, checked equal in _find_resume
            if str(d.cache_dir) == self._saved["job"]["data"]["cache_dir"]:
                cache = Path(self._saved["record"].cache_dir)
        return dataclasses.replace(d, source=source, cache_dir=cache)

    def _warn_cpu(self, saved_tok: Tokenizer | None) -> None:
        """One warning line when a paper-size preset is about to train on a CPU (`startup.cpu_warning`)."""
        m, d, t = self.job.model, self.data, self.job.train
        if not self.env.is_main or self.env.device.type != "cpu" or preset_of(m) not in PAPER_PRESETS:
            return
        if saved_tok is not None:
            vocab = saved_tok.vocab_size
        elif is_pretokenized(d.source):
            vocab = pretokenized_info(d.source)["vocab_size"]
        else:  # a BPE is trained to at most its vocab size; byte and tokenizer files are read at once
            vocab = d.bpe_vocab_size if d.tokenizer == "bpe" else build_tokenizer(d.tokenizer, None, 0).vocab_size
        cfg = dataclasses.replace(m, vocab_size=m.vocab_size or vocab)
        end = min(t.steps, t.stop_after) if t.stop_after is not None else t.steps
        done = self._saved["step"] if self._saved else 0
        flops = expected_flops_per_token(cfg, d.seq_len, self.sampler.pmf(), self.job.depth.bptt_window)
        line = cpu_warning(
            cfg, count_params(cfg), end - done, self.layout.global_batch * d.seq_len, flops, self.env.device
        )
        if line:
            print(line, file=sys.stderr, flush=True)

    def _check_form(self, path: Path) -> None:
        """train.parallel may change on resume where this run reads the checkpoint's form: the single-file
        form (one process, DDP, `looplm consolidate`) loads everywhere, the sharded one (FSDP2/HSDP) into
        sharded ranks or one process; DDP ranks are refused it (checked before any collective)."""
        if ckpt.is_sharded(path) and self.env.distributed and self.job.train.parallel == "ddp":
            run = self.out_dir
            raise ckpt.CheckpointError(
                f"{path} is sharded (FSDP2/HSDP), which DDP ranks do not read: write it in the single-file form "
                f"with `looplm consolidate {run} {run}-consolidated` and resume with --train.out-dir "
                f"{run}-consolidated, or resume with --train.parallel fsdp"
            )

    def _check_steps(self, saved_steps: int, done: int) -> None:
        """A resume may train longer or shorter than its checkpoint's run planned, not shorter than it has
        trained; the warmup-stable-decay schedule then spans the new total (it is a function of it). Says
        where the run resumes."""
        steps = self.job.train.steps
        if steps < done:
            raise UserError(
                f"train.steps {steps} is below the checkpoint's step {done}: resume with --train.steps {done} or more"
            )
        if self.env.is_main:
            print(f"resuming {self.out_dir} from step {done} (of {steps})", flush=True)
        if steps != saved_steps and self.env.is_main:
            what = "extending" if steps > saved_steps else "shortening"
            print(
                f"{what} the run from {saved_steps} to {steps} steps: the learning-rate schedule is recomputed "
                f"for {steps} steps",
                flush=True,
            )

    def _plan_layout(self, resume_from: Path | None) -> BatchLayout:
        """The global batch over this run's ranks: a fresh run's micro_batch x ranks sequences per
        microbatch, a resumed run's as its checkpoint records (refused if it does not split over the ranks)."""
        t, env = self.job.train, self.env
        global_rows = t.micro_batch * env.world_size
        if resume_from is not None:
            state = ckpt.read_json(resume_from, "trainer_state.json")
            saved = job_from_dict(ckpt.read_json(resume_from, "config.json")).train
            global_rows = state.get("global_micro_batch", saved.micro_batch * state.get("world_size", 1))
        layout = BatchLayout(global_rows, t.grad_accum, env.world_size, env.rank, t.micro_batch)
        if resume_from is not None and env.is_main and (layout.rank_rows, len(layout.forwards())) != (t.micro_batch, 1):
            print(
                f"global batch {layout.global_rows} x {layout.grad_accum} sequences: {layout.rank_rows} per rank "
                f"per microbatch, in forwards of {'/'.join(str(len(f)) for f in layout.forwards())}",
                flush=True,
            )
        return layout

    def _build_tokenizer(self) -> Tokenizer:
        d = self.data
        if is_pretokenized(d.source):  # `looplm tokenize` output carries its tokenizer
            tok = open_pretokenized(d.source, d.seq_len)[0]
            asked = None if d.tokenizer == "bpe" else build_tokenizer(d.tokenizer, None, d.bpe_vocab_size)
            trained_as = pretokenized_info(d.source).get("request", {}).get("tokenizer")
            line = tokenizer_warning(self.job.data.source, tok, d.tokenizer, d.bpe_vocab_size, asked, trained_as)
            if line and self.env.is_main:
                print(line, file=sys.stderr, flush=True)
            return tok

        def corpus():
            return (
                doc.text
                for doc in iter_documents(
                    d.source,
                    text_field=d.text_field,
                    task_config=d.tasks,
                    n_task_examples=d.n_task_examples,
                    seed=self.job.train.seed,
                )
            )

        tok = (
            build_tokenizer(d.tokenizer, corpus if self.env.is_main else None, d.bpe_vocab_size)
            if (self.env.is_main or d.tokenizer != "bpe")
            else None
        )
        return D.broadcast_object(tok, self.env) if d.tokenizer == "bpe" else tok

    def _build_data(self) -> tuple[PackedDataset, PackedDataset]:
        d = self.data
        kw = dict(
            seq_len=d.seq_len,
            holdout=d.holdout,
            cache_dir=d.cache_dir,
            text_field=d.text_field,
            task_config=d.tasks,
            n_task_examples=d.n_task_examples,
            seed=self.job.train.seed,
        )
        if self.env.is_main:  # one process tokenizes; the others open the finished cache
            data = build_datasets(d.source, self.tokenizer, **kw)
        D.barrier(self.env)
        if not self.env.is_main:
            data = build_datasets(d.source, self.tokenizer, **kw)
        return data

    # -- one optimizer step ---------------------------------------------------------------------
    def _noise(self, step: int, micro: int, rows: range, L: int) -> torch.Tensor | None:
        """Initial states of global rows `rows` of the microbatch (design §2): noise with the model's
        std and truncation, or None for a model that starts from its prelude output (s0 = e, which
        the forward computes and which keeps its gradient)."""
        m = self.job.model
        if m.state_init == "input":
            return None
        return initial_state_noise(
            self.job.train.seed,
            step,
            micro,
            rows,
            L,
            m.d_model,
            self.env.device,
            std=m.state_std or None,
            truncate=m.state_init == "trunc-normal",
        )

    def _host_batch(
        self, data: PackedDataset, step: int, micro: int, n_micro: int, seed: int
    ) -> list[tuple[range, Batch]]:
        """This rank's rows of a global microbatch as (global rows, batch) per forward, on the host
        (pinned when feeding a GPU)."""
        idx = batch_indices(len(data), step, micro, self.layout.global_rows, n_micro, seed)
        out = []
        for rows in self.layout.forwards():
            batch = data.get_batch(idx[rows.start : rows.stop])
            out.append(
                (
                    rows,
                    Batch(*(x.pin_memory() for x in vars(batch).values())) if self.env.device.type == "cuda" else batch,
                )
            )
        return out

    def _host_step_batches(self, step: int) -> list[list[tuple[range, Batch]]]:
        t = self.job.train
        return [self._host_batch(self.train_data, step, i, t.grad_accum, t.seed) for i in range(t.grad_accum)]

    def _step_batches(self, step: int) -> list[list[tuple[range, Batch]]]:
        """The step's host batches (assembled ahead on the prefetch thread) and the next step's order."""
        if self._prefetched is not None and self._prefetched[0] == step:
            host = self._prefetched[1].result()
        else:
            host = self._host_step_batches(step)
        if self._prefetcher is not None:
            self._prefetched = (step + 1, self._prefetcher.submit(self._host_step_batches, step + 1))
        return host

    def _loss(self, batch: Batch, depth: int, bptt_window, state0) -> torch.Tensor:
        return microbatch_loss(
            self.wrapped,
            batch,
            depth,
            bptt_window,
            state0,
            self._autocast(),
            self.attention,
            loss=self.loss_kind,
            flex_options=self.flex_options,
        )

    def _autocast(self):
        return torch.autocast(self.env.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16)

    def train_step(self) -> StepResult:
        t, env = self.job.train, self.env
        lr = t.lr * wsd_multiplier(self.step, t.steps, t.warmup_frac, t.decay_frac)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        host = self._step_batches(self.step)
        n_targets = [sum(b.n_targets for _, b in micro) for micro in host]  # counted on the host: no device sync
        # (microbatch, global rows, batch) of each forward: one per microbatch unless the rank's rows are split
        forwards = [(i, rows, b.to(env.device, non_blocking=True)) for i, micro in enumerate(host) for rows, b in micro]
        depths = [self.sampler.draw() for _ in range(t.grad_accum)]
        n_global = D.all_reduce_int(sum(n_targets), env)
        scale = env.world_size / max(n_global, 1)  # DDP/FSDP average gradients over ranks
        ce_sums = [torch.zeros((), dtype=torch.float64, device=env.device) for _ in range(t.grad_accum)]
        for k, (i, rows, batch) in enumerate(forwards):
            # gradients are reduced across ranks once per step, in the last forward's backward
            with P.gradient_sync(self.wrapped, env, t.parallel, sync=k == len(forwards) - 1):
                state0 = self._noise(self.step, i, rows, batch.inputs.shape[1])
                ce_sum = self._loss(batch, depths[i], self.job.depth.bptt_window, state0)
                (ce_sum * scale).backward()
            ce_sums[i] = ce_sums[i] + ce_sum.detach().double()
        # (CE sum, targets) per microbatch, summed over ranks: the learned prior's feedback (design §4)
        stats = torch.stack([torch.stack(ce_sums), torch.tensor(n_targets, dtype=torch.float64, device=env.device)], 1)
        stats = D.all_reduce_sum(stats, env).cpu()
        for depth, (loss_sum, n) in zip(depths, stats.tolist()):
            self.sampler.observe(depth, loss_sum, int(n))
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), t.grad_clip if t.grad_clip > 0 else float("inf")
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.depth_metrics = self.sampler.update()
        self.step += 1
        loss = float(stats[:, 0].sum() / max(stats[:, 1].sum(), 1))
        return StepResult(
            loss,
            depths,
            int(stats[:, 1].sum()),
            float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm),
            lr,
        )

    @torch.no_grad()
    def evaluate(self, depth: int | None = None) -> float:
        """Validation loss (token mean) at `depth` (default: the sampler's rounded mean) with
        the deterministic seeded initial state."""
        t = self.job.train
        depth = depth or max(1, round(self.sampler.mean()))
        ce_sum, n_targets = torch.zeros((), dtype=torch.float64, device=self.env.device), 0
        for i in range(t.eval_batches):
            for _, host in self._host_batch(self.val_data, 0, i, t.eval_batches, seed=1):
                n_targets += host.n_targets
                batch = host.to(self.env.device, non_blocking=True)
                kw = {"flex_options": self.flex_options} if self.attention == "flex" else {}
                ce_sum += cross_entropy_sum(
                    self.wrapped,
                    batch,
                    depth,
                    self._autocast(),
                    loss=self.loss_kind,
                    init="seeded",
                    example_ids=batch.example_ids,
                    attention=self.attention,
                    **kw,
                ).double()
        total = D.all_reduce_sum(
            torch.stack([ce_sum, torch.tensor(float(n_targets), dtype=torch.float64, device=self.env.device)]), self.env
        ).tolist()
        return float(total[0] / max(total[1], 1))

    def warm_up_compile(self) -> None:
        """Compile every graph training and evaluation use before the first step: a forward and
        backward at a depth past the backprop window (so the no-grad prefix runs too), then the
        gradients are dropped. Drawn depths replay these graphs; later compiles are recompiles."""
        t, env = self.job.train, self.env
        b = self.job.depth.bptt_window
        depth = min(self.job.depth.cap, (b + 1) if b is not None else 2)
        rows, host = self._host_batch(self.train_data, 0, 0, t.grad_accum, t.seed)[0]
        batch = host.to(env.device)
        state0 = self._noise(0, 0, rows, batch.inputs.shape[1])
        self._loss(batch, depth, b, state0).backward()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            self._loss(batch, 1, None, state0)
        self.recompiles_baseline = P.compiled_graphs()

    def recompiles(self) -> int:
        """Graphs compiled since the warm-up (0 means drawn depths replayed the warm-up graphs)."""
        return P.compiled_graphs() - self.recompiles_baseline if self.recompiles_baseline is not None else 0

    # -- the loop -------------------------------------------------------------------------------
    def model_summary(self) -> str:
        """One line on the model and where it trains, e.g. 'model: 0.87 M params, vocab 258 (byte),
        context 256, device cpu, fp32'."""
        m = self.job.model
        return model_line(
            self.n_params,
            m.vocab_size,
            self.tokenizer,
            m.max_seq_len,
            self.env.device,
            precision_name(self.dtype),
            rows=self.job.data.seq_len,
            world_size=self.env.world_size,
        )

    def depth_summary(self) -> str:
        """One line naming the depth sampler and the backprop window it trains with (design §3),
        e.g. 'depth: pln mean 5, backprop window b = 10 (truncated)'."""
        d, b = self.job.depth, self.job.depth.bptt_window
        if d.sampler == "fixed":
            what = f"fixed R = {int(d.depth)}"
        elif d.sampler == "pln":
            what = f"pln mean {d.depth:g}"
        elif d.sampler == "uniform":
            what = f"uniform {d.low}..{d.high}"
        else:
            lc = d.learned
            init = f"from {lc.init_from}" if lc.init_from is not None else lc.init
            what = f"learned prior (init {init}{', frozen' if lc.frozen else ''}, target mean {d.depth:g})"
        deepest = int(np.flatnonzero(self.sampler.pmf()).max()) + 1
        if b is None:
            window = "b = R (full BPTT)"
        elif b >= deepest:
            window = f"b = {b} (full BPTT: no depth above {deepest} is drawn)"
        else:
            window = f"b = {b} (truncated)"
        return f"depth: {what}, backprop window {window}"

    def fit(self) -> dict:
        t, env = self.job.train, self.env
        end = min(t.steps, t.stop_after) if t.stop_after is not None else t.steps
        tokens_per_step = self.layout.global_batch * self.job.data.seq_len
        if env.is_main:
            print(self.model_summary(), flush=True)
            print(self.depth_summary(), flush=True)
        bar = None
        if env.is_main and t.progress:
            from looplm.train.progress import progress_bar

            bar = progress_bar(end, self.step, "train")
        if self.compiled and self.step < end:
            t0 = time.perf_counter()
            self.warm_up_compile()
            if bar is not None:
                bar.write(
                    f"compiled blocks and injection in {time.perf_counter() - t0:.1f} s ({P.compiled_graphs()} graphs)"
                )
        tokens_before = self.tokens_seen
        try:
            last = self._loop(end, bar, tokens_per_step)
        except KeyboardInterrupt:
            self._close(bar, wait=False)
            raise TrainingInterrupted(self.step, self._checkpoint_step(), min(end, t.checkpoint_every)) from None
        self._close(bar)
        if env.is_main and isinstance(self.sampler, LearnedDepthPrior):
            plot_prior(self.logger.path, self.out_dir / "depth_prior.png", title=str(self.out_dir))
        return {
            "step": self.step,
            "start_step": self.start_step,
            "checkpoint": str(last or self.latest_checkpoint()),
            "out_dir": str(self.out_dir),
            "tokens": self.tokens_seen,
            "session_tokens": self.tokens_seen - tokens_before,
            "elapsed_s": self.elapsed,
        }

    def _close(self, bar, wait: bool = True) -> None:
        """End the session: the asynchronous checkpoint in flight committed, the bar, prefetch thread and
        metrics closed (also on Ctrl-C, where a batch being assembled is not waited for)."""
        self.checkpointer.wait()
        if bar is not None:
            bar.close()
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=wait, cancel_futures=True)
            self._prefetched = None
        self.logger.close()

    def _on_grid(self, step: int) -> tuple[bool, bool]:
        """Whether every run logs a training record and a validation record at `step` (a session also
        logs its last step, off this grid)."""
        t = self.job.train
        return step % t.log_every == 0, bool(t.eval_every) and step % t.eval_every == 0

    def _checkpoint_step(self) -> int | None:
        latest = self.latest_checkpoint()
        return ckpt.read_json(latest, "trainer_state.json")["step"] if latest is not None else None

    def _loop(self, end: int, bar, tokens_per_step: int) -> Path | None:
        """Train to step `end`; the last checkpoint written, if any."""
        t = self.job.train
        # the logging window's depths live on the trainer (a checkpoint keeps them: a run resumed inside
        # a window logs what an uninterrupted run does); its tokens and time are this session's
        window_t, window_tokens, last = time.perf_counter(), 0, None
        window_depths = self.window_depths
        while self.step < end:
            t0 = time.perf_counter()
            res = self.train_step()
            self.checkpointer.poll()  # commits an asynchronous checkpoint whose shards are all written
            dt = time.perf_counter() - t0
            self.elapsed += dt
            self.tokens_seen += tokens_per_step
            step_flops = (
                mean_flops_per_token(self.job.model, self.job.data.seq_len, res.depths, self.job.depth.bptt_window)
                * tokens_per_step
            )
            self.flops_seen += step_flops
            window_tokens += tokens_per_step
            window_depths += res.depths
            if not math.isfinite(res.loss):
                raise FloatingPointError(f"non-finite loss at step {self.step}; lower --train.lr")
            if bar is not None:  # this step's values, then the step (a plain-lines bar prints at update)
                bar.set_postfix(
                    loss=f"{res.loss:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}", R=",".join(map(str, res.depths))
                )
                bar.update(1)
            on_grid, eval_on_grid = self._on_grid(self.step)
            if on_grid or self.step == end:
                now = time.perf_counter()
                rate = window_tokens / max(now - window_t, 1e-9)
                record = {
                    "loss": res.loss,
                    "lr": res.lr,
                    "grad_norm": res.grad_norm,
                    "depths": res.depths,
                    "mean_depth_window": float(np.mean(window_depths)),
                    "tokens": self.tokens_seen,
                    "tokens_per_s": rate,
                    "flops": self.flops_seen,
                    "model_tflops_per_s": rate
                    * mean_flops_per_token(
                        self.job.model, self.job.data.seq_len, window_depths, self.job.depth.bptt_window
                    )
                    / 1e12,
                    # over the current pmf: a learned prior moves it every update (design §5)
                    "expected_flops_per_token": expected_flops_per_token(
                        self.job.model, self.job.data.seq_len, self.sampler.pmf(), self.job.depth.bptt_window
                    ),
                    "elapsed_s": self.elapsed,
                }
                if self.compiled:
                    record["compile_recompiles"] = self.recompiles()
                record.update({f"depth/{k}": v for k, v in self.depth_metrics.items()})
                self.logger.log(record, self.step)
                if on_grid:  # a session's last step off the grid is shown, and its window goes on
                    window_t, window_tokens = now, 0
                    window_depths.clear()
            side = time.perf_counter()  # evaluation and checkpoints are no training time: not in the rate
            if t.eval_every and (eval_on_grid or self.step == end):
                val = self.evaluate()
                self.logger.log({"val_loss": val, "val_ppl": math.exp(min(val, 50))}, self.step)
                if bar is not None:
                    bar.write(f"step {self.step}: val loss {val:.4f} (ppl {math.exp(min(val, 50)):.3f})")
            if self.step % t.checkpoint_every == 0 or self.step == end:
                last = self.save()
            window_t += time.perf_counter() - side
        return last

    # -- checkpoints ----------------------------------------------------------------------------
    def latest_checkpoint(self) -> Path | None:
        latest = self.ckpt_root / "latest"
        return self.ckpt_root / latest.read_text().strip() if latest.exists() else None

    def save(self) -> Path:
        """Write a checkpoint of the current step (atomically; see `looplm.train.checkpointing` for the
        single-file and sharded forms); every rank must call it."""
        state = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "flops_seen": self.flops_seen,
            "elapsed_s": self.elapsed,
            "window_depths": list(self.window_depths),
            "sampler": self.sampler.state_dict(),
            "world_size": self.env.world_size,
            "global_micro_batch": self.layout.global_rows,  # the data position is (step, this, grad_accum)
        }

        def write_files(tmp: Path) -> None:
            ckpt.write_json(tmp, "config.json", self.job.to_dict())
            # the data as this run resolved it (config.json keeps the job as given)
            record = DataRecord.from_job({**self.job.to_dict(), "data": jsonable(dataclasses.asdict(self.data))})
            ckpt.write_data_record(tmp, record.with_splits(self.train_data, self.val_data))
            self.tokenizer.save(tmp)

        return self.checkpointer.save(self.step, state, write_files)

    def _load(self, path: Path) -> None:
        state = self.checkpointer.load(path)
        self.sampler.load_state_dict(state["sampler"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.flops_seen, self.elapsed = state["flops_seen"], state["elapsed_s"]
        self.window_depths[:] = state.get("window_depths", [])  # checkpoints before it: an empty window
