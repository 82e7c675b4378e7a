"""What the compiled decode step pays for attending over its whole preallocated cache: the same
`DecodeStep(compile=True)` on caches of several lengths, each holding the same prompt, side by side
in one process.

    python benchmarks/decode_key_length.py [--batch 12] [--depth 5] [--prompt 40] [--lengths 256 96]
        [--rounds 7] [--out benchmarks/results/decode_key_length.json]

The step's shapes are static (design §16): attention reads keys [0, max_len) under a mask, so a
server whose context is 256 tokens attends over 256 keys per row and layer visit even while its rows
hold 72. The eager engine cuts its view at the longest row. This measures the price of that choice
at the serving load test's shape (the tiny preset's d 128, random weights, terminal cache; batch 12
= the load test's slots, depth 5): a cache of the model's context against one just long enough for
the rows, and the step on the context-long cache attending over the first n keys only
(`DecodeStep(...)(rows, depth, keys=n)`: one graph with a dynamic key length, what the compiled
serving engine runs). Each figure is the median over `--rounds` rounds of 10 steps, the arms
alternating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from _command import command_line, machine_line  # benchmarks/ is on sys.path when a script runs

from looplm.config import model_preset
from looplm.infer import extend, make_cache
from looplm.infer.step import DecodeStep, StepRows
from looplm.model import LoopedLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=40, help="tokens already in every row")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 96], help="cache lengths (keys attended)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_key_length.json"))
    args = ap.parse_args()
    cfg = model_preset("tiny")
    if any(n <= args.prompt or n > cfg.max_seq_len for n in args.lengths):
        ap.error(f"every length must exceed --prompt {args.prompt} and be at most the context {cfg.max_seq_len}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = LoopedLM(cfg).eval()
    B, R, P = args.batch, args.depth, args.prompt
    prompt = torch.randint(0, cfg.vocab_size, (B, P))
    rows = StepRows(
        torch.zeros(B, dtype=torch.long), torch.full((B,), P), torch.zeros(B, dtype=torch.long), torch.arange(B)
    )
    longest = max(args.lengths)
    arms, compile_s = {}, {}  # (cache length, keys attended) -> a step call
    for n in args.lengths:
        cache = make_cache("terminal", cfg, B, n, R)
        with torch.no_grad():
            extend(model, prompt, cache, R)
        step = DecodeStep(model, cache, compile=True)
        arms[(n, n)] = lambda step=step: step(rows, R)
        if n < longest:  # the same keys read from a context-long cache through keys=n
            big = make_cache("terminal", cfg, B, longest, R)
            with torch.no_grad():
                extend(model, prompt, big, R)
            wide = DecodeStep(model, big, compile=True)
            arms[(longest, n)] = lambda wide=wide, n=n: wide(rows, R, keys=n)
    for arm, run in arms.items():
        t = time.perf_counter()
        run()  # compiles; every later step rewrites the same position, so the rows stay at P
        compile_s[arm] = time.perf_counter() - t
        print(f"cache {arm[0]}, keys {arm[1]}: compile + first step {compile_s[arm]:.1f} s", flush=True)
    names = list(arms)
    seconds = {arm: [] for arm in names}
    for r in range(args.rounds):
        for arm in names[r % len(names) :] + names[: r % len(names)]:
            t = time.perf_counter()
            for _ in range(10):
                arms[arm]()
            seconds[arm].append((time.perf_counter() - t) / 10)
    full = statistics.median(seconds[(longest, longest)])
    table = []
    for cache_len, n in names:
        s = statistics.median(seconds[(cache_len, n)])
        table.append(
            {
                "cache": cache_len,
                "keys": n,
                "dynamic": cache_len != n,
                "step_ms": 1000 * s,
                "tokens_per_s": B / s,
                "speedup_over_whole_cache": full / s,
                "compile_s": compile_s[(cache_len, n)],
            }
        )
        print(f"cache {cache_len:4d}, keys {n:4d}: {1000 * s:7.2f} ms a step, {B / s:8.1f} tokens/s, {full / s:.2f}x")
    result = {
        "command": command_line(),
        "machine": machine_line(args.threads),
        "batch": B,
        "depth": R,
        "prompt": P,
        "rows": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
