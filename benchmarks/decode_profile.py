#!/usr/bin/env python
"""Where a compiled decode step's time goes on a GPU: kernels per step, the GPU's busy time, and the
idle time between kernels, from one `torch.profiler` window over a few steps of `DecodeStep`.

The question it answers: the S-width step at R = 32 takes about 5 ms whatever the batch and however
many graphs it replays (BENCHMARKS.md, "Decode on a GPU"), while its weights take 0.8 ms to read.
If the kernels' summed durations are near the step's wall time, the GPU is busy with many small
kernels (fewer, fused kernels per layer visit are the lever); if they are far below it, the GPU waits
between kernels (launches, the host).

    PYTHONPATH=src python benchmarks/decode_profile.py --out "$OUT"           # one GPU, ~1 minute
    PYTHONPATH=src python benchmarks/decode_profile.py --tiny                  # CPU dry run of the code path

Arms (`--arms`): `graphs` (`mode="reduce-overhead"`, what looplm uses on CUDA), `nographs`
(`mode="default"`) and `graphs+freezing` (inductor's freezing: weights as constants, so its patterns
concatenate the products sharing an input once; weights must not change afterwards), each with the
first step's logits against the eager step's, batch 1 (and `--batch` more), terminal cache, random
weights, bf16, after a 512-token prompt. Writes
`<out>/decode_profile.json` (`benchmarks/results/decode_profile_tiny.json` with --tiny).
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
from _command import command_line  # benchmarks/ is on sys.path when a script runs
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from looplm.config import ModelConfig, model_preset
from looplm.infer import extend, make_cache
from looplm.infer.step import DecodeStep, StepRows
from looplm.model import LoopedLM

R = 32


def kernel_stats(prof, steps: int, top: int) -> dict:
    """Kernel count, summed kernel time and first-to-last span per step, and the `top` kernels by time."""
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not kernels:
        return {"kernels_per_step": 0}
    busy = sum(e.time_range.elapsed_us() for e in kernels)
    span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "kernels_per_step": len(kernels) / steps,
        "kernel_us_per_step": busy / steps,
        "span_us_per_step": span / steps,
        "median_kernel_us": statistics.median(e.time_range.elapsed_us() for e in kernels),
        "top": [{"name": n[:120], "calls_per_step": len(t) / steps, "us_per_step": sum(t) / steps} for n, t in ranked],
    }


ARMS = {
    "graphs": {"mode": "reduce-overhead"},  # what looplm uses on CUDA
    "nographs": {"mode": "default"},
    # inductor's freezing: weights become constants, and its patterns concatenate the products that
    # share an input (q/k/v, w1/w3) once; the step adds CUDA graphs as the option `triton.cudagraphs`
    # (`step_compile_options`: a mode excludes options)
    "graphs+freezing": {"options": {"freezing": True}},
}


def setup(model, cfg, batch: int, prompt_len: int, device, dtype):
    """A terminal cache after the same random prompt (seeded: every arm starts from equal banks)."""
    cache = make_cache("terminal", cfg, batch, cfg.max_seq_len, R, device=device, dtype=dtype)
    prompt = torch.randint(
        0, cfg.vocab_size, (batch, prompt_len), device=device, generator=torch.Generator(device).manual_seed(0)
    )
    with torch.no_grad():
        extend(model, prompt, cache, R)
    rows = StepRows(
        torch.zeros(batch, dtype=torch.long, device=device),
        torch.full((batch,), prompt_len, device=device),
        torch.zeros(batch, dtype=torch.long, device=device),
        torch.arange(batch, device=device),
    )
    return cache, rows


def arm(model, cfg, name, options, batch, prompt_len, device, dtype, steps: int, top: int, reference) -> dict:
    cache, rows = setup(model, cfg, batch, prompt_len, device, dtype)
    step = DecodeStep(model, cache, compile=True, compile_options=options)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    logits, _ = step(rows, R)  # compiles; the first step's logits against the eager step's
    for _ in range(2):  # records the graphs, replays them
        step(rows, R)
    sync()
    warm = time.perf_counter() - t0
    err = ((logits.float() - reference).abs().max() / reference.abs().max()).item()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step(rows, R)
        sync()
        times.append(time.perf_counter() - t)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(5):
            step(rows, R)
        sync()
    wall_us = statistics.median(times) * 1e6
    stats = kernel_stats(prof, 5, top)
    if stats.get("kernel_us_per_step"):
        stats["gpu_busy_of_wall"] = stats["kernel_us_per_step"] / wall_us
    return {
        "arm": name,
        "options": options,
        "batch": batch,
        "wall_us_per_step": wall_us,
        "warmup_s": warm,
        "logits_rel_err_vs_eager": err,
        **stats,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: a 64-wide model, no kernels to count")
    ap.add_argument(
        "--out", type=Path, default=None, help="output folder (default $OUT; with --tiny benchmarks/results)"
    )
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes (default 1)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per arm (default 20)")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per arm (default 12)")
    ap.add_argument(
        "--arms", nargs="+", choices=tuple(ARMS), default=["graphs", "nographs"], help="(default graphs nographs)"
    )
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        ap.error("no CUDA device: run with --tiny for the CPU dry run")
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") and not args.tiny else None)
    out = out or Path(__file__).resolve().parent / "results"
    name = "decode_profile_tiny.json" if args.tiny else "decode_profile.json"
    if args.tiny:
        base, dtype, prompt_len = (
            ModelConfig(vocab_size=512, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=192),
            torch.float32,
            32,
        )
    else:
        base, dtype, prompt_len = model_preset("S"), torch.bfloat16, 512
    cfg = ModelConfig(**{**base.to_dict(), "max_seq_len": prompt_len + 64})
    torch.manual_seed(0)
    model = LoopedLM(cfg).to(device=device, dtype=dtype).eval()
    result = {
        "command": command_line(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "shape": {"d_model": cfg.d_model, "blocks": [cfg.n_prelude, cfg.n_core, cfg.n_coda], "depth": R},
        "prompt": prompt_len,
        "rows": [],
    }
    out.mkdir(parents=True, exist_ok=True)
    for B in args.batch:
        cache, rows = setup(model, cfg, B, prompt_len, device, dtype)
        with torch.no_grad():
            reference = DecodeStep(model, cache)(rows, R)[0].float()  # the eager step
        for arm_name in args.arms:
            # a CPU (the dry run) has no graph modes: those arms run the step's default compile there
            spec = ARMS[arm_name]
            options = dict(spec) if device.type == "cuda" or "mode" not in spec else {}
            try:
                with torch.no_grad():  # freezing applies to graphs compiled without autograd
                    row = arm(
                        model, cfg, arm_name, options, B, prompt_len, device, dtype, args.steps, args.top, reference
                    )
            except Exception as e:  # one arm's failure keeps the others' rows
                row = {"arm": arm_name, "batch": B, "error": f"{type(e).__name__}: {e}"[:500]}
            result["rows"].append(row)
            brief = {k: v for k, v in row.items() if k != "top"}
            print(json.dumps(brief), flush=True)
            (out / name).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
