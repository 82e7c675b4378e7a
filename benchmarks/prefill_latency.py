"""Distilled prefill latency and quality: teacher prefill at R vs distilled prefill vs R = 1 and R = 2.

    python benchmarks/prefill_latency.py --teacher runs/tiny2k --student runs/distill2k \\
        [--depth 5] [--lengths 512 1024 2048] [--rounds 8] [--threads 2] [--device cpu] \\
        [--rows 64] [--examples 400] [--out benchmarks/results/prefill_latency.json]

Speed: each arm prefills one random prompt of L tokens into a fresh terminal cache (`looplm.infer.
prefill`; speed does not depend on the tokens). One warm-up round, then `--rounds` rounds that
rotate the arm order, so load from other processes falls on every arm alike; per arm mean, std and
median of the seconds, and of the per-round ratio teacher time / arm time. The load average
is recorded every round.
Quality (same arms, decoding at R with the terminal cache; `looplm.eval.prefill_arms`): continuation
perplexity of held-out rows of the teacher's data (each document read from its own start, its part
before the row's midpoint prefilled with the arm, its second-half targets scored at R) and generator-task exact match (prefill the prompt, greedy decoding).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from _command import relative  # benchmarks/ is on sys.path when a script there runs

from looplm.checkpoint import load_data, load_model, resolve
from looplm.distill import load_student
from looplm.distill.evaluate import arms_after_distill
from looplm.eval.prefill_arms import format_prefill_table
from looplm.infer import TerminalCache
from looplm.infer.prefill import Prefill

ARMS = ("teacher", "student", "r1", "r2")


def mean_std(v: list[float]) -> dict:
    return {
        "mean": statistics.mean(v),
        "std": statistics.stdev(v) if len(v) > 1 else 0.0,
        "median": statistics.median(v),
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def time_prefill(arm: Prefill, model, x: torch.Tensor, depth: int, device) -> float:
    cache = TerminalCache(model.cfg, 1, x.shape[1], device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    arm(model, x, cache, depth)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", type=Path, required=True)
    ap.add_argument("--student", type=Path, required=True)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=64, help="held-out rows for continuation perplexity (0 skips)")
    ap.add_argument("--examples", type=int, default=400, help="generator-task examples for exact match (0 skips)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/prefill_latency.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.set_grad_enabled(False)
    model, tokenizer, _ = load_model(args.teacher, device)
    data = load_data(args.teacher)
    student, meta = load_student(args.student, model)
    arms = {a: Prefill(a, student if a == "student" else None) for a in ARMS}
    if max(args.lengths) > model.cfg.max_seq_len:
        raise SystemExit(
            f"the teacher's context is {model.cfg.max_seq_len} tokens; train one with "
            f"--model.max-seq-len {max(args.lengths)}"
        )
    result: dict = {
        "command": "python benchmarks/prefill_latency.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(relative, v)) if isinstance(v, list) else relative(v)}"
            for k, v in vars(args).items()
        ),
        "machine": {
            "cpu": cpu_name(),
            "cpus": os.cpu_count(),
            "threads": args.threads,
            "device": str(device),
            "torch": torch.__version__,
        },
        "teacher": str(resolve(args.teacher)),
        "student": str(resolve(args.student)),
        "student_meta": {k: meta[k] for k in ("depth", "init", "teacher_sha256")},
        "depth": args.depth,
        "model": model.cfg.to_dict(),
        "block_passes": {a: arm.block_passes(model.cfg, args.depth) for a, arm in arms.items()},
        "speed": {},
    }
    gen = torch.Generator().manual_seed(0)
    for L in args.lengths:
        x = torch.randint(0, model.cfg.vocab_size, (1, L), generator=gen).to(device)
        times: dict[str, list[float]] = {a: [] for a in ARMS}
        loads = []
        for rnd in range(args.rounds + 1):  # round 0 is the warm-up
            order = list(ARMS[rnd % len(ARMS) :] + ARMS[: rnd % len(ARMS)])
            for a in order:
                dt = time_prefill(arms[a], model, x, args.depth, device)
                if rnd:
                    times[a].append(dt)
            if rnd:
                loads.append(os.getloadavg()[0])
        row = {
            "seconds": {a: mean_std(v) for a, v in times.items()},
            "tokens_per_s": {a: mean_std([L / t for t in v]) for a, v in times.items()},
            "speedup_vs_teacher": {a: mean_std([t / s for t, s in zip(times["teacher"], v)]) for a, v in times.items()},
            "load_avg_1min": mean_std(loads),
            "raw_seconds": times,
        }
        result["speed"][L] = row
        print(
            f"L={L}: "
            + ", ".join(
                f"{a} {row['seconds'][a]['mean'] * 1e3:.1f}±{row['seconds'][a]['std'] * 1e3:.1f} ms "
                f"({row['speedup_vs_teacher'][a]['mean']:.2f}x)"
                for a in ARMS
            )
            + f"; load {row['load_avg_1min']['mean']:.1f}",
            flush=True,
        )
    if args.rows or args.examples:
        torch.set_num_threads(1)  # quality does not depend on it; small decode steps run faster on one thread
        val = data.validation(tokenizer)
        table = arms_after_distill(
            model, tokenizer, data, val, student, args.depth, rows=args.rows, n_examples=args.examples, device=device
        )
        result["quality"] = table
        print(format_prefill_table(table), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
