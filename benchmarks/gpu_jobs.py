"""The one-rank process-group jobs of `benchmarks/gpu_train.py`: looplm's train, distill and RL runs
on a real process group (nccl on CUDA, gloo on a CPU), launched by torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/gpu_jobs.py train --root DIR [--tiny]

Each job builds its typed config directly and runs what `looplm train tiny`, `looplm distill` and
`looplm rl` run after parsing their flags (the trainer, its report, the prefill-arms table), so
nothing but torch and looplm's own requirements is needed: the GPU machine has no tyro, which the
CLI parses with, and no package registry. `train` writes the teacher that `distill` and `rl` read.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from looplm.distill.config import DistillConfig
from looplm.rl.config import RLConfig
from looplm.train import distributed as D
from looplm.train.config import TrainJob, job_preset


def train_job(root: Path, device: str, tiny: bool) -> TrainJob:
    """`looplm train tiny` for 12 steps with evaluation and the depth report (samples included); on a GPU
    compiled with FlexAttention masks, in the dry run shrunk to a 32-wide model with a 64-token context."""
    job = job_preset("tiny")
    t = job.train
    t.steps, t.log_every, t.eval_every, t.progress, t.tensorboard = 12, 4, 6, False, False
    t.device, t.out_dir = device, root / "train"
    job.data.n_task_examples, job.data.cache_dir = 4000, root / "cache"
    job.eval.depths, job.eval.task_examples, job.eval.max_sequences = (1, 5), 16, 8
    if tiny:
        m = job.model
        m.d_model, m.n_heads, m.n_kv_heads, m.ffn_dim, m.max_seq_len = 32, 2, 1, 64, 64
        job.data.seq_len, t.micro_batch = 64, 4
    else:
        t.compile, t.attention = "on", "flex"
    return job


def fit(trainer) -> dict | None:
    """Train, end the process group (reports run on rank 0 alone), and return the summary on rank 0."""
    try:
        summary = trainer.fit()
    finally:
        D.shutdown(trainer.env)
    return summary if trainer.env.is_main else None


def run_train(root: Path, device: str, tiny: bool) -> None:
    from looplm.checkpoint import load_data, load_model
    from looplm.eval.report import depth_report, format_report, write_report
    from looplm.train.trainer import Trainer

    job = train_job(root, device, tiny)
    start = time.time()
    trainer = Trainer(job)
    summary = fit(trainer)
    if summary is None:
        return
    print(f"trained {summary['step']} steps, {summary['tokens']:,} tokens in {time.time() - start:.0f} s", flush=True)
    checkpoint = Path(summary["checkpoint"])
    model, tokenizer, _ = load_model(checkpoint, trainer.env.device)
    report = depth_report(model, tokenizer, load_data(checkpoint), job.eval, device=trainer.env.device)
    print(format_report(report), flush=True)
    write_report(report, trainer.out_dir / "eval.json")


def run_distill(root: Path, device: str, tiny: bool) -> None:
    from looplm.distill.evaluate import arms_after_distill
    from looplm.distill.trainer import DistillTrainer
    from looplm.eval.prefill_arms import format_prefill_table
    from looplm.eval.report import write_report

    cfg = DistillConfig(
        steps=4,
        micro_batch=4,
        calibration_rows=8,
        val_rows=8,
        val_every=2,
        report_rows=8,
        report_examples=8,
        out_dir=root / "distill",
        device=device,
        progress=False,
    )
    trainer = DistillTrainer(root / "train", cfg)
    summary = fit(trainer)
    if summary is None:
        return
    trainer.student.eval()
    arms = arms_after_distill(
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
    print(format_prefill_table(arms), flush=True)
    write_report({"distill": summary, "prefill": arms}, trainer.out_dir / "report.json")


def run_rl(root: Path, device: str, tiny: bool) -> None:
    from looplm.rl.trainer import RLTrainer

    cfg = RLConfig(
        steps=2,
        prompts_per_step=4,
        group_size=2,
        eval_every=2,
        eval_examples=8,
        eval_samples=1,
        out_dir=root / "rl",
        device=device,
        progress=False,
    )
    summary = fit(RLTrainer(root / "train", cfg))
    if summary is not None:
        print(f"{summary['step']} RL steps in {summary['elapsed_s']:.0f} s", flush=True)


JOBS = {"train": run_train, "distill": run_distill, "rl": run_rl}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job", choices=list(JOBS))
    ap.add_argument(
        "--root", type=Path, required=True, help="folder of the jobs' runs (train writes, distill and rl read)"
    )
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--tiny", action="store_true", help="the CPU dry run's 32-wide model")
    args = ap.parse_args()
    JOBS[args.job](args.root, args.device, args.tiny)


if __name__ == "__main__":
    main()
