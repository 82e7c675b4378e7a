"""MFU peaks (train/mfu.py): the datasheet table by device name, and the measured matmul rate's
accounting (2 n^3 FLOPs per n x n matmul) against a clock that advances by a known step."""

from __future__ import annotations

import itertools

import pytest
import torch

from looplm.train import mfu
from looplm.train.mfu import datasheet_peak, measure_matmul_peak


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H200", 989.4),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),  # before the SXM entry: "H100" is in its name too
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_datasheet_peak_by_device_name(name, tflops):
    got = datasheet_peak(name)
    assert got == (tflops * 1e12 if tflops is not None else None)
    assert datasheet_peak(name, torch.float32) is None  # the table holds dense bf16 only


def test_measured_peak_counts_two_n_cubed_per_matmul(monkeypatch):
    ticks = itertools.count(0.0, 0.5)  # every perf_counter() call advances 0.5 s: each timed run "takes" 0.5 s
    monkeypatch.setattr(mfu.time, "perf_counter", lambda: next(ticks))
    n = 32
    got = measure_matmul_peak(torch.device("cpu"), torch.float32, n=n, window_s=1.2, windows=3)
    # one matmul "takes" 0.5 s, so a window of >= 1.2 s runs 3 matmuls in 0.5 s: 3 * 2 n^3 / 0.5
    assert got["reps_per_window"] == 3 and got["windows"] == 3 and got["timer"] == "wall clock"
    assert got["best"] == got["median"] == pytest.approx(3 * 2 * n**3 / 0.5)


def test_measured_peak_takes_the_best_and_median_window(monkeypatch):
    """Windows of unequal length: best is the fastest window's rate, median the median rate, and
    window_s the median window's measured length (not the asked minimum)."""
    # perf_counter() pairs: warm-up 0.5 s, one matmul 0.5 s, then windows of 0.5, 1.5 and 1.0 s
    lengths = iter([0.5, 0.5, 0.5, 1.5, 1.0])
    clock = {"t": 0.0, "start": True}

    def perf_counter():
        if not clock["start"]:
            clock["t"] += next(lengths)
        clock["start"] = not clock["start"]
        return clock["t"]

    monkeypatch.setattr(mfu.time, "perf_counter", perf_counter)
    n = 16
    got = measure_matmul_peak(torch.device("cpu"), torch.float32, n=n, window_s=1.2, windows=3)
    flops = 3 * 2 * n**3  # 3 matmuls a window (1.2 s / 0.5 s, rounded up)
    assert got["reps_per_window"] == 3
    assert got["best"] == pytest.approx(flops / 0.5)
    assert got["median"] == pytest.approx(flops / 1.0)
    assert got["window_s"] == pytest.approx(1.0)
