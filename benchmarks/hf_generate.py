"""Decode speed of the transformers wrapper: `LoopedLMForCausalLM.generate()` vs looplm's own
`looplm.infer.generate.generate()`, at the same settings, side by side in one run.

    python benchmarks/hf_generate.py [--rounds 9] [--threads 1] [--device cpu] [--compile] [--out benchmarks/results/hf_generate.json]

Model: the `tiny` preset's shape (d 128, 4/2 heads, FFN 384, 1/2/1 blocks, context 256, byte
vocabulary 258), random weights (speed does not depend on training), fp32. Both arms: greedy,
terminal KV cache, depth 5 for the prompt and for every decoded token, the same 4 prompts, the
same max_new_tokens; the tokens they produce are checked to be identical. The two arms alternate
over several rounds after a warm-up; each arm's median tokens/s (batch rows x new tokens over the
wall time of the whole call, prefill included) and the ratio hf / looplm are reported. `--compile`
adds the two arms compiled: looplm's `generate(compile=True)` and the wrapper's
`generate(compile_decode=True)`, both through looplm's compiled `DecodeStep` (compiled in the
warm-up, which is timed and reported), and the ratio of the two.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from _command import command_line  # benchmarks/ is on sys.path when a script there runs

from looplm.config import model_preset
from looplm.data import ByteTokenizer
from looplm.infer.generate import DepthRule, SamplingConfig, generate

PROMPTS = ["+12,34=", "KING.\nWhat say you", "the looped model", "a"]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}: {cpu}, {torch.get_num_threads()} torch threads"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", action="store_true", help="also both arms with the compiled decode step")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/hf_generate.json"))
    args = ap.parse_args()

    import transformers

    from looplm.hf import LoopedLMForCausalLM

    torch.set_num_threads(args.threads)
    command = command_line(python=Path(sys.executable).name)
    print(
        f"command: {command}\nmachine: {machine()}\ndevice: {args.device}\n"
        f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}"
    )

    tok = ByteTokenizer()
    torch.manual_seed(0)
    from looplm.model import LoopedLM

    cfg = dataclasses.replace(model_preset("tiny"), vocab_size=tok.vocab_size)
    model = LoopedLM(cfg).to(args.device).eval()
    hf = LoopedLMForCausalLM.from_looplm(model, tok, num_steps=args.depth, cache_kind="terminal").eval()
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens)  # greedy
    enc = [tok.encode(p) for p in PROMPTS]
    L = max(map(len, enc))
    ids = torch.tensor([[tok.pad_id] * (L - len(e)) + e for e in enc], device=args.device)
    mask = torch.tensor([[0] * (L - len(e)) + [1] * len(e) for e in enc], device=args.device)

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def run_looplm(compile=False):
        stats: dict = {}
        generate(
            model,
            tok,
            PROMPTS,
            DepthRule(args.depth),
            cache="terminal",
            sampling=sampling,
            compile=compile,
            stats=stats,
        )
        return stats["token_ids"]

    @torch.no_grad()
    def run_hf(compile=False):
        return hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            num_steps=args.depth,
            cache_kind="terminal",
            compile_decode=compile,
        )

    def ids_of(out) -> list[list[int]]:
        """Each row's generated ids up to its EOS: compared as ids, not as text (a random model's bytes
        are mostly invalid UTF-8, which decodes to U+FFFD whatever the byte)."""
        return [row[: row.index(tok.eos_id)] if tok.eos_id in row else row for row in out[:, L:].tolist()]

    arms = {"looplm": run_looplm, "hf": run_hf}
    if args.compile:
        arms.update({"looplm compiled": lambda: run_looplm(True), "hf compiled": lambda: run_hf(True)})
    warm_up, want = {}, None
    for name, arm in arms.items():  # warm-up (compiles), and the same tokens from every arm
        t = time.perf_counter()
        out = arm()
        warm_up[name] = time.perf_counter() - t
        got = out if name.startswith("looplm") else ids_of(out)
        if name == "hf":
            steps = out.shape[1] - L  # decode steps of every arm (they stop together, at max_new_tokens or all-EOS)
        want = got if want is None else want
        if got != want:
            raise SystemExit(f"arm {name!r} produced other tokens than arm 'looplm'")
    tokens = len(PROMPTS) * steps

    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.rounds):
        order = list(arms)[r % len(arms) :] + list(arms)[: r % len(arms)]  # who goes first rotates
        for name in order:
            sync()
            t = time.perf_counter()
            arms[name]()
            sync()
            times[name].append(time.perf_counter() - t)

    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: tokens / med[k] for k in med}
    result = {
        "command": command,
        "machine": machine(),
        "device": args.device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "model": {**model.cfg.to_dict(), "preset": "tiny", "weights": "random", "dtype": "fp32"},
        "settings": {
            "depth": args.depth,
            "prefill_depth": args.depth,
            "cache": "terminal",
            "greedy": True,
            "prompts": PROMPTS,
            "batch": len(PROMPTS),
            "max_new_tokens": args.max_new_tokens,
            "decode_steps": steps,
            "rounds": args.rounds,
            "threads": args.threads,
        },
        "seconds": times,
        "median_seconds": med,
        "tokens_per_s": tps,
        "ms_per_step": {k: 1e3 * med[k] / steps for k in med},
        "ratio_hf_over_looplm": tps["hf"] / tps["looplm"],
        "same_tokens": True,
        "warm_up_s": warm_up,
    }
    if args.compile:
        result["ratio_hf_compiled_over_looplm_compiled"] = tps["hf compiled"] / tps["looplm compiled"]
        result["ratio_hf_compiled_over_hf"] = tps["hf compiled"] / tps["hf"]
    print(
        f"{len(PROMPTS)} prompts x {steps} new tokens, depth {args.depth}, terminal cache, greedy; "
        f"median of {args.rounds} alternating rounds:"
    )
    for k in arms:
        print(
            f"  {k:15} {tps[k]:9.1f} tokens/s  {1e3 * med[k]:8.1f} ms/call  {1e3 * med[k] / steps:6.2f} ms/step"
            f"  (warm-up {warm_up[k]:.1f} s)"
        )
    print(f"  hf / looplm tokens/s: {result['ratio_hf_over_looplm']:.3f}")
    if args.compile:
        print(f"  hf compiled / looplm compiled: {result['ratio_hf_compiled_over_looplm_compiled']:.3f}")
        print(f"  hf compiled / hf: {result['ratio_hf_compiled_over_hf']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
