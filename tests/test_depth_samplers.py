"""Depth samplers (design §3): sampling statistics against the paper's PLN-5 table, seeded and resumable
draws, and the configuration's checks and backprop window."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_depth_pln import PAPER_PLN5, R

from looplm.depth import DepthConfig, FixedDepth, PLNDepth, UniformDepth, build_sampler


# ---------------------------------------------------------------------------------------------
# Samplers
# ---------------------------------------------------------------------------------------------
def test_fixed_depth_always_returns_its_depth():
    s = build_sampler(DepthConfig(sampler="fixed", depth=7))
    assert isinstance(s, FixedDepth)
    assert {s.draw() for _ in range(200)} == {7}
    expected = np.zeros(64)
    expected[6] = 1
    np.testing.assert_array_equal(s.pmf(), expected)
    assert s.mean() == 7


def test_uniform_depth_frequencies():
    s = build_sampler(DepthConfig(sampler="uniform", low=2, high=6, seed=3))
    assert isinstance(s, UniformDepth)
    n = 10000
    draws = np.array([s.draw() for _ in range(n)])
    assert draws.min() == 2 and draws.max() == 6
    freq = np.bincount(draws, minlength=7)[2:7] / n
    tol = 5 * math.sqrt(0.2 * 0.8 / n)  # 5 binomial standard errors
    np.testing.assert_allclose(freq, 0.2, rtol=0, atol=tol)
    assert abs(s.mean() - 4.0) < 1e-12


def test_pln_sampler_empirical_mean_and_frequencies():
    s = build_sampler(DepthConfig(sampler="pln", depth=5.0, seed=11))
    assert isinstance(s, PLNDepth)
    n = 20000
    draws = np.array([s.draw() for _ in range(n)])
    assert draws.min() >= 1 and draws.max() <= 64
    mean = np.dot(R, PAPER_PLN5)
    std = math.sqrt(np.dot((R - mean) ** 2, PAPER_PLN5))
    assert abs(draws.mean() - 5.0) < 5 * std / math.sqrt(n)
    freq = np.bincount(draws, minlength=65)[1:11] / n
    tol = 5 * np.sqrt(PAPER_PLN5[:10] * (1 - PAPER_PLN5[:10]) / n)
    assert (np.abs(freq - PAPER_PLN5[:10]) <= tol).all()


@pytest.mark.parametrize(
    "cfg",
    [
        DepthConfig(sampler="pln", depth=5.0, seed=5),
        DepthConfig(sampler="uniform", low=1, high=12, seed=5),
        DepthConfig(sampler="fixed", depth=4, seed=5),
    ],
)
def test_restored_sampler_continues_the_same_sequence(cfg):
    uninterrupted = build_sampler(cfg)
    reference = [uninterrupted.draw() for _ in range(60)]

    first = build_sampler(cfg)
    head = [first.draw() for _ in range(25)]
    state = first.state_dict()
    resumed = build_sampler(DepthConfig(sampler=cfg.sampler, depth=cfg.depth, low=cfg.low, high=cfg.high, seed=99))
    resumed.load_state_dict(state)  # restores the seed too
    tail = [resumed.draw() for _ in range(35)]
    assert head + tail == reference
    assert resumed.state_dict()["counter"] == 60


def test_same_seed_draws_identically_and_different_seed_differs():
    ranks = [build_sampler(DepthConfig(sampler="pln", seed=42)) for _ in range(4)]
    seqs = [[s.draw() for _ in range(100)] for s in ranks]
    assert all(seq == seqs[0] for seq in seqs)
    other = build_sampler(DepthConfig(sampler="pln", seed=43))
    assert [other.draw() for _ in range(100)] != seqs[0]


def test_draw_depends_only_on_seed_and_counter():
    """Interleaving unrelated global RNG use (numpy's legacy RNG) changes nothing."""
    a = build_sampler(DepthConfig(sampler="uniform", low=1, high=20, seed=7))
    b = build_sampler(DepthConfig(sampler="uniform", low=1, high=20, seed=7))
    seq_a = [a.draw() for _ in range(30)]
    seq_b = []
    for i in range(30):
        np.random.seed(i)
        np.random.rand(3)
        seq_b.append(b.draw())
    assert seq_a == seq_b
    # jumping the counter skips exactly that many draws
    c = build_sampler(DepthConfig(sampler="uniform", low=1, high=20, seed=7))
    c.load_state_dict({"counter": 10, "seed": 7})
    assert [c.draw() for _ in range(20)] == seq_a[10:]


@pytest.mark.parametrize(
    "cfg",
    [
        DepthConfig(sampler="fixed", depth=0),
        DepthConfig(sampler="fixed", depth=65),
        DepthConfig(sampler="fixed", depth=2.5),
        DepthConfig(sampler="pln", depth=0),
        DepthConfig(sampler="pln", depth=70),
        DepthConfig(sampler="uniform", low=6, high=3),
        DepthConfig(sampler="uniform", low=0, high=3),
        DepthConfig(sampler="uniform", low=2, high=65),
        DepthConfig(sampler="learned-ish"),  # type: ignore[arg-type]
        DepthConfig(sampler="pln", bptt_window=0),
        DepthConfig(sampler="fixed", depth=3, bptt_window=-2),
        DepthConfig(sampler="pln", bptt_window="full"),  # type: ignore[arg-type]
        DepthConfig(sampler="fixed", depth=1, cap=0),
    ],
)
def test_bad_configs_raise(cfg):
    with pytest.raises(ValueError):
        build_sampler(cfg)


# -- the backprop window (design §3: b = 10 for the sampled priors, b = R for the fixed-depth baseline) --
def test_default_window_is_full_bptt_for_fixed_depth_and_10_for_sampled_priors():
    assert DepthConfig().bptt_window == "auto"
    # fixed depth is the paper's full-BPTT baseline: no truncation at any R (None = full BPTT)
    for r in (1, 5, 16, 64):
        assert DepthConfig(sampler="fixed", depth=r).effective_bptt_window() is None
    for sampler in ("pln", "uniform", "learned"):
        assert DepthConfig(sampler=sampler).effective_bptt_window() == 10


@pytest.mark.parametrize("preset", ["tiny", "S", "M", "L"])
def test_presets_train_pln_with_b_10_and_a_fixed_depth_with_full_bptt(preset):
    from looplm.train.config import job_from_dict, job_preset

    job = job_preset(preset)
    assert (job.depth.sampler, job.resolved().depth.bptt_window) == ("pln", 10)
    job.depth.sampler, job.depth.depth = "fixed", 32.0  # `looplm train S --depth.sampler fixed --depth.depth 32`
    assert job.resolved().depth.bptt_window is None
    assert job_from_dict(job.resolved().to_dict()).depth.bptt_window is None  # recorded resolved


@pytest.mark.parametrize("sampler", ["fixed", "pln", "uniform", "learned"])
@pytest.mark.parametrize("window", [1, 4, 10, 32, None])
def test_explicit_window_is_kept(sampler, window):
    assert DepthConfig(sampler=sampler, depth=5, bptt_window=window).effective_bptt_window() == window


def test_successive_draws_are_independent():
    """Consecutive draws repeat with probability sum p^2 (1/20 for U(1..20)), not more."""
    s = build_sampler(DepthConfig(sampler="uniform", low=1, high=20, seed=1))
    n = 4000
    draws = np.array([s.draw() for _ in range(n)])
    repeats = (draws[1:] == draws[:-1]).mean()
    assert abs(repeats - 0.05) < 5 * math.sqrt(0.05 * 0.95 / n)
    lag1 = np.corrcoef(draws[1:], draws[:-1])[0, 1]
    assert abs(lag1) < 5 / math.sqrt(n)


# -- the config's cap, seed and sigma reach every sampler ----------------------------------------
def test_a_uniform_range_of_one_depth_always_draws_it():
    """low == high is a valid uniform range (a fixed depth drawn through the uniform sampler)."""
    s = build_sampler(DepthConfig(sampler="uniform", low=4, high=4))
    assert {s.draw() for _ in range(50)} == {4}
    expected = np.zeros(64)
    expected[3] = 1.0
    np.testing.assert_array_equal(s.pmf(), expected)


def test_a_fixed_depth_above_a_smaller_cap_is_refused():
    """The fixed depth is checked against the config's cap, not the default 64 (else pmf() indexes
    past the end of its cap-long vector)."""
    with pytest.raises(ValueError, match=r"fixed depth must be in 1\.\.8, got 10"):
        build_sampler(DepthConfig(sampler="fixed", depth=10, cap=8))
    s = build_sampler(DepthConfig(sampler="fixed", depth=8, cap=8))
    assert s.cap == 8 and s.pmf().tolist() == [0.0] * 7 + [1.0]


def test_pln_sampler_keeps_the_configs_cap():
    """depth.cap bounds the PLN sampler: its pmf covers 1..cap with the target mean, and no draw exceeds it."""
    s = build_sampler(DepthConfig(sampler="pln", depth=5.0, cap=8, seed=2))
    assert s.cap == 8 and s.pmf().shape == (8,)
    assert abs(s.mean() - 5.0) < 1e-9
    draws = [s.draw() for _ in range(2000)]
    assert max(draws) == 8  # the cap bucket holds the tail mass (about 10% at cap 8)


@pytest.mark.parametrize("sampler", ["pln", "uniform", "learned"])
def test_every_sampler_draws_from_the_configs_seed(sampler):
    """The config's seed reaches the sampler: equal seeds draw equal sequences, other seeds others."""

    def draws(seed):
        s = build_sampler(DepthConfig(sampler=sampler, low=1, high=20, seed=seed))
        return [s.draw() for _ in range(40)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


def test_learned_pln_init_uses_the_configs_sigma():
    from looplm.depth import pln_pmf

    s = build_sampler(DepthConfig(sampler="learned", depth=5.0, sigma=0.9))
    np.testing.assert_allclose(s.pmf(), pln_pmf(5.0, 0.9, 64), rtol=1e-12, atol=0)
    assert abs(s.mean() - 5.0) < 1e-9


def test_learned_logits_longer_than_the_cap_are_refused():
    """A prior's logits must cover exactly 1..cap: longer ones would draw depths above depth.cap."""
    with pytest.raises(ValueError, match=r"cover depths 1\.\.64 but depth.cap is 8"):
        build_sampler(DepthConfig(sampler="learned", depth=5.0, cap=8), init_logits=np.zeros(64))
    assert build_sampler(DepthConfig(sampler="learned", depth=5.0, cap=8), init_logits=np.zeros(8)).cap == 8


@pytest.mark.parametrize("window", [True, False])
def test_a_boolean_window_is_refused(window):
    """bool is an int subclass: True must not pass as a window of 1 (nor False as 0)."""
    with pytest.raises(ValueError, match="bptt_window must be >= 1"):
        DepthConfig(sampler="pln", bptt_window=window).effective_bptt_window()
