"""Shared pytest fixtures for the looplm test suite."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from looplm.config import ModelConfig

# A model small enough that a forward at depth 3 takes a few milliseconds on one CPU core.
TINY_MODEL = ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32, max_depth=64)


@pytest.fixture
def tiny_model_config():
    """Factory: `tiny_model_config(injection="ortho", ...)` gives a fresh tiny ModelConfig."""

    def make(**overrides) -> ModelConfig:
        return dataclasses.replace(TINY_MODEL, **overrides)

    return make


@pytest.fixture(autouse=True)
def _deterministic_torch():
    """Every test starts from the same global RNG state and restores the default dtype."""
    torch.manual_seed(0)
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture
def single_thread():
    """Run a test on one intra-op thread: tiny models are dominated by thread start-up and
    spin-wait costs, which explode on a loaded 2-core machine. Restores the previous count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# -- running in parallel (pytest-xdist, `-n auto` in pyproject) -------------------------------------------
# Each worker is its own process on its own core: one intra-op thread apiece, or two workers' OpenMP
# pools would spin against each other on a 2-core machine (the subprocess jobs already run on one thread).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per usable core, at most 4 (the suite's processes start torch each; beyond
    four its longest files, not the worker count, set the wall time)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


def pytest_collection_modifyitems(config, items):
    """Files with `slow` tests first, then the rest by test count, largest first: xdist hands out whole files
    in this order (`--no-loadscope-reorder`), so the long ones start at once and small files fill the tail."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(
        files.values(), key=lambda tests: (not any(t.get_closest_marker("slow") for t in tests), -len(tests))
    )
    items[:] = [t for tests in order for t in tests]
