"""What running a shallow decode step as one graph saves: the same `DecodeStep(compile=True)` with
`whole=8` (the default: a step of at most 8 recurrences is one graph of prelude, recurrences and
coda) and with `whole=0` (the pieces: prelude, windows of `unroll` recurrences, the rest, coda),
side by side in one process.

    python benchmarks/decode_whole.py [--depths 3 5] [--batches 1 4 12] [--cache terminal]
        [--rounds 11] [--out benchmarks/results/decode_whole.json]

The tiny preset's shape (d 128, 1/2/1 blocks) with random weights, one token per row after a prompt of
64 tokens, at the same position every step. A depth of 3 is a self-speculation draft's (measured at
batch 1 with the full cache it is 0.19 of an R = 32 step in pieces); 5 is the serving load test's.
The two steps share the model and hold twin caches; each figure is the median over `--rounds` rounds
(the arms alternating, each round the median of 15 steps). Both steps' logits are checked equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from _command import command_line, machine_line  # benchmarks/ is on sys.path when a script runs

from looplm.config import ModelConfig
from looplm.infer import extend, make_cache
from looplm.infer.step import DecodeStep, StepRows
from looplm.model import LoopedLM

PROMPT = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 12])
    ap.add_argument("--cache", choices=["terminal", "full"], default="terminal")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_whole.json"))
    args = ap.parse_args()
    if any(not 1 <= R <= 8 for R in args.depths):
        ap.error("every depth must be in 1..8 (deeper steps run in pieces either way)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=258, max_seq_len=256, d_model=128, n_heads=4, n_kv_heads=2, ffn_dim=384)
    model = LoopedLM(cfg).eval()
    table = []
    for B in args.batches:
        prompt = torch.randint(0, cfg.vocab_size, (B, PROMPT))
        rows = StepRows(
            torch.zeros(B, dtype=torch.long),
            torch.full((B,), PROMPT),
            torch.zeros(B, dtype=torch.long),
            torch.arange(B),
        )
        for R in args.depths:
            steps = {}
            for name, whole in (("one graph", 8), ("pieces", 0)):
                cache = make_cache(args.cache, cfg, B, cfg.max_seq_len, R)
                with torch.no_grad():
                    extend(model, prompt, cache, R)
                steps[name] = DecodeStep(model, cache, compile=True, whole=whole)
            first = {}
            for name, step in steps.items():
                t = time.perf_counter()
                logits, _ = step(rows, R)  # compiles (or reads torch's compile cache)
                first[name] = (time.perf_counter() - t, logits)
            if not torch.allclose(first["one graph"][1], first["pieces"][1], atol=1e-4):
                raise SystemExit(f"batch {B}, depth {R}: the two steps' logits differ")
            seconds = {name: [] for name in steps}
            names = list(steps)
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    times = []
                    for _ in range(15):
                        t = time.perf_counter()
                        steps[name](rows, R)
                        times.append(time.perf_counter() - t)
                    seconds[name].append(statistics.median(times))
            one, pieces = (statistics.median(seconds[n]) for n in names)
            row = {
                "batch": B,
                "depth": R,
                "cache": args.cache,
                "one_graph_ms": 1000 * one,
                "pieces_ms": 1000 * pieces,
                "pieces_over_one_graph": pieces / one,
                "first_call_s": {name: first[name][0] for name in names},
            }
            table.append(row)
            print(
                f"batch {B:3d}, depth {R}: one graph {1000 * one:7.3f} ms, pieces {1000 * pieces:7.3f} ms "
                f"({pieces / one:.2f}x); first calls {first['one graph'][0]:.1f} / {first['pieces'][0]:.1f} s",
                flush=True,
            )
    result = {"command": command_line(), "machine": machine_line(args.threads), "rows": table}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
