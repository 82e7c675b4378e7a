"""What a speculating serving engine costs when its requests differ in kind (design §16): 8 requests
that speculate (the engine's k and draft depth) alone, or beside one request that turns speculation
off, through `looplm.serve.Engine` alone (no HTTP), eager, one thread.

    python benchmarks/serve_mixed.py [--checkpoint runs/tiny] [--depth 16] [--speculate 4]
        [--draft-depth 3] [--max-tokens 48] [--rounds 3] [--baseline-src /tmp/looplm-prev/src]
        [--out benchmarks/results/serve_mixed.json]

All requests are submitted at once (greedy, full cache, `--max-tokens` each, Shakespeare speaker
lines as prompts) and the engine is stepped until every one finished. Per arm: completion tokens /
wall time of the whole run (the last request's finish), the speculating requests' mean latency and
the plain request's. Each (source, arm, round) runs in its own process, the arms and sources
interleaved round by round; `--baseline-src` adds another checkout's `src` (for example the engine
before each row's kind of step became its own, where one plain request made every step plain).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _command import command_line  # benchmarks/ is on sys.path when a script there runs

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["ROMEO.", "JULIET.", "KING HENRY.", "First Citizen:", "MENENIUS.", "Second Servant:", "HAMLET.", "LEAR."]


def one_run(args) -> dict:
    """One arm in this process: tokens/s, the speculating requests' mean latency, the plain one's."""
    import torch

    torch.set_num_threads(1)
    from looplm.checkpoint import load_model
    from looplm.infer.decode import SamplingConfig
    from looplm.serve import Engine, EngineConfig, Request

    model, tok, _ = load_model(args.checkpoint)
    config = EngineConfig(
        max_batch=len(PROMPTS) + 1,
        depth=args.depth,
        cache="full",
        speculate=args.speculate,
        draft_depth=args.draft_depth,
    )
    engine = Engine(model, tok, config)
    reqs = [Request(tok.encode(p), SamplingConfig(args.max_tokens)) for p in PROMPTS]
    if args.arm == "mixed":
        reqs.append(Request(tok.encode("OTHELLO."), SamplingConfig(args.max_tokens), speculate=0))
    engine.generate(reqs)  # untimed: one-time costs (first calls, allocations) stay out of the timed run
    start = time.perf_counter()
    handles = [engine.submit(r) for r in reqs]
    done: dict[int, float] = {}
    while len(done) < len(handles):
        engine.step()
        for i, h in enumerate(handles):
            if h.finish is not None and i not in done:
                done[i] = time.perf_counter() - start
    return {
        "tokens_per_s": sum(h.finish.completion_tokens for h in handles) / max(done.values()),
        "speculating_latency_s": statistics.mean(done[i] for i in range(len(PROMPTS))),
        "plain_latency_s": done.get(len(PROMPTS)),
        "texts": [h.finish.text for h in handles],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="runs/tiny")
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--speculate", type=int, default=4)
    ap.add_argument("--draft-depth", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline-src", default=None, help="another checkout's src, run beside this one")
    ap.add_argument("--out", default=None)
    ap.add_argument("--arm", choices=["uniform", "mixed"], help=argparse.SUPPRESS)  # a child process
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(one_run(args)))
        return
    sources = {"this checkout": str(REPO / "src")}
    if args.baseline_src:
        sources["baseline"] = args.baseline_src
    results: dict = {(s, a): [] for s in sources for a in ("uniform", "mixed")}
    for r in range(args.rounds):
        for (source, arm), runs in results.items():
            cmd = [sys.executable, __file__, "--arm", arm, "--checkpoint", args.checkpoint, "--depth", str(args.depth)]
            cmd += ["--speculate", str(args.speculate), "--draft-depth", str(args.draft_depth)]
            cmd += ["--max-tokens", str(args.max_tokens)]
            env = {**os.environ, "PYTHONPATH": sources[source], "OMP_NUM_THREADS": "1"}
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=REPO)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            got = runs[-1]
            plain = got["plain_latency_s"]
            print(
                f"round {r + 1} {source:>13} {arm:>7}: {got['tokens_per_s']:7.1f} tokens/s, speculating "
                f"requests {got['speculating_latency_s']:.3f} s" + (f", plain request {plain:.3f} s" if plain else ""),
                flush=True,
            )
    rows = []
    for (source, arm), runs in results.items():
        med = {k: statistics.median(x[k] for x in runs) for k in ("tokens_per_s", "speculating_latency_s")}
        plain = [x["plain_latency_s"] for x in runs if x["plain_latency_s"] is not None]
        med["plain_latency_s"] = statistics.median(plain) if plain else None
        rows.append(
            {"source": source, "arm": arm, **med, "runs": [{k: v for k, v in x.items() if k != "texts"} for x in runs]}
        )
    texts = {f"{s} {a}": runs[0]["texts"] for (s, a), runs in results.items()}
    same = all(t[: len(PROMPTS)] == texts[f"this checkout {'uniform'}"] for t in texts.values())
    print(f"every speculating request's text equal across arms and sources: {same}")
    report = {
        "command": command_line(),
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
        "settings": {k: v for k, v in vars(args).items() if k != "arm"},
        "rows": rows,
        "texts_equal": same,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
