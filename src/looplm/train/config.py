"""Typed configuration of a training job and its named presets.

A job is four dataclasses: the model shape (`ModelConfig`), the depth sampler (`DepthConfig`),
the data (`DataConfig`) and the optimisation/run settings (`TrainConfig`). The CLI is generated
from them; checkpoints store them as JSON.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from looplm.config import ModelConfig, model_preset, shown_default
from looplm.data.record import BUILTIN_TEXT
from looplm.data.tasks import DEFAULT_TASK_EXAMPLES, TaskConfig
from looplm.depth.config import DepthConfig
from looplm.errors import UserError
from looplm.eval.report import EvalConfig


@dataclass
class DataConfig:
    """Where training text comes from and how it is tokenized and packed."""

    source: str = BUILTIN_TEXT
    """'shakespeare' (a built-in corpus of twelve plays), 'tasks' (the built-in generator of depth-sensitive tasks),
    a text file or folder, a .jsonl file, a `looplm tokenize` folder, or hf:<name>[:<split>]. The paper-size
    presets (S, M, L) have no default: give your corpus."""
    tokenizer: str = "byte"
    """'byte' (no files needed), 'bpe' (train one on the training corpus) or a path to a tokenizer.json."""
    bpe_vocab_size: int = 4096
    """Vocabulary size when training a BPE tokenizer."""
    seq_len: int = 256
    """Tokens per packed training sequence (at most the model's max_seq_len)."""
    holdout: float = 0.05
    """Fraction of documents held out for validation: drawn from (seed, number of documents), so a
    corpus that gains or loses documents after training splits anew (evaluate on the corpus as trained)."""
    text_field: str = "text"
    """Field of each JSONL record (or HF dataset row) that holds the text."""
    cache_dir: Path = Path(".cache/looplm")
    """Where memory-mapped token caches are written (reused across runs)."""
    n_task_examples: int = DEFAULT_TASK_EXAMPLES
    """Training examples drawn from the task generator (source 'tasks')."""
    tasks: TaskConfig = field(default_factory=TaskConfig)
    """Which generator tasks and difficulties (source 'tasks')."""


def flat_diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Every leaf of two config dicts that differs, as "key.sub: old -> new" (what a resume into
    another config is refused with)."""
    out = []
    for k in sorted(set(a) | set(b)):
        key = f"{prefix}{k}"
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += flat_diff(va, vb, key + ".")
        elif va != vb:
            out.append(f"{key}: {va!r} -> {vb!r}")
    return out


def check_choices(cfg, prefix: str = "") -> None:
    """Refuse a field of dataclass `cfg` typed `Literal[...]` whose value is none of its choices: the
    command line restricts them, but a job built in Python or read from JSON is not checked there."""
    hints = typing.get_type_hints(type(cfg), include_extras=True)
    for f in dataclasses.fields(cfg):
        hint = hints[f.name]
        if typing.get_origin(hint) is Annotated:
            hint = typing.get_args(hint)[0]
        if typing.get_origin(hint) is Literal:
            allowed = typing.get_args(hint)
            value = getattr(cfg, f.name)
            if value not in allowed:
                raise UserError(f"unknown {prefix}{f.name} {value!r}; choose one of {', '.join(map(str, allowed))}")


@dataclass
class TrainConfig:
    """Optimisation and run settings (design §6)."""

    steps: int = 600
    """Optimizer steps T (the warmup-stable-decay schedule spans them). A resume may change it (the schedule is
    recomputed for the new total), down to the checkpoint's step."""
    micro_batch: int = 16
    """Sequences per microbatch on each rank. A resumed run keeps its checkpoint's global batch; this then bounds
    the sequences of one forward (a run resumed on fewer ranks splits each rank's rows into several forwards)."""
    grad_accum: int = 1
    """Microbatches per optimizer step (each draws its own depth)."""
    lr: float = 3e-3
    """Peak learning rate."""
    warmup_frac: float = 0.05
    """Warmup length as a fraction of steps (design §6: T/20)."""
    decay_frac: float = 0.1
    """Cosine decay length as a fraction of steps (design §6: T/10), to 0.1x."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on norm gains or injection parameters)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.98
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute dtype: auto = bf16 autocast on CUDA, fp32 on CPU; bf16 = bf16 autocast on either."""
    parallel: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    """Data parallelism under torchrun: DDP, FSDP2 (fully_shard per block; bf16 compute with fp32 gradient
    reduction when precision is bf16, the injection kept fp32), or HSDP (FSDP2 sharded within a node,
    replicated across nodes)."""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile every block and the injection (auto: on for CUDA, off on CPU); the recompile count after
    warm-up is logged as compile_recompiles."""
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    """Kernel for document-masked packed rows: boolean-mask SDPA, or FlexAttention block masks (auto: flex on CUDA for
    head_dim >= 16, the least torch's fused flex kernel takes; else SDPA)."""
    flex_kernel_options: Annotated[tuple[str, ...], shown_default("none", if_empty=True)] = ()
    """Extra FlexAttention kernel options as KEY=VALUE (torch's kernel_options, e.g. fwd_BLOCK_M=128
    bwd_BLOCK_N1=64: tile sizes for long sequences); CUDA only. ROWS_GUARANTEED_SAFE is unsafe for packed
    rows (see blocks.flex_kernel_options)."""
    cross_entropy: Literal["auto", "full", "chunked"] = "auto"
    """Next-token cross-entropy: full (fp32 logits of the whole microbatch), chunked (head matmul + CE in row
    chunks, never holding [B, L, V] fp32 logits; same values within fp32 rounding); auto: chunked on CUDA."""
    activation_checkpointing: Literal["none", "block"] = "none"
    """'block' recomputes each block's insides in backward, keeping only its input (fits full BPTT at large R)."""
    prefetch: bool = True
    """Assemble the next step's batches on a background thread while this step computes (pinned memory and
    non_blocking copies on CUDA)."""
    device: str = "auto"
    """Device: auto (CUDA when available), cpu, cuda, cuda:N; under torchrun each rank takes cuda:LOCAL_RANK."""
    seed: int = 0
    """Seed of the model init, data order and initial states."""
    out_dir: Path = Path("runs/tiny")
    """Run folder: checkpoints, metrics.jsonl, TensorBoard logs."""
    resume: bool = False
    """Continue from the latest checkpoint in out_dir (the config must match, but for run settings such as steps,
    micro_batch, parallel, logging and eval); with none there, start a new run (and say so)."""
    checkpoint_every: int = 200
    """Write a checkpoint every this many steps (and at the end)."""
    keep_checkpoints: int = 2
    """How many recent checkpoints to keep on disk."""
    async_checkpoint: bool = False
    """Write sharded (FSDP2/HSDP) checkpoints in the background: the state is copied to host memory and training
    goes on; the checkpoint appears (manifest, rename, `latest`) once every rank has written its shards. No effect
    on single-file checkpoints (one process, DDP)."""
    eval_every: int = 200
    """Validation loss every this many steps (0 disables)."""
    eval_batches: int = 4
    """Validation microbatches per evaluation."""
    log_every: int = 10
    """Metrics line every this many steps."""
    tensorboard: bool = True
    """Also log to TensorBoard when it is installed."""
    wandb: bool = False
    """Also log to Weights & Biases when it is installed."""
    progress: bool = True
    """Show a progress bar."""
    stop_after: int | None = None
    """Stop (with a checkpoint) after this many steps of the schedule; for budgeted or staged runs."""


@dataclass
class TrainJob:
    """Everything a training run needs."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(vocab_size=0))
    """The model; vocab_size 0 means the tokenizer's size (set when the run builds its tokenizer)."""
    depth: DepthConfig = field(default_factory=DepthConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The depth report printed when training ends."""

    def to_dict(self) -> dict:
        return jsonable(dataclasses.asdict(self))

    def resolved(self) -> TrainJob:
        """This job with its derived defaults made explicit: the backprop window 'auto' replaced by
        the window it means for the sampler (design §3). The trainer runs and records (config.json)
        the resolved job, so a checkpoint states the window it was trained with. The other sections
        are shared with this job, not copied."""
        return dataclasses.replace(
            self, depth=dataclasses.replace(self.depth, bptt_window=self.depth.effective_bptt_window())
        )


def jsonable(obj):
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def job_from_dict(data: dict) -> TrainJob:
    """Rebuild a job from `TrainJob.to_dict()` output (checkpoints)."""
    data_cfg = dict(data["data"])
    data_cfg["tasks"] = TaskConfig(**{**data_cfg["tasks"], "kinds": tuple(data_cfg["tasks"]["kinds"])})
    data_cfg["cache_dir"] = Path(data_cfg["cache_dir"])
    train_cfg = dict(data["train"], out_dir=Path(data["train"]["out_dir"]))
    train_cfg["flex_kernel_options"] = tuple(train_cfg.get("flex_kernel_options", ()))
    return TrainJob(
        model=ModelConfig.from_dict(data["model"]),
        depth=DepthConfig.from_dict(data["depth"]),
        data=DataConfig(**data_cfg),
        train=TrainConfig(**train_cfg),
        eval=EvalConfig(
            **{
                **data["eval"],
                "depths": tuple(data["eval"]["depths"]),
                "sample_depths": tuple(data["eval"].get("sample_depths", ())),
                "output": Path(data["eval"]["output"]) if data["eval"]["output"] else None,
            }
        ),
    )


def vocab_size_for(job_vocab: int, tokenizer_vocab: int) -> int:
    """The vocabulary a run trains with: the tokenizer's when the job says 0 (every preset), else the job's
    own, which may pad the embedding and head past the tokenizer (rows no token id reaches) but not fall
    short of it."""
    if job_vocab == 0:
        return tokenizer_vocab
    if job_vocab < tokenizer_vocab:
        raise UserError(
            f"model.vocab_size {job_vocab} is smaller than the tokenizer's {tokenizer_vocab} tokens; "
            "leave it at 0 (the tokenizer's size) or give at least that many"
        )
    return job_vocab


def _training_model(name: str) -> ModelConfig:
    return dataclasses.replace(model_preset(name), vocab_size=0)  # 0: the tokenizer's size


def _tiny() -> TrainJob:
    # The main job: a 0.87 M-parameter looped LM on the built-in Shakespeare scenes (byte level), sized
    # to train on 2 CPU cores in about 5-6 minutes (400 steps of 16 x 256 tokens). On real text this
    # shape uses its depth: held-out perplexity falls from R = 1 to R = 3-5 and holds to R = 32. The
    # task generator is one option away (--data.source tasks).
    # precision auto: fp32 on CPU (the main job's numbers), bf16 autocast on CUDA.
    return TrainJob(
        model=_training_model("tiny"),
        depth=DepthConfig(sampler="pln", depth=5.0),  # b: auto = 10 for PLN, full BPTT if switched to fixed
        data=DataConfig(
            source="shakespeare",
            tokenizer="byte",
            seq_len=256,
            tasks=TaskConfig(kinds=("add_msd",), min_difficulty=1, max_difficulty=3),
        ),
        train=TrainConfig(steps=400, micro_batch=16, lr=3e-3, out_dir=Path("runs/tiny")),
        eval=EvalConfig(sample_depths=(1, 5), sharing_sequences=8),
    )


def _required_source():
    """tyro's MISSING, so that the command line asks for --data.source; None where tyro is not
    installed (library use, the GPU benchmark's machine), which the trainer refuses alike."""
    try:
        import tyro
    except ImportError:
        return None
    return tyro.MISSING


def _paper(size: str, lr: float) -> TrainJob:
    # design §1/6: the paper's sizes at 8K context, PLN-5 with b = 10 (the 'auto' window of the sampled
    # priors; a fixed depth set on the command line trains with full BPTT); batch sizes are per rank. No
    # built-in data fits a model of this size, so --data.source is required, and precision
    # auto trains in bf16 autocast on CUDA.
    return TrainJob(
        model=_training_model(size),
        depth=DepthConfig(sampler="pln", depth=5.0),
        data=DataConfig(source=_required_source(), tokenizer="bpe", bpe_vocab_size=64256, seq_len=8192),
        train=TrainConfig(steps=20_000, micro_batch=1, grad_accum=8, lr=lr, out_dir=Path(f"runs/{size}")),
        # The end-of-training report sized for one GPU (fp32 model, 8K rows; `looplm.eval.memory`, about 28 GB
        # at L): 4 rows per forward, 32 rows (262K tokens), the sharing table on 8 CacheEval spans (App. D.4).
        eval=EvalConfig(batch_size=4, max_sequences=32, sharing_sequences=8, cacheeval_span=(1024, 512)),
    )


JOB_PRESETS = {
    "tiny": ("CPU-sized looped LM on built-in Shakespeare text (minutes on 2 cores)", _tiny),
    "S": ("paper Small: d 1536, 24/6 heads, FFN 4352", lambda: _paper("S", 1.5e-3)),
    "M": ("paper Medium: d 3072, 48/12 heads, FFN 8704", lambda: _paper("M", 1e-3)),
    "L": ("paper Large: d 6144, 96/24 heads, FFN 17408", lambda: _paper("L", 5e-4)),
}


def job_preset(name: str) -> TrainJob:
    if name not in JOB_PRESETS:
        raise UserError(f"unknown preset {name!r}; choose one of {', '.join(JOB_PRESETS)}")
    return JOB_PRESETS[name][1]()
