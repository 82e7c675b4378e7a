"""`benchmarks/decode_profile.py`'s kernel arithmetic on hand-made profiler events: kernels only (host
events ignored), per-step counts, summed busy time against the first-to-last span, and the ranking."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

from torch.autograd import DeviceType
from torch.autograd.profiler_util import Interval

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load_decode_profile():
    sys.path.insert(0, str(BENCH))  # the script imports its sibling `_command`
    try:
        spec = importlib.util.spec_from_file_location("decode_profile", BENCH / "decode_profile.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def event(name, start, end, device=DeviceType.CUDA):
    return SimpleNamespace(name=name, device_type=device, time_range=Interval(start, end))


def test_kernel_stats_counts_kernels_busy_time_and_span_per_step():
    events = [
        event("gemv", 0, 2),
        event("aten::mm", 0, 50, DeviceType.CPU),  # a host event: not a kernel
        event("norm", 3, 4),
        event("gemv", 5, 9),
        event("gemv", 10, 12),
    ]
    stats = load_decode_profile().kernel_stats(SimpleNamespace(events=lambda: events), steps=2, top=1)
    assert stats["kernels_per_step"] == 2  # 4 kernels over 2 steps
    assert stats["kernel_us_per_step"] == (2 + 1 + 4 + 2) / 2
    assert stats["span_us_per_step"] == (12 - 0) / 2  # gaps between kernels count in the span only
    assert stats["median_kernel_us"] == 2
    assert stats["top"] == [{"name": "gemv", "calls_per_step": 1.5, "us_per_step": 4.0}]


def test_no_kernels_on_a_cpu():
    stats = load_decode_profile().kernel_stats(
        SimpleNamespace(events=lambda: [event("aten::mm", 0, 5, DeviceType.CPU)]), 1, 3
    )
    assert stats == {"kernels_per_step": 0}
