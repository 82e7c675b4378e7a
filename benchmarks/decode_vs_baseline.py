"""`generate` at batch 1 against the code the fast-decoding issue was measured on, side by side.

    git worktree add /tmp/looplm-baseline f6932e3     # the main the issue measured (2026-12-01)
    python benchmarks/decode_vs_baseline.py --baseline-src /tmp/looplm-baseline/src \
        [--huginn-src DIR --huginn-python PY] \
        [--depth 32] [--tokens 128] [--rounds 3] [--out benchmarks/results/decode_vs_baseline.json]

What the user calls: `looplm.infer.generate(model, tokenizer, [prompt], DepthRule(R))` (the baseline's
`generate(..., depth=R)`) on one 64-byte
prompt, greedy, terminal cache, the tiny preset's shape (d 128, 4/2 heads, FFN 384, 1/2/1 blocks)
with random weights (seed 0) and the byte tokenizer. Three arms, each in its own process (a fresh
interpreter per arm and round, arms alternating within a round):
  * `baseline`: `generate` of the baseline checkout (eager, a host sync per step and per recurrence);
  * `eager`: `generate` now, `compile=False` (the static decode step, not compiled);
  * `compiled`: `generate` now, `compile=True` (inductor; its compile happens in a warm-up call
    that is not timed, and is reported apart);
  * `huginn` (with `--huginn-src`, a checkout of Huginn's public repository seal-rg/recurrent-pretraining,
    and `--huginn-python`, the interpreter of a scratch environment with the transformers version
    Huginn's config names, 4.47.1): Huginn-0125's own modeling code (`recpre/raven_modeling_minimal.py`)
    at the same shape (d 128, 4 heads, FFN 384, 1/2/1 blocks, byte vocabulary, fp32, random weights),
    decoding by its `generate` at `num_steps` = depth with its default cache (one K/V entry per layer
    visit). Nothing of Huginn's code is part of looplm: the arm imports it from the given folder.
  * `compiled mha`: `generate(compile=True)` with 4 key/value heads, as Huginn's attention has (the
    other looplm arms use the tiny preset's 2), so the two differ in code, not in shape.
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


def _arm(depth: int, tokens: int, compile: bool, repeats: int, kv_heads: int = 2) -> dict:
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
        vocab_size=258, max_seq_len=256, d_model=128, n_heads=4, n_kv_heads=kv_heads, ffn_dim=384, tie_embeddings=False
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

    return _timed(run, tokens, repeats)


def _huginn_arm(depth: int, tokens: int, repeats: int) -> dict:
    """Run inside Huginn's environment (no looplm there): Huginn's RavenForCausalLM at the tiny shape."""
    import importlib.util
    import types

    import torch

    # the two modules alone: recpre's __init__ imports its training stack (tokenizer, optimizers, ...)
    package = types.ModuleType("recpre")
    package.__path__ = list(importlib.util.find_spec("recpre").submodule_search_locations)
    sys.modules["recpre"] = package
    from recpre.raven_config_minimal import RavenConfig
    from recpre.raven_modeling_minimal import RavenForCausalLM

    torch.manual_seed(0)
    cfg = RavenConfig(
        n_embd=128,
        n_heads=4,
        n_layers=4,
        block_size=256,
        vocab_size=258,
        padding_multiple=1,
        tie_embeddings=False,
        intermediate_size=384,
        n_layers_in_prelude=1,
        n_layers_in_recurrent_block=2,
        n_layers_in_coda=1,
        mean_recurrence=depth,
        torch_dtype="float32",
    )
    model = RavenForCausalLM(cfg).eval().float()
    ids = torch.tensor([list(PROMPT.encode())])

    def run(n: int) -> float:
        t = time.perf_counter()
        out = model.generate(
            ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, num_steps=depth, eos_token_id=None, pad_token_id=0
        )
        elapsed = time.perf_counter() - t
        assert out.shape[1] == ids.shape[1] + n, f"decoded {out.shape[1] - ids.shape[1]} tokens, not {n}"
        return elapsed

    return _timed(run, tokens, repeats)


def _timed(run, tokens: int, repeats: int) -> dict:
    """Warm up, then time `repeats` pairs of generations of `tokens` and of one token."""
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
    p.add_argument("--huginn-src", type=Path, help="a checkout of seal-rg/recurrent-pretraining (holds recpre/)")
    p.add_argument("--huginn-python", type=Path, help="the interpreter of Huginn's environment (its transformers)")
    p.add_argument("--depth", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="timed pairs of generations per arm and round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_vs_baseline.json"))
    p.add_argument("--arm", choices=["baseline", "eager", "compiled", "compiled mha", "huginn"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.arm:  # inside an arm's process
        import torch

        torch.set_num_threads(a.threads)
        if a.arm == "huginn":
            result = _huginn_arm(a.depth, a.tokens, a.repeats)
        else:
            result = _arm(a.depth, a.tokens, a.arm.startswith("compiled"), a.repeats, 4 if "mha" in a.arm else 2)
        print(json.dumps(result))
        return
    if a.baseline_src is None and a.huginn_src is None:
        p.error("give --baseline-src (a baseline checkout's src folder) and/or --huginn-src with --huginn-python")
    if a.baseline_src is not None and not (a.baseline_src / "looplm").is_dir():
        p.error("--baseline-src must name the src folder of a baseline checkout (it holds looplm/)")
    if a.huginn_src is not None and not (
        (a.huginn_src / "recpre" / "raven_modeling_minimal.py").is_file() and a.huginn_python is not None
    ):
        p.error("--huginn-src must name a checkout holding recpre/raven_modeling_minimal.py, with --huginn-python")
    here = Path(__file__).resolve().parents[1] / "src"
    arms = {"eager": (here, sys.executable), "compiled": (here, sys.executable)}
    if a.baseline_src is not None:
        arms = {"baseline": (a.baseline_src.resolve(), sys.executable), **arms}
    if a.huginn_src is not None:
        arms.update({"compiled mha": (here, sys.executable), "huginn": (a.huginn_src.resolve(), str(a.huginn_python))})
    results: dict[str, list[dict]] = {k: [] for k in arms}
    for rnd in range(a.rounds):
        order = list(arms)[rnd % len(arms) :] + list(arms)[: rnd % len(arms)]
        for arm in order:
            src, python = arms[arm]
            env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS=str(a.threads))
            cmd = [
                python,
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
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"arm {arm!r} failed:\n{out.stderr[-3000:]}")
            results[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(
                f"round {rnd + 1}/{a.rounds} {arm:9s} {results[arm][-1]['decode_tokens_per_s']:8.1f} tok/s", flush=True
            )
    med = {k: statistics.median(r["decode_tokens_per_s"] for r in v) for k, v in results.items()}
    summary = {
        "decode_tokens_per_s": med,
        "compiled_over_eager": med["compiled"] / med["eager"],
        "compiled_warm_up_s": statistics.median(r["warm_up_s"] for r in results["compiled"]),
    }
    if "baseline" in med:
        summary["compiled_over_baseline"] = med["compiled"] / med["baseline"]
        summary["eager_over_baseline"] = med["eager"] / med["baseline"]
    if "huginn" in med:
        summary["compiled_mha_over_huginn"] = med["compiled mha"] / med["huginn"]
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
