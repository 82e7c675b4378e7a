"""`generate` at batch 1 against the code the fast-decoding issue was measured on, side by side.

    git worktree add /tmp/looplm-baseline f6932e3     # the main the issue measured (2026-12-01)
    python benchmarks/decode_vs_baseline.py --baseline-src /tmp/looplm-baseline/src \
        [--depth 32] [--tokens 128] [--rounds 3] [--out benchmarks/results/decode_vs_baseline.json]

What the user calls: `looplm.infer.generate(model, tokenizer, [prompt], DepthRule(R))` (the baseline's
`generate(..., depth=R)`) on one 64-byte
prompt, greedy, terminal cache, the tiny preset's shape (d 128, 4/2 heads, FFN 384, 1/2/1 blocks)
with random weights (seed 0) and the byte tokenizer. Three arms, each in its own process (a fresh
interpreter per arm and round, arms alternating within a round):
  * `baseline`: `generate` of the baseline checkout (eager, a host sync per step and per recurrence);
  * `eager`: `generate` now, `compile=False` (the static decode step, not compiled);
  * `compiled`: `generate` now, `compile=True` (inductor; its compile happens in a warm-up call
    that is not timed, and is reported apart).
Decode tokens/s = (tokens - 1) / (t(tokens) - t(1)): the time of a generation of `--tokens` new
tokens minus that of one new token, which removes the prefill and the first token from both. The
untied head's rows for <eos> and <pad> are zeroed so that every arm decodes all `--tokens` tokens.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _command import command_line  # noqa: E402

PROMPT = "To be, or not to be, that is the question: whether 'tis nobler i"  # 64 bytes


def _arm(depth: int, tokens: int, compile: bool, repeats: int) -> dict:
    """Run inside the arm's own interpreter: warm up, then time `repeats` pairs of generations."""
    import torch

    from looplm.config import ModelConfig
    from looplm.data.tokenizer import ByteTokenizer
    from looplm.infer.generate import SamplingConfig, generate
    from looplm.model import LoopedLM

    try:  # today's call: generate(..., DepthRule(R)); the baseline's: generate(..., depth=R)
        from looplm.infer import DepthRule

        depth_args, depth_kw = (DepthRule(depth),), {}
    except ImportError:
        depth_args, depth_kw = (), {"depth": depth}

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=258, max_seq_len=256, d_model=128, n_heads=4, n_kv_heads=2, ffn_dim=384, tie_embeddings=False
    )
    model = LoopedLM(cfg).eval()
    with torch.no_grad():
        model.head.weight[256:] = 0.0  # <eos> and <pad> never win the argmax: every run decodes `tokens`
    tok = ByteTokenizer()
    extra = {"compile": True} if compile else {}

    def run(n: int) -> float:
        t = time.perf_counter()
        out = generate(
            model, tok, [PROMPT], *depth_args, sampling=SamplingConfig(max_new_tokens=n), **depth_kw, **extra
        )
        elapsed = time.perf_counter() - t
        assert out[0], "nothing decoded"
        return elapsed

    t = time.perf_counter()
    run(tokens)  # warm-up (the compile, for the compiled arm)
    warm_up = time.perf_counter() - t
    long, short = [], []
    for _ in range(repeats):
        long.append(run(tokens))
        short.append(run(1))
    decode_s = statistics.median(long) - statistics.median(short)
    return {
        "decode_tokens_per_s": (tokens - 1) / decode_s,
        "t_long_s": statistics.median(long),
        "t_one_s": statistics.median(short),
        "warm_up_s": warm_up,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-src", type=Path, help="the `src` folder of a checkout of the baseline commit")
    p.add_argument("--depth", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="timed pairs of generations per arm and round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_vs_baseline.json"))
    p.add_argument("--arm", choices=["baseline", "eager", "compiled"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.arm:  # inside an arm's process
        import torch

        torch.set_num_threads(a.threads)
        print(json.dumps(_arm(a.depth, a.tokens, a.arm == "compiled", a.repeats)))
        return
    if a.baseline_src is None or not (a.baseline_src / "looplm").is_dir():
        p.error("--baseline-src must name the src folder of a baseline checkout (it holds looplm/)")
    here = Path(__file__).resolve().parents[1] / "src"
    arms = {"baseline": a.baseline_src.resolve(), "eager": here, "compiled": here}
    results: dict[str, list[dict]] = {k: [] for k in arms}
    for rnd in range(a.rounds):
        order = list(arms)[rnd % 3 :] + list(arms)[: rnd % 3]
        for arm in order:
            env = dict(os.environ, PYTHONPATH=str(arms[arm]), OMP_NUM_THREADS=str(a.threads))
            cmd = [
                sys.executable,
                __file__,
                "--arm",
                arm,
                "--depth",
                str(a.depth),
                "--tokens",
                str(a.tokens),
                "--repeats",
                str(a.repeats),
                "--threads",
                str(a.threads),
            ]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            results[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(
                f"round {rnd + 1}/{a.rounds} {arm:9s} {results[arm][-1]['decode_tokens_per_s']:8.1f} tok/s", flush=True
            )
    med = {k: statistics.median(r["decode_tokens_per_s"] for r in v) for k, v in results.items()}
    summary = {
        "decode_tokens_per_s": med,
        "compiled_over_baseline": med["compiled"] / med["baseline"],
        "eager_over_baseline": med["eager"] / med["baseline"],
        "compiled_over_eager": med["compiled"] / med["eager"],
        "compiled_warm_up_s": statistics.median(r["warm_up_s"] for r in results["compiled"]),
    }
    record = {
        "command": command_line(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": a.threads},
        "depth": a.depth,
        "tokens": a.tokens,
        "rounds": results,
        "summary": summary,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
