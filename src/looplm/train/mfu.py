"""Model FLOPs utilisation: the peaks it is measured against (design §5).

MFU = model FLOPs/token (`looplm.train.flops`) x tokens/s / peak. Two peaks: the dense matmul rate
measured on the same device (what this GPU, at its clocks and power limit, does on a large GEMM),
and the datasheet's dense rate for the dtype (what the hardware is sold as).
"""

from __future__ import annotations

import statistics
import time

import torch

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s; matched against
# torch.cuda.get_device_name() in this order (the first key contained in the name wins).
DATASHEET_BF16_TFLOPS = (
    ("H200 NVL", 835.0),
    ("H200", 989.4),  # SXM
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),  # SXM
    ("A100", 312.0),
)


def datasheet_peak(device_name: str, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """The datasheet's dense FLOP/s of `device_name` for `dtype` (bf16 only), or None when unknown."""
    if dtype != torch.bfloat16:
        return None
    for key, tflops in DATASHEET_BF16_TFLOPS:
        if key in device_name:
            return tflops * 1e12
    return None


def measure_matmul_peak(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int = 8192, window_s: float = 0.25, windows: int = 8
) -> dict:
    """Dense matmul FLOP/s of [n, n] @ [n, n] on `device`: `windows` timed windows of back-to-back
    matmuls, each at least `window_s` long (timed by CUDA events on a GPU, so host overhead and
    launch gaps do not count; by wall clock on a CPU). Returns best and median FLOP/s over the windows
    (the first windows may run below full clocks) and how they were taken."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    cuda = device.type == "cuda"

    def run(reps: int) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                torch.mm(a, b, out=out)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        return time.perf_counter() - t

    run(2)  # warm-up: kernel selection, clocks
    one = max(run(1), 1e-6)
    reps = max(1, int(window_s / one + 0.999))
    seconds = [run(reps) for _ in range(windows)]
    rates = [2 * n**3 * reps / s for s in seconds]
    return {
        "best": max(rates),
        "median": statistics.median(rates),
        "n": n,
        "reps_per_window": reps,
        "windows": windows,
        "window_s": statistics.median(seconds),
        "timer": "cuda events" if cuda else "wall clock",
    }
