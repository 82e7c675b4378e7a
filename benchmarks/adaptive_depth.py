"""Adaptive per-token decode depth vs fixed depth: quality against mean depth (design §13).

    python benchmarks/adaptive_depth.py runs/tiny [--rows 64] [--out benchmarks/results/adaptive_depth.json]

On held-out rows of the checkpoint's own data, every supervised target in the second half of each
row is scored: each document is read from its own start, its part before the midpoint prefilled at
R = 5 with the terminal cache, and its second-half tokens decoded one at a time (teacher forced,
CacheEval style), either at a fixed depth R or with adaptive exit (stop once the relative state
change falls below tau, between min and max depth). Reports perplexity and the mean depth used.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _command import command_line  # benchmarks/ is on sys.path when a script there runs

from looplm.checkpoint import load_data, load_model
from looplm.eval.cached import cached_perplexity


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-depth", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/adaptive_depth.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok, _ = load_model(args.checkpoint)
    val = load_data(args.checkpoint).validation(tok)
    rows = []

    def measure(label, depth, tau=None, min_depth=1):
        r = cached_perplexity(
            model, val, depth, "terminal", max_sequences=args.rows, stepwise=True, exit_tau=tau, min_depth=min_depth
        )
        rows.append(
            {
                "arm": label,
                "max_depth": depth,
                "tau": tau,
                "ppl": r["ppl"],
                "mean_decode_depth": r["mean_decode_depth"],
                "tokens": r["tokens"],
            }
        )
        print(f"{label:>22}  ppl {r['ppl']:.4f}  mean depth {r['mean_decode_depth']:.2f}", flush=True)

    for R in (1, 2, 3, 5, 8, args.max_depth):
        measure(f"fixed R={R}", R)
    for tau in (0.3, 0.1, 0.05, 0.02, 0.01, 0.005):
        measure(f"adaptive tau={tau}", args.max_depth, tau)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"command": command_line(), "checkpoint": str(args.checkpoint), "rows": args.rows, "results": rows},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
