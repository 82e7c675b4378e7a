"""`looplm` command line, generated from the typed configs by tyro.

  looplm train tiny [--train.steps N ...]     train a preset (override any field), then report
  looplm eval CHECKPOINT [--depths 1 2 5 ...]  perplexity and task accuracy against depth
  looplm generate CHECKPOINT --prompt TEXT    continue prompts with a terminal (or full) KV cache

Errors in user input end with a one-line `error: ...` on stderr and exit status 2.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Literal

import tyro

from looplm.checkpoint import CheckpointError
from looplm.data import DataError
from looplm.eval.report import EvalConfig
from looplm.infer.generate import SamplingConfig
from looplm.train.config import JOB_PRESETS, TrainJob

USER_ERRORS = (ValueError, CheckpointError, DataError, FileNotFoundError, FloatingPointError)

PresetJob = tyro.extras.subcommand_type_from_defaults(
    {name: make() for name, (_, make) in JOB_PRESETS.items()},
    {name: desc for name, (desc, _) in JOB_PRESETS.items()},
    prefix_names=False,
)


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="batch", dynamic_ncols=True, leave=False)


def _report(model, tokenizer, job: dict, cfg: EvalConfig, device, out_json: Path) -> dict:
    from looplm.eval.report import depth_report, format_report, write_report

    n_batches = len(cfg.depths) * (-(-cfg.max_sequences // cfg.batch_size) + -(-cfg.task_examples // cfg.batch_size)
                                   + (cfg.sharing_sequences > 0))
    bar = _progress(n_batches, "eval")
    try:
        report = depth_report(model, tokenizer, job, cfg, device=device, progress=lambda: bar.update(1))
    finally:
        bar.close()
    print(format_report(report))
    write_report(report, out_json)
    return report


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
    from looplm.train.trainer import Trainer

    job: TrainJob
    start = time.time()
    trainer = Trainer(job)
    summary = trainer.fit()
    env = trainer.env
    D.shutdown(env)
    if not env.is_main:
        return
    ckpt_path = Path(summary["checkpoint"])
    print(f"\ntrained {summary['step']} steps, {summary['tokens']:,} tokens in {time.time() - start:.0f} s")
    if job.eval.depths:
        model, tokenizer, config = load_model(ckpt_path, env.device)
        print(f"\nheld-out perplexity and exact-match task accuracy vs test-time depth R (trained with "
              f"{job.depth.sampler} depth {job.depth.depth:g}):")
        _report(model, tokenizer, config, job.eval, env.device, job.eval.output or trainer.out_dir / "eval.json")
    out = trainer.out_dir
    print(f"\ncheckpoint: {ckpt_path}\nmetrics:    {out / 'metrics.jsonl'}\nreport:     "
          f"{job.eval.output or out / 'eval.json'}\ntensorboard: {out / 'tensorboard'} (if tensorboard is installed)")


def evaluate(
    checkpoint: Annotated[Path, tyro.conf.Positional],
    cfg: Annotated[EvalConfig, tyro.conf.arg(name="")] = EvalConfig(),
    device: str = "cpu",
) -> None:
    """Native perplexity over a list of depths and exact-match accuracy on the generator's tasks.

    Args:
        checkpoint: A checkpoint folder, or a run folder (its latest checkpoint is used).
        cfg: What to measure.
        device: Torch device to evaluate on (cpu, cuda, cuda:1, ...).
    """
    import torch

    from looplm.checkpoint import load_model, resolve

    with torch.no_grad():  # not set_grad_enabled(False): main() may be called in-process
        path = resolve(checkpoint)
        model, tokenizer, job = load_model(path, device)
        for r in cfg.depths:
            if not 1 <= r <= model.cfg.max_depth:
                raise ValueError(f"depth must be in 1..{model.cfg.max_depth}, got {r}")
        out = cfg.output or path.parent.parent / "eval.json"
        _report(model, tokenizer, job, cfg, device, out)
    print(f"\nreport: {out}")


def generate(
    checkpoint: Annotated[Path, tyro.conf.Positional],
    prompt: tuple[str, ...] = ("+12,34=",),
    depth: int = 5,
    prefill_depth: int | None = None,
    cache: Literal["terminal", "full"] = "terminal",
    sampling: Annotated[SamplingConfig, tyro.conf.arg(name="")] = SamplingConfig(max_new_tokens=16, stop=("\n",)),
    device: str = "cpu",
) -> None:
    """Continue prompts with a KV cache; a single prompt is streamed as it is generated.

    Args:
        checkpoint: A checkpoint folder, or a run folder (its latest checkpoint is used).
        prompt: One or more prompts (repeat the text after --prompt).
        depth: Recurrences per decoded token (R_dec).
        prefill_depth: Recurrences for the prompt (R_pre); default: depth.
        cache: terminal (one KV bank per physical layer) or full (one bank per layer visit).
        sampling: Token choice and stopping.
        device: Torch device (cpu, cuda, ...).
    """
    from looplm.checkpoint import load_model
    from looplm.infer.generate import generate as run

    model, tokenizer, _ = load_model(checkpoint, device)
    for r in (depth, prefill_depth or depth):
        if not 1 <= r <= model.cfg.max_depth:
            raise ValueError(f"depth must be in 1..{model.cfg.max_depth}, got {r}")
    if sampling.exit_tau is not None and cache != "terminal":
        raise ValueError("adaptive depth (--exit-tau) needs --cache terminal")
    stream = None
    if len(prompt) == 1:
        print(prompt[0], end="", flush=True)
        stream = lambda _row, piece: print(piece, end="", flush=True)  # noqa: E731
    stats: dict = {}
    texts = run(model, tokenizer, list(prompt), depth=depth, prefill_depth=prefill_depth, cache_mode=cache,
                sampling=sampling, on_token=stream, stats=stats)
    if stream is not None:
        print()
    else:
        for p, t in zip(prompt, texts):
            print(f"{p}{t}")
    if sampling.exit_tau is not None:
        print(f"mean decode depth: {stats['mean_decode_depth']:.2f} (max {depth})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    try:
        tyro.extras.subcommand_cli_from_dict(
            {"train": train, "eval": evaluate, "generate": generate}, prog="looplm", args=argv,
            description="looplm: looped language models shaped around fixed points",
        )
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
