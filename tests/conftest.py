"""Shared pytest fixtures for the looplm test suite."""

from __future__ import annotations

import dataclasses

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
