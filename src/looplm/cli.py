"""`looplm` command line, generated from the typed configs by tyro.

  looplm train tiny [--train.steps N ...]     train a preset (override any field), then report
  looplm eval CHECKPOINT [--depths 1 2 5 ...]  perplexity and task accuracy against depth
  looplm generate CHECKPOINT --prompt TEXT    continue prompts with a terminal (or full) KV cache
  looplm distill TEACHER [--steps N ...]      distil a prefill student (design §9), then compare prefill arms
  looplm analyze CHECKPOINT [--horizon 64]    fixed-point diagnostics (design §11): JSON report, plots, summary
  looplm rl CHECKPOINT [--estimator reuse]    GRPO post-training with rollout-state reuse (design §10)
  looplm tokenize SRC OUT [--tokenizer bpe]   tokenize a corpus once into a folder to train from
  looplm consolidate CHECKPOINT OUT           a sharded (FSDP2/HSDP) checkpoint in the single-file form

Errors a user can fix (options, files, checkpoints) end with a one-line `error: ...` on stderr and
exit status 2; anything else is an internal error (one line, exit status 1) whose traceback
`looplm --debug ...` or LOOPLM_DEBUG=1 prints. `looplm --version` prints the version. A command line
tyro cannot parse is said in one line from tyro's parse-error event (`_rejected`), with the command's
own options as suggestions (`_options`, read from the same typed configs tyro reads).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Literal

import tyro

from looplm.analyze.report import AnalyzeConfig
from looplm.data.tasks import DEFAULT_TASK_EXAMPLES
from looplm.distill.config import DistillConfig
from looplm.errors import UserError, install_hint
from looplm.eval.report import EvalConfig, data_name, report_name
from looplm.infer.depth_rule import CacheKind, DepthRule
from looplm.infer.generate import SamplingConfig
from looplm.infer.prefill import PrefillArm
from looplm.rl.config import RLConfig
from looplm.serve.engine import EngineConfig
from looplm.train.config import JOB_PRESETS, TrainJob

# What a user can fix: looplm's UserError (bad options, data, checkpoints), a path that is not there or
# not readable, a run whose loss diverged (the message says which option to change).
USER_ERRORS = (
    UserError,
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
    FloatingPointError,
)
DEBUG_ENV = "LOOPLM_DEBUG"

PresetJob = tyro.extras.subcommand_type_from_defaults(
    {name: make() for name, (_, make) in JOB_PRESETS.items()},
    {name: desc for name, (desc, _) in JOB_PRESETS.items()},
    prefix_names=False,
)


def _progress(total: int, desc: str, disable: bool = False, unit: str = "batch"):
    """A progress bar on stderr, off when stderr is not a terminal (a log file or a pipe gets no bar redraws)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=False, disable=True if disable else None)


def _report(
    model, tokenizer, data, cfg: EvalConfig, device, out_json: Path, prefill=None, progress: bool = True
) -> dict:
    """`looplm eval`'s (and the end of `looplm train`'s) report: measured under a progress bar, printed as
    a table, written to `out_json` with its plots beside it."""
    from looplm.eval.plots import write_run_plots
    from looplm.eval.report import depth_report, format_report, write_report

    tasks = len(data.held_out_examples(cfg.task_examples, cfg.task_seed)) if data.is_tasks and cfg.task_examples else 0
    task_batches = -(-tasks // cfg.batch_size)  # the examples left once the training prompts are dropped
    per_depth = (
        -(-cfg.max_sequences // cfg.batch_size) + task_batches + (cfg.sharing_sequences > 0) + len(prefill or ())
    )
    # in recurrences, not batches: a batch at depth R costs about R at depth 1, so the ETA holds across depths
    bar = _progress(sum(cfg.depths) * per_depth, "eval", disable=not progress, unit="R")
    try:
        report = depth_report(model, tokenizer, data, cfg, device=device, progress=bar.update, prefill=prefill)
    finally:
        bar.close()
    print(format_report(report))
    write_report(report, out_json)
    for picture in write_run_plots(report, Path(out_json)):
        print(f"plot:        {picture}")
    return report


def _run_folder(checkpoint: Path) -> Path:
    """Where reports about a checkpoint go by default: the run folder of a run's checkpoint
    (<run>/checkpoints/step_N), else the checkpoint folder itself (a converted checkpoint, an exported
    Hugging Face folder), never a folder above it."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint


def _device(pref: str):
    """The torch device of a --device option: auto is CUDA when available, else the CPU."""
    from looplm.checkpoint import resolve_device

    return resolve_device(pref)


def _other_data(path: Path, data: str | None, record) -> str | None:
    """`data` when it names other data than the checkpoint records (`record`, from `_data_record`),
    else None: reports on other data go beside the run's own, under their own names."""
    own = _recorded_data(path)
    return data if data is not None and (own is None or own.source != record.source) else None


def _recorded_data(path: Path):
    """The checkpoint's data record (`looplm.checkpoint.load_data`), or None for a Hugging Face folder
    that records none (one saved by Transformers alone)."""
    from looplm.checkpoint import is_hf_folder, load_data

    try:
        return load_data(path)
    except UserError:
        if is_hf_folder(path):
            return None
        raise


def _data_record(path: Path, data: str | None, max_seq_len: int):
    """The data record a command reads for checkpoint `path`, with its source replaced by `data` (--data).
    A Hugging Face folder that records no data reads `data` alone (and without it is a user error)."""
    from looplm.checkpoint import load_data
    from looplm.data.record import DataRecord

    record = _recorded_data(path)
    if record is not None:
        return record.with_source(data)
    if data is None:
        return load_data(path)  # raises its one-line error, which asks for --data
    return DataRecord(source=data, seq_len=min(DataRecord.seq_len, max_seq_len), origin="converted")


def _prefill_arms(model, names, student_path=None) -> list:
    """Prefill arms by name for `model`; the student arm loads a `looplm distill` checkpoint
    (refused if it was distilled from another teacher)."""
    from looplm.infer.prefill import Prefill

    student = None
    if student_path is not None and "student" not in names:
        raise UserError("--student is read only with --prefill student")
    if "student" in names:
        if student_path is None:
            raise UserError("--prefill student needs --student PATH (a `looplm distill` checkpoint or run folder)")
        from looplm.distill.checkpoint import load_student

        student, _ = load_student(student_path, model)
    return [Prefill(name, student if name == "student" else None) for name in dict.fromkeys(names)]


def train(job: Annotated[PresetJob, tyro.conf.arg(name="")]) -> None:  # type: ignore[valid-type]
    """Train a looped LM from a preset (tiny, S, M, L); any field can be overridden.

    Args:
        job: The preset to start from; its fields are the options below.


    Runs on one process, or under `torchrun --nproc_per_node N` (DDP, or FSDP2 with
    --train.parallel fsdp). When training ends, prints perplexity and task accuracy against
    test-time depth and where the checkpoint, metrics and logs are.
    """
    from looplm.checkpoint import load_model
    from looplm.train import distributed as D
    from looplm.train.trainer import Trainer, TrainingInterrupted

    job: TrainJob
    start = time.time()
    trainer = Trainer(job)
    env = trainer.env
    try:
        summary = trainer.fit()
    except TrainingInterrupted as stop:
        D.shutdown(env)
        raise KeyboardInterrupt(_interrupted_line(stop, trainer.out_dir) if env.is_main else "") from None
    D.shutdown(env)
    if not env.is_main:
        return
    ckpt_path = Path(summary["checkpoint"])
    first, last, took = (
        summary["start_step"],
        summary["step"],
        f"{summary['session_tokens']:,} tokens in {time.time() - start:.0f} s",
    )
    if first == 0:
        print(f"\ntrained {last} steps, {took}")
    elif last > first:  # a resumed run: its steps of this session, numbered as the run counts them
        print(f"\ntrained steps {first + 1}..{last} ({last - first} this session), {took}")
    else:
        print(f"\nno steps to train: the run is at step {last} (of {job.train.steps})")
    if job.eval.depths:
        from looplm.checkpoint import load_data

        model, tokenizer, _ = load_model(ckpt_path, env.device)
        what = (
            "perplexity and exact-match task accuracy" if job.data.source == "tasks" else "perplexity and bits per byte"
        )
        print(f"\nheld-out {what} vs test-time depth R (trained with {job.depth.sampler} depth {job.depth.depth:g}):")
        _report(
            model,
            tokenizer,
            load_data(ckpt_path),
            job.eval,
            env.device,
            job.eval.output or trainer.out_dir / "eval.json",
            progress=job.train.progress,
        )
    out = trainer.out_dir
    lines = [f"checkpoint:  {ckpt_path}", f"metrics:     {out / 'metrics.jsonl'}"]
    if job.eval.depths:
        lines.append(f"report:      {job.eval.output or out / 'eval.json'}")
    if (out / "tensorboard").is_dir():
        lines.append(f"tensorboard: {out / 'tensorboard'}")
    print("\n" + "\n".join(lines))


_ARGS: list[str] | None = None  # the command line main parsed, for train's resume command


def _resume_command(out_dir: Path) -> str:
    """The command that resumes the run in `out_dir`: the one this process was started with, its
    --train.resume and --train.out-dir replaced by `--train.resume --train.out-dir <absolute out_dir>`."""
    import shlex

    tail = ["--train.resume", "--train.out-dir", os.path.abspath(out_dir)]
    if _ARGS is None or _ARGS[:1] != ["train"]:  # train() called as a function: the options are not known
        return f"looplm train PRESET [OPTIONS] {shlex.join(tail)}"
    kept, args = [], iter(_ARGS)
    for arg in args:
        name = arg.split("=", 1)[0].replace("_", "-")
        if name in ("--train.resume", "--train.no-resume"):
            continue
        if name == "--train.out-dir":
            if "=" not in arg:
                next(args, None)
            continue
        kept.append(arg)
    return shlex.join(["looplm", *kept, *tail])


def _interrupted_line(stop, out_dir: Path) -> str:
    if stop.checkpoint_step is None:
        return (
            f"interrupted at step {stop.step}, before the first checkpoint (step {stop.first_checkpoint}): "
            "nothing to resume; run the same command to start again"
        )
    return (
        f"interrupted at step {stop.step}; last checkpoint step {stop.checkpoint_step}; resume with: "
        f"{_resume_command(out_dir)}"
    )


def evaluate(
    checkpoint: Annotated[Path, tyro.conf.Positional],
    cfg: Annotated[EvalConfig, tyro.conf.arg(name="")] = EvalConfig(),
    data: str | None = None,
    device: str = "auto",
    prefill: tuple[PrefillArm, ...] = ("teacher",),
    student: Path | None = None,
) -> None:
    """Held-out perplexity against test-time depth, and exact-match accuracy when the checkpoint was
    trained on the task generator.

    Args:
        checkpoint: A checkpoint folder, or a run folder (its latest checkpoint is used).
        cfg: What to measure.
        data: Held-out data to score instead of the checkpoint's own: tasks, shakespeare, a text file or
            folder, a .jsonl, a `looplm tokenize` folder or hf:<name>[:<split>]. Default: the data the
            checkpoint records (a converted release: the built-in Shakespeare text, or its convert --data).
            Other data is reported in <run>/eval-<data>.json, beside the run's own eval.json.
        device: Torch device to evaluate on: auto (CUDA when available), cpu, cuda, cuda:1, ...
        prefill: Prefill arms to compare (teacher, student, r1, r2): each arm's continuation perplexity and
            generator-task exact match per depth (the paper's Table 5); teacher alone adds nothing.
        student: Distilled student (`looplm distill` output) for the student arm.
    """
    import torch

    from looplm.checkpoint import load_model, resolve

    with torch.no_grad():  # not set_grad_enabled(False): main() may be called in-process
        device = _device(device)
        path = resolve(checkpoint)
        model, tokenizer, _ = load_model(path, device)
        cfg.validate(model.cfg.max_depth, model.cfg.max_seq_len, prefix="--", tokenizer=tokenizer)
        record = _data_record(path, data, model.cfg.max_seq_len)
        cfg.check_span(record.seq_len, prefix="--")
        if cfg.cacheeval_span is not None:  # before the other measurements: a row length fits, but a document?
            from looplm.eval.cached import require_span_room

            require_span_room(record.validation(tokenizer), cfg.cacheeval_span)
        if cfg.generation_examples and not record.is_tasks:
            print(
                f"note: --generation-examples scores generator tasks; this data ({record.source}) has none",
                file=sys.stderr,
            )
        out = cfg.output or _run_folder(path) / report_name(_other_data(path, data, record))
        arms = None
        if tuple(prefill) != ("teacher",):
            arms = _prefill_arms(model, prefill, student)
        _report(model, tokenizer, record, cfg, device, out, prefill=arms)
    print(f"\nreport: {out}")


@dataclasses.dataclass
class GenerateSampling(SamplingConfig):
    """Token choice and stopping; the length and stop defaults follow the checkpoint's data."""

    max_new_tokens: int | None = None
    """Largest number of tokens generated per prompt; default: 16 for a checkpoint trained on the task
    generator (one short answer), 64 otherwise, at most what the model's context leaves after the prompt."""
    stop: tuple[str, ...] | None = None
    """Stop a prompt's generation when its text contains one of these strings (cut before it); default:
    a newline for a checkpoint trained on the task generator (it ends each answer with one), none for text."""

    def __post_init__(self) -> None:
        self.resolved(tasks=True).validate()  # refused as the command line is parsed, before a checkpoint loads

    def resolved(self, tasks: bool, room: int | None = None) -> SamplingConfig:
        """A plain SamplingConfig with the checkpoint-dependent defaults filled in; `room`: the most new
        tokens the context leaves after the longest prompt."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingConfig)}
        if fields["max_new_tokens"] is None:
            fields["max_new_tokens"] = min(16 if tasks else SamplingConfig.max_new_tokens, max(1, room or 1 << 30))
        if fields["stop"] is None:
            fields["stop"] = ("\n",) if tasks else ()
        return SamplingConfig(**fields)


def generate(
    checkpoint: Annotated[Path, tyro.conf.Positional],
    prompt: tuple[str, ...] | None = None,
    rule: Annotated[DepthRule, tyro.conf.arg(name="")] = DepthRule(5),
    cache: CacheKind = "terminal",
    sampling: Annotated[GenerateSampling, tyro.conf.arg(name="")] = GenerateSampling(),
    device: str = "auto",
    prefill: PrefillArm = "teacher",
    student: Path | None = None,
    compile: bool = False,
    speculate: int = 0,
    draft_depth: int = 2,
    verbose: bool = False,
) -> None:
    """Continue prompts with a KV cache; a single prompt is streamed as it is generated.

    Args:
        checkpoint: A checkpoint folder, or a run folder (its latest checkpoint is used).
        prompt: One or more prompts (repeat the text after --prompt); default (task-generator checkpoints
            only): one generator prompt of the checkpoint's first task kind. One prompt is streamed; several
            are decoded as a batch and printed each under a `--- prompt i of n ---` line.
        rule: Recurrences per token: decode and prefill depth, exit rule.
        cache: terminal (one KV bank per physical layer) or full (one bank per layer visit).
        sampling: Token choice and stopping.
        device: Torch device: auto (CUDA when available), cpu, cuda, ...
        prefill: How the prompt enters the cache: teacher (at prefill_depth), student (distilled prefill,
            needs --student and the terminal cache), r1 or r2 (the model at 1 or 2 recurrences).
        student: Distilled student (`looplm distill` output) for --prefill student.
        compile: Compile the decode step with torch.compile: faster steps after a warm-up of tens of
            seconds on a CPU (worth it for long generations; BENCHMARKS.md measures both).
        speculate: Self-speculative decoding: draft this many tokens at --draft-depth, then verify them in
            one chunk at --depth (0 = off). Greedy output with the full cache equals plain decoding.
        draft_depth: Recurrences per draft token with --speculate (below --depth).
        verbose: Print decode speed (and with --speculate the acceptance rate) to stderr.
    """
    from looplm.checkpoint import load_model, resolve
    from looplm.infer.generate import generate as run
    from looplm.infer.speculative import Speculation

    if speculate < 0:
        raise UserError(f"--speculate must be >= 0 (0 = off), got {speculate}")
    path = resolve(checkpoint)
    model, tokenizer, _ = load_model(path, _device(device))
    prompts, tasks = _generate_prompts(path, prompt)
    room = model.cfg.max_seq_len - max(len(tokenizer.encode_prompt(p)) for p in prompts) + 1
    if rule.min_depth != 1 and rule.exit_tau is None:
        raise UserError("--min-depth bounds the adaptive depth of --exit-tau; give --exit-tau too")
    if rule.prefill_depth is not None and prefill != "teacher":
        raise UserError(f"--prefill-depth sets the teacher prefill's depth; --prefill {prefill} has its own")
    (arm,) = _prefill_arms(model, (prefill,), student)
    speculation = Speculation(speculate, draft_depth) if speculate else None
    if compile:
        print("compiling the decode step (the first tokens wait for it)", file=sys.stderr, flush=True)
    stats: dict = {}
    printed = _Printed(prompts)
    printed.done(
        run(
            model,
            tokenizer,
            list(prompts),
            rule,
            cache=cache,
            sampling=sampling.resolved(tasks, room),
            on_token=printed.on_token,
            stats=stats,
            prefill=arm,
            compile=compile,
            speculate=speculation,
        )
    )
    if rule.exit_tau is not None:
        print(f"mean decode depth: {stats['mean_decode_depth']:.2f} (max {rule.depth})", file=sys.stderr)
    if verbose:
        print(_decode_line(stats, compile, speculation is not None), file=sys.stderr)


def _generate_prompts(path: Path, prompt: tuple[str, ...] | None) -> tuple[tuple[str, ...], bool]:
    """`looplm generate`'s prompts (default: a generator prompt of a task checkpoint) and whether the
    checkpoint was trained on the task generator."""
    from looplm.data import generate_examples

    data = _recorded_data(path)
    tasks = data is not None and data.is_tasks
    if prompt is None:
        if not tasks:
            raise UserError("give --prompt TEXT: only checkpoints trained on the task generator have a default prompt")
        prompt = (generate_examples(data.tasks, 1, seed=0)[0].prompt,)
    if not prompt:
        raise UserError("--prompt needs at least one text")
    return prompt, tasks


class _Printed:
    """What `looplm generate` prints: one prompt streamed (its text echoed with the first piece, so that
    nothing is printed before `generate` has accepted every setting), several each under a
    `--- prompt i of n ---` line once they are done."""

    def __init__(self, prompts: tuple[str, ...]):
        self.prompts, self.echoed = prompts, False

    def on_token(self, row: int, piece: str) -> None:
        if len(self.prompts) == 1:
            if not self.echoed:
                print(self.prompts[0], end="")
                self.echoed = True
            print(piece, end="", flush=True)

    def done(self, texts: list[str]) -> None:
        if len(self.prompts) == 1:
            print("" if self.echoed else self.prompts[0])
            return
        for i, (p, t) in enumerate(zip(self.prompts, texts), 1):  # texts may span lines: each under a header
            print(f"--- prompt {i} of {len(self.prompts)} ---\n{p}{t}")


def _decode_line(stats: dict, compile: bool, speculated: bool) -> str:
    """`looplm generate --verbose`'s line: decode speed (the first step's compile apart), speculation."""
    n, total, first = stats["decoded_tokens"], stats["decode_seconds"], stats["first_step_seconds"]
    line = f"decoded {n} tokens in {total:.2f} s ({n / max(total, 1e-9):.1f} tokens/s"
    rest = n - stats["first_step_tokens"]  # tokens decided after the first step (or speculation round)
    if compile and total > first > 0 and rest > 0:  # the first step compiled: say what the rest ran at
        step = "round" if speculated else "step"
        line += f"; the first {step} took {first:.1f} s with compiling, the rest {rest / (total - first):.1f} tokens/s"
    line += ")"
    if speculated:
        line += (
            f"; speculation: {stats['acceptance_rate']:.0%} of drafts accepted, "
            f"{stats['tokens_per_verify']:.2f} tokens per verify"
        )
    return line


def distill(
    teacher: Annotated[Path, tyro.conf.Positional],
    cfg: Annotated[DistillConfig, tyro.conf.arg(name="")] = DistillConfig(),
) -> None:
    """Distil a prefill student from a trained looped model (design §9), then compare the prefill arms.

    The student (in_proj + copies of the core blocks) learns to predict the frozen teacher's depth-R
    endpoint from the prelude output. When training ends, prints each prefill arm's continuation
    perplexity and generator-task exact match: teacher, distilled student, R = 1, R = 2 (Table 5).

    Args:
        teacher: The teacher checkpoint folder, or its run folder (its latest checkpoint is used).
        cfg: Student, optimisation and run settings.

    Runs on one process, or data parallel under `torchrun --nproc_per_node N` (--micro-batch is
    the global rows per step and must be divisible by N); rank 0 writes and reports.
    """
    from looplm.distill.evaluate import arms_after_distill
    from looplm.eval.prefill_arms import format_prefill_table
    from looplm.distill.trainer import DistillTrainer
    from looplm.eval.report import write_report
    from looplm.train import distributed as D

    trainer = DistillTrainer(teacher, cfg)
    try:
        summary = trainer.fit()
    finally:
        D.shutdown(trainer.env)  # the collectives end with fit; the arms report runs on rank 0 alone
    if not trainer.env.is_main:
        return
    first, last = summary["start_step"], summary["step"]
    steps = f"{last} steps" if first == 0 else f"steps {first + 1}..{last} ({last - first} this session)"
    print(
        f"\ndistilled {steps} in {summary['session_s']:.0f} s; held-out relative state error "
        f"{summary['val_rel_err']:.4f} (after one teacher recurrence {summary['val_rel_err_next']:.4f}), "
        f"KL {summary['val_kl']:.4f}"
    )
    report = {"distill": summary}
    if cfg.report_rows or cfg.report_examples:
        trainer.student.eval()
        report["prefill"] = arms_after_distill(
            trainer.teacher,
            trainer.tokenizer,
            trainer.data,
            trainer.val_data,
            trainer.student,
            cfg.depth,
            rows=cfg.report_rows,
            n_examples=cfg.report_examples,
            device=trainer.device,
        )
        print(
            f"\nprefill arms at R = {cfg.depth} (decoding at R with the terminal cache; blocks = block passes "
            f"per prompt token):\n{format_prefill_table(report['prefill'])}"
        )
    write_report(report, trainer.out_dir / "report.json")
    print(
        f"\nstudent:  {summary['checkpoint']}\nmetrics:  {trainer.out_dir / 'metrics.jsonl'}\n"
        f"report:   {trainer.out_dir / 'report.json'}"
    )


def analyze(
    checkpoint: Annotated[Path, tyro.conf.Positional],
    cfg: Annotated[AnalyzeConfig, tyro.conf.arg(name="")] = AnalyzeConfig(),
    data: str | None = None,
    device: str = "auto",
    threads: int = 1,
) -> None:
    """Fixed-point diagnostics (design §11): convergence depth, KV settling, carryover alignment,
    joint vs frozen-prefix solves and the sharing penalty against depth, on held-out data.

    Args:
        checkpoint: A checkpoint folder, or a run folder (its latest checkpoint is used).
        cfg: What to measure.
        data: Held-out data to analyze instead of the checkpoint's own: tasks, shakespeare, a text file or
            folder, a .jsonl, a `looplm tokenize` folder or hf:<name>[:<split>]. Default: the data the
            checkpoint records (a converted release: the built-in Shakespeare text, or its convert --data).
        device: Torch device: auto (CUDA when available), cpu, cuda, ...
        threads: Intra-op CPU threads (0: torch's default, one per core). One is fastest for small
            models and on a shared machine, where idle threads spin-wait.
    """
    import torch

    from looplm.analyze.report import analyze as run, format_summary, require_recurrence, write_outputs
    from looplm.checkpoint import load_model, refuse_file_out_dir, resolve

    start = time.time()
    cfg.validate()
    if threads < 0:
        raise UserError(f"threads must be >= 0, got {threads}")
    device = _device(device)
    path = resolve(checkpoint)
    require_recurrence(path)
    model, tokenizer, _ = load_model(path, device)
    cfg.validate(model.cfg.max_depth)
    record = _data_record(path, data, model.cfg.max_seq_len)
    other = _other_data(path, data, record)  # its own folder, as eval's report: the run's analysis stays
    out = cfg.output or _run_folder(path) / ("analyze" if other is None else f"analyze-{data_name(other)}")
    refuse_file_out_dir(out, "--output")  # refused now (a path under a file too), not after the work
    out.parent.mkdir(parents=True, exist_ok=True)
    data = record.validation(tokenizer)
    bar = _progress(cfg.work_units(len(data)), "analyze")
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads)
    try:
        analysis = run(
            model,
            tokenizer,
            data,
            cfg,
            device=device,
            progress=lambda desc, n: (bar.set_description(desc, refresh=False), bar.update(n)),
        )
    finally:
        torch.set_num_threads(default_threads)
        bar.close()
    analysis.report["data"] = record.source
    paths = write_outputs(analysis, out, plots=cfg.plots)
    print(format_summary(analysis.report))
    print(f"\nwrote {', '.join(p.name for p in paths)} to {out} in {time.time() - start:.0f} s")


def rl(
    checkpoint: Annotated[Path, tyro.conf.Positional],
    cfg: Annotated[RLConfig, tyro.conf.arg(name="")] = RLConfig(),
) -> None:
    """GRPO post-training on verifiable problems with terminal-KV rollouts and a choice of update
    estimator: bptt, recompute, or reuse of the endpoints saved during the rollout (design §10).

    Args:
        checkpoint: The starting checkpoint (a checkpoint folder or a run folder); it is only read.
        cfg: RL settings; output goes to --out-dir (metrics.jsonl, checkpoints).

    Runs on one process, or data parallel under `torchrun --nproc_per_node N` (--prompts-per-step
    is the global prompt count and must be divisible by N); rank 0 writes and prints.
    """
    from looplm.rl.trainer import RLTrainer
    from looplm.train import distributed as D

    trainer = RLTrainer(checkpoint, cfg)
    try:
        summary = trainer.fit()
    finally:
        D.shutdown(trainer.env)
    if not trainer.env.is_main:
        return
    for step, ev in sorted(summary["evals"].items()):
        if ev:
            print(f"step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in ev.items()))
    first, last = summary["start_step"], summary["step"]
    steps = (
        f"{last} RL steps ({cfg.estimator})"
        if first == 0
        else f"RL steps {first + 1}..{last} ({last - first} this session, {cfg.estimator})"
    )
    print(
        f"{steps} in {summary['session_s']:.0f} s\n"
        f"checkpoint: {summary['checkpoint']}\nmetrics:    {trainer.out_dir / 'metrics.jsonl'}"
    )


def tokenize(
    src: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="SRC")],
    out: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="OUT")],
    tokenizer: str = "byte",
    bpe_vocab_size: int = 4096,
    holdout: float = 0.05,
    text_field: str = "text",
    seed: int = 0,
    n_task_examples: int = DEFAULT_TASK_EXAMPLES,
    overwrite: bool = False,
) -> None:
    """Tokenize a corpus once into a folder that training reads directly (--data.source OUT),
    instead of tokenizing it at the start of every fresh run.

    OUT gets the train and validation token caches, the tokenizer and a pretokenized.json marker;
    it is written to a temporary sibling and renamed into place only when complete.

    Args:
        src: The corpus: a text file or folder (*.txt, *.md), a .jsonl file, hf:<name>[:<split>] or tasks.
        out: Folder to write: new, empty, or an earlier `looplm tokenize` output (kept if made from the
            same inputs; made from other ones, refused unless --overwrite).
        tokenizer: byte, bpe (trained on the corpus) or a path to a tokenizer.json or saved tokenizer folder.
        bpe_vocab_size: Vocabulary size when training a BPE tokenizer.
        holdout: Fraction of documents held out for validation.
        text_field: Field of each JSONL record (or HF dataset row) that holds the text.
        seed: Seed of the held-out draw (and of the generator for source tasks).
        n_task_examples: Training examples drawn from the task generator (source tasks).
        overwrite: Replace an earlier output made from other inputs (runs trained on it can no longer read it).
    """
    import shlex

    from looplm.data.pretokenized import pretokenized_info, tokenize_corpus

    start = time.time()
    try:  # to tell "kept as it was" from "written" below
        before = pretokenized_info(out)
    except UserError:  # not a `looplm tokenize` folder (yet)
        before = None
    path = tokenize_corpus(
        src,
        out,
        tokenizer=tokenizer,
        bpe_vocab_size=bpe_vocab_size,
        holdout=holdout,
        text_field=text_field,
        seed=seed,
        n_task_examples=n_task_examples,
        overwrite=overwrite,
    )
    info = pretokenized_info(path)
    if info == before:
        print(f"up to date (same source, tokenizer, holdout and seed): {path}")
    else:
        print(f"wrote {path} in {time.time() - start:.0f} s")
    print(f"tokenizer: {info['tokenizer']}, vocabulary {info['vocab_size']:,}, eos id {info['eos_id']}")
    for split, counts in info["splits"].items():
        print(f"{split + ':':6} {counts['tokens']:>14,} tokens  {counts['docs']:>11,} documents")
    print(
        f"\ntrain on it with (any preset; the folder's tokenizer is used):\n"
        f"  looplm train tiny --data.source {shlex.quote(str(path))}"
    )


def export(
    checkpoint: Annotated[Path, tyro.conf.Positional],
    out: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="OUT")],
    num_steps: int | None = None,
    prefill_steps: int | None = None,
    cache: CacheKind = "terminal",
) -> None:
    """Export a checkpoint as a Hugging Face Transformers model folder (needs the hf extra).

    OUT gets config.json, model.safetensors and the tokenizer; load it with
    `import looplm.hf` (which registers the model type), then `AutoModelForCausalLM.from_pretrained(OUT)` and
    `AutoTokenizer.from_pretrained(OUT)`.

    Args:
        checkpoint: A checkpoint folder, or a run folder (its latest checkpoint is used).
        out: New (or empty) folder to write the transformers model into, or an earlier export to replace.
        num_steps: Default recurrences per token (R_dec) of the exported model; default: 5, or the model's
            max_depth when that is smaller.
        prefill_steps: Default recurrences over the prompt in generate (R_pre); default: num_steps.
        cache: Default KV cache of generate: terminal (one bank per physical layer) or full.
    """
    try:
        from looplm.hf import export as run
    except ImportError as err:
        raise UserError(f"looplm export needs transformers ({err}): {install_hint('hf')}") from None
    path = run(checkpoint, out, num_steps=num_steps, prefill_steps=prefill_steps, cache_kind=cache)
    print(f"wrote {path}")


def consolidate(
    checkpoint: Annotated[Path, tyro.conf.Positional],
    out: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="OUT")],
    weights_only: bool = False,
) -> None:
    """Write a sharded checkpoint (FSDP2/HSDP training) in the single-file form.

    OUT becomes a run folder (OUT/checkpoints/step_N, with `latest`) holding model.safetensors and,
    unless --weights-only, optimizer.safetensors and the trainer state, so one process or DDP can
    resume it (--train.out-dir OUT --train.resume). eval, generate, analyze, export, distill, rl and
    serve read sharded checkpoints as they are; this writes the form other tools expect. The whole
    model (and optimizer state) passes through this process's memory.

    Args:
        checkpoint: A sharded checkpoint folder, or a run folder (its latest checkpoint is used).
        out: New (or empty) folder: the run folder to write.
        weights_only: Leave out the optimizer state (a third of the size; loads for inference, cannot resume).
    """
    from looplm.checkpoint import consolidate as run

    path = run(checkpoint, out, weights_only=weights_only)
    print(f"wrote {path}")


def convert(
    src: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="SRC")],
    out: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="OUT")],
    from_: Annotated[Literal["xllm-loop", "huginn", "ouro", "parcae"], tyro.conf.arg(name="from")],
    dtype: Literal["fp32", "bf16"] = "fp32",
    data: str | None = None,
    teacher: Path | None = None,
) -> None:
    """Convert another project's released checkpoint (a local folder; nothing is downloaded) into a
    looplm checkpoint that eval, generate, analyze and export read.

    Args:
        src: The release folder, e.g. an `hf download IFM/LoopedLM-P2-huginn-s-fixed-r5 --local-dir` copy.
        out: New (or empty) folder to write the looplm checkpoint into.
        from_: The source format: xllm-loop (the paper's reference release, Part II Huginn artifacts),
            huginn (Huginn-0125, seal-rg/recurrent-pretraining), ouro (Ouro-1.4B/2.6B) or parcae
            (sandyresearch/parcae, its state dict saved as safetensors).
        dtype: Weights dtype of the checkpoint: fp32 (exact) or bf16.
        data: Held-out text that `looplm eval` and `analyze` read for this checkpoint (a text file or
            folder, a .jsonl, or hf:<name>[:<split>]); default: the built-in Shakespeare text.
        teacher: For an xllm-loop distilled student (IFM/LoopedLM-P2-distilled-*): the looplm checkpoint
            converted from its teacher artifact; OUT is then a student for --prefill student --student OUT.
    """
    from looplm.convert import CONVERTERS

    if teacher is not None and from_ != "xllm-loop":
        raise UserError("--teacher applies to --from xllm-loop distilled students")
    kwargs = {"teacher": teacher} if teacher is not None else {}
    path = CONVERTERS[from_](src, out, dtype=dtype, data=data, **kwargs)
    if teacher is not None:
        print(f"wrote {path}\nuse it with: looplm generate {teacher} --prefill student --student {path}")
        return
    print(f"wrote {path}\nevaluate it with: looplm eval {path}")


def _listen(host: str, port: int):
    """A socket bound to host:port (port 0: one the system chooses), for uvicorn to serve on once it listens;
    a busy port or an unknown host is a UserError. Bound, not yet listening: until then a client's
    connection is refused (the model loads, the engine warms up), not queued unanswered."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: restarts at once
            listener.bind(address)
        except OSError:
            listener.close()
            raise
    except OSError as err:
        raise UserError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return listener


def serve(
    checkpoint: Annotated[Path, tyro.conf.Positional],
    engine: Annotated[EngineConfig, tyro.conf.arg(name="")] = EngineConfig(),
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    device: str = "auto",
    prefill: PrefillArm = "teacher",
    student: Path | None = None,
) -> None:
    """Serve a checkpoint over an OpenAI-compatible HTTP API with continuous batching (needs
    the serve extra, README's Install): /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

    Args:
        checkpoint: A checkpoint folder, or a run folder (its latest checkpoint is used).
        engine: The engine's capacity and defaults (--compile: its graphs are compiled before the server
            listens, tens of seconds each on a CPU the first time).
        host: Interface to bind (default: this machine only; 0.0.0.0 exposes it to the network).
        port: TCP port.
        api_key: Require `Authorization: Bearer KEY` on /v1/ endpoints.
        served_model_name: The model id clients pass; default: the run (or checkpoint) folder's name.
        device: Torch device: auto (CUDA when available), cpu, cuda, ...
        prefill: How prompts enter the cache: teacher, student (distilled prefill, needs --student), r1 or r2.
        student: Distilled student (`looplm distill` output) for --prefill student.
    """
    try:
        import uvicorn

        from looplm.serve.api import create_app
    except ImportError as err:
        raise UserError(f"looplm serve needs the serve extra ({err}): {install_hint('serve')}") from None
    from looplm.checkpoint import load_model
    from looplm.infer.prefill import check_arm_cache
    from looplm.serve import Engine

    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in 0..65535 (0: any free port), got {port}")
    engine.check(prefix="--")  # what needs no model, before it loads
    check_arm_cache(prefill, engine.cache, prefix="--")
    listener = _listen(host, port)  # bound before the model loads (a busy port fails at once), listening once ready
    try:
        model, tokenizer, _ = load_model(checkpoint, _device(device))
        engine.check(model.cfg.max_depth, model.cfg.max_seq_len, prefix="--")  # as Engine does, named as options
        (arm,) = _prefill_arms(model, (prefill,), student)
        running = Engine(model, tokenizer, engine, prefill=arm)
        if engine.compile:
            print(
                f"compiling the decode step for batch sizes {', '.join(map(str, running.buckets()))} and the "
                f"prefill for prompts of up to {', '.join(map(str, running.prefill_buckets()))} tokens",
                flush=True,
            )
            print(f"compiled in {running.warm_up():.0f} s", flush=True)
        name = served_model_name or _run_folder(checkpoint.resolve()).name
        shown = f"[{host}]" if ":" in host else host
        print(f"serving {name!r} on http://{shown}:{listener.getsockname()[1]}/v1 ({running.describe()})", flush=True)
        if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
            print(f"warning: {host} exposes the server beyond this machine and no --api-key is set", file=sys.stderr)
        app = create_app(running, name, api_key=api_key)
        listener.listen(2048)  # ready: connections are accepted from here on
        uvicorn.Server(uvicorn.Config(app, host=host, port=listener.getsockname()[1], log_level="info")).run(
            sockets=[listener]
        )
    finally:
        listener.close()


def _deferred(fn):
    """`fn` with the same signature and docs for tyro, but calling it only returns the call:
    main runs it after parsing, so that anything raised while parsing is about the command line."""
    import functools

    @functools.wraps(fn)
    def parsed(*args, **kwargs):
        return functools.partial(fn, *args, **kwargs)

    return parsed


def _internal_error(err: BaseException, debug: bool) -> int:
    """Anything that is not a user error: a bug in looplm or its environment. One line, or the
    traceback with --debug / LOOPLM_DEBUG=1."""
    import traceback

    if debug:
        traceback.print_exception(err)
    summary = (str(err).strip().splitlines() or [""])[0]
    summary = summary[:297] + "..." if len(summary) > 300 else summary
    print(
        f"internal error: {type(err).__name__}{': ' + summary if summary else ''}"
        + ("" if debug else f" (looplm --debug ... or {DEBUG_ENV}=1 shows the traceback)"),
        file=sys.stderr,
    )
    return 1


# -- the command line's errors: tyro's parse-error events, each said in one line ---------------------------
class CommandLineError(UserError):
    """A command line looplm cannot parse; the message is the whole `error: ...; see ... --help` line."""


def _command(args: list[str]) -> list[str]:
    """The words of the (sub)command `args` selects, as far as they name one: `looplm train tiny`."""
    words = ["looplm"]
    if args[:1] and args[0] in _SUBCOMMANDS:
        words.append(args[0])
        if args[0] == "train" and args[1:2] and args[1] in JOB_PRESETS:
            words.append(args[1])
    return words


def _children(words: list[str]) -> dict:
    """The subcommands of command `words`: what each parses (a command function, a preset's job)."""
    if words == ["looplm"]:
        return dict(_SUBCOMMANDS)
    return {name: make() for name, (_, make) in JOB_PRESETS.items()} if words == ["looplm", "train"] else {}


def _options(target, prefix: str = "") -> list[str]:
    """The --options tyro makes of `target` (a command function, or a config dataclass instance): each
    field by its dotted path with `-` for `_`; a field with `tyro.conf.arg(name=...)` is renamed by it
    (name "" lends its own fields its parent's prefix); positional arguments are not options."""
    import inspect
    import typing

    if dataclasses.is_dataclass(target):
        hints = typing.get_type_hints(type(target), include_extras=True)
        fields = [(f.name, getattr(target, f.name)) for f in dataclasses.fields(target)]
    else:
        hints = typing.get_type_hints(target, include_extras=True)
        fields = [(p.name, p.default) for p in inspect.signature(target).parameters.values()]
    names = []
    for name, default in fields:
        hint = hints.get(name)
        meta = typing.get_args(hint)[1:] if typing.get_origin(hint) is Annotated else ()
        if tyro.conf.Positional in meta:
            continue
        name = next((m.name for m in meta if isinstance(getattr(m, "name", None), str)), name)
        path = prefix + name
        if dataclasses.is_dataclass(default) and not isinstance(default, type):
            names += _options(default, path + "." if name else prefix)
        elif name:
            names.append("--" + path.replace("_", "-"))
    return names


def _suggestion(option: str, words: list[str]) -> str:
    """What to say after the unknown `option` of command `words`: the subcommands it is an option of (given
    before their name), else the command's options of its leaf name (`steps`: --train.steps) or spelt alike."""
    import difflib

    owners = sorted(name for name, target in _children(words).items() if option in _options(target))
    if owners:
        return f" (an option of {' '.join(words)} {'|'.join(owners)}: give it after the subcommand's name)"
    if words[1:] == ["train"] or len(words) == 1:
        return ""
    own = _options(_SUBCOMMANDS[words[1]] if len(words) == 2 else _children(words[:2])[words[2]])
    leaf = option.lstrip("-").rsplit(".", 1)[-1]
    same = [name for name in own if name.lstrip("-").rsplit(".", 1)[-1] == leaf]
    similar = list(dict.fromkeys(same + difflib.get_close_matches(option, own, n=3, cutoff=0.8)))[:3]
    return f" (did you mean {' or '.join(similar)}?)" if similar else ""


def _unrecognized(tokens: list[str], args: list[str], words: list[str]) -> str:
    """tyro's unrecognized tokens, less the values that followed an unknown option (`--train.stpes 3`)."""
    pairs = set(zip(args, args[1:]))
    unknown: list[str] = []
    for token in tokens:
        if token.startswith("-") or not unknown or (unknown[-1], token) not in pairs:
            unknown.append(token)
    named = ", ".join(token + (_suggestion(token, words) if token.startswith("-") else "") for token in unknown)
    line = f"unrecognized option{'s' if len(unknown) > 1 else ''} {named}"
    if _children(words) and not all(token.startswith("-") for token in unknown):
        line += f"; available subcommands: {', '.join(_children(words))}"
    return line


def _missing(names: list[str], args: list[str], words: list[str], parsed: dict) -> str:
    """Missing required input; when an option of several values (--prompt A B) read on into what looks like
    a path, the positional the user meant (tyro takes every value up to the next option), where it goes.
    `parsed`: tyro's raw parse state (destination -> the words it read), which says whether the option
    took the path (a one-value option takes one word, and a last path may go to its positional)."""
    line = f"missing required input for {' '.join(words)}: {', '.join(names)}"

    def took(option: str, arg: str) -> bool:
        name = "." + option[2:]
        return any(k.endswith(name) and isinstance(v, list) and arg in v for k, v in parsed.items())

    option, first = None, 0  # the option being read and where its first value is (`--opt=A` holds it)
    for i, arg in enumerate(args):
        if arg.startswith("-"):
            option = arg.split("=", 1)[0] if arg.startswith("--") else None
            first = i if "=" in arg else i + 1
        elif (
            option is not None
            and i != first
            and ("/" in arg or os.sep in arg or Path(arg).exists())
            and took(option, arg)
        ):
            return (
                f"{line}; {option} took {arg!r} as one of its values: put {names[0]} first "
                f"({' '.join(words)} {names[0]} {option} ...)"
            )
    return line


def _rejected(event, args: list[str]) -> None:
    """tyro's parse-error hook: raise the event as one CommandLineError line (an event of a kind not
    handled here returns, and tyro reports it itself)."""
    from tyro import _errors as e  # tyro's parse-error events (tyro >= 1.0)

    def name(arg) -> str:
        return arg.lowered.metavar if arg.is_positional() else arg.display_name()

    words = _command(args)
    if isinstance(event, e.UnrecognizedArgs):
        what = _unrecognized(event.tokens, args, words)
    elif isinstance(event, e.MissingArgs):
        what = _missing([name(a.arg) for a in event.missing_arguments], args, words, event.partial_output)
    elif isinstance(event, e.MissingSubcommand):
        what = f"missing subcommand: expected one of {{{', '.join(event.subcommand_spec.parser_from_name)}}}"
    elif isinstance(event, e.InstantiationFailure):
        arg = event.argument
        what = (
            event.message
            if arg is None
            else f"invalid value for {name(arg)} (expects {arg.lowered.metavar}): {event.message}"
        )
    elif isinstance(event, e.InvalidChoice):
        what = (
            f"invalid choice {event.value!r} for argument '{name(event.argument)}': expected one of "
            f"{', '.join(event.choices)}"
        )
    elif isinstance(event, e.BadValue) and event.reason == "too_few_values":
        what = f"missing value for argument '{name(event.argument)}'"
    else:
        return
    raise CommandLineError(f"error: {what}; see {' '.join(words)} --help")


def _parse(args: list[str]):
    """The command line parsed by tyro: the deferred call of the subcommand. A command line that cannot be
    parsed raises CommandLineError (SystemExit for --help)."""
    import contextlib

    try:
        from tyro._errors import on_parse_error
    except ImportError:  # an older tyro: it reports parse errors itself (its box, exit status 2)
        hook = contextlib.nullcontext()
    else:
        hook = on_parse_error(lambda event: _rejected(event, args))
    try:
        with hook:
            return tyro.extras.subcommand_cli_from_dict(
                {name: _deferred(fn) for name, fn in _SUBCOMMANDS.items()},
                prog="looplm",
                args=args,
                description="looplm: looped language models shaped around fixed points. "
                "looplm --version prints the version; looplm --debug SUBCOMMAND ... (or "
                f"{DEBUG_ENV}=1) shows the traceback of an internal error.",
            )
    except CommandLineError:
        raise
    except UserError as err:  # an options object refused its values as tyro built it (DepthRule, GenerateSampling)
        raise CommandLineError(f"error: {err}; see {' '.join(_command(args))} --help") from None


def main(argv: list[str] | None = None) -> int:
    global _ARGS

    args = sys.argv[1:] if argv is None else [str(a) for a in argv]
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    if args[:1] == ["--debug"]:  # global switches come before the subcommand
        debug, args = True, args[1:]
    if args[:1] == ["--version"]:
        from looplm import __version__

        print(f"looplm {__version__}")
        return 0
    try:
        run = _parse(args)
        _ARGS = args
        run()
    except CommandLineError as err:
        print(err, file=sys.stderr)
        return 2
    except USER_ERRORS as err:
        if debug:
            import traceback

            traceback.print_exception(err)
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # train says where the run stopped and how to resume it
        print(str(err) or "interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`looplm ... | head`): stop quietly, as a shell tool does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush of stdout cannot fail again
        return 141  # 128 + SIGPIPE
    except Exception as err:  # noqa: BLE001 - everything else is a bug, reported in one line
        return _internal_error(err, debug)
    return 0


_SUBCOMMANDS = {
    "train": train,
    "eval": evaluate,
    "generate": generate,
    "distill": distill,
    "analyze": analyze,
    "rl": rl,
    "tokenize": tokenize,
    "export": export,
    "convert": convert,
    "serve": serve,
    "consolidate": consolidate,
}


if __name__ == "__main__":
    sys.exit(main())
