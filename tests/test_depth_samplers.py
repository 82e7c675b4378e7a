"""Depth priors and samplers (design §3) against the paper's PLN-5 table, an independent
trapezoid-rule integral of the Poisson-lognormal, and sampling statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from looplm.depth import DepthConfig, FixedDepth, PLNDepth, UniformDepth, build_sampler, calibrate_mu, pln_pmf
from looplm.depth.pln import pln_pmf_given_mu

# The paper's PLN-5 pmf over R = 1..64 (design appendix; the paper's table, copied verbatim).
PAPER_PLN5 = np.array([
    0.05768747546482591, 0.1271367387177668, 0.1634086392890813, 0.1619074983340164,
    0.13796282734225382, 0.10698272319110169, 0.07804764707860895, 0.05470693907876852,
    0.037361700976777726, 0.025099433949814245, 0.016697717702268286, 0.011052629620047851,
    0.007304055652903804, 0.004830737772361538, 0.003203151771039994, 0.002132081017445029,
    0.0014258721987138567, 0.0009586921076838706, 0.0006483099746274615, 0.0004410716241755722,
    0.000301944551073642, 0.00020800269392146997, 0.00014419125207641085, 0.00010058218331207551,
    7.059667258419262e-05, 4.9852412062464184e-05, 3.5414136427653425e-05, 2.5304622107571485e-05,
    1.8184285152127846e-05, 1.3140259666362847e-05, 9.546846563012203e-06, 6.972695919262932e-06,
    5.118738343708846e-06, 3.7764502416124336e-06, 2.7996353510214844e-06, 2.085238462098128e-06,
    1.5602277964955316e-06, 1.1725776685897305e-06, 8.850369680325107e-07, 6.708005361757733e-07,
    5.104868279453078e-07, 3.900165388933937e-07, 2.9911563900765575e-07, 2.3025345865338855e-07,
    1.778857064050211e-07, 1.3791253597731962e-07, 1.0728910765229482e-07, 8.3744719506e-08,
    6.557941898380174e-08, 5.151599353655518e-08, 4.059163481228815e-08, 3.207815872458309e-08,
    2.5422939995903076e-08, 2.020502320279681e-08, 1.6102459981160398e-08, 1.286800205515741e-08,
    1.0311018925701726e-08, 8.284031836490163e-09, 6.672645135115369e-09, 5.387960542342231e-09,
    4.3608027065798596e-09, 3.5372756494056925e-09, 2.8753142244955275e-09, 1.3322268843651841e-08,
])

R = np.arange(1, 65)


def trapezoid_pln_pmf(mu: float, sigma: float = 0.5, cap: int = 64, n: int = 40001) -> np.ndarray:
    """Capped PLN pmf by a dense trapezoid rule over ln(lambda) in [mu - 12 sigma, mu + 12 sigma]
    (an independent quadrature: no Gauss-Hermite nodes)."""
    x = np.linspace(mu - 12 * sigma, mu + 12 * sigma, n)
    density = np.exp(-0.5 * ((x - mu) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
    lam = np.exp(x)
    pmf = np.zeros(cap)
    for k in range(cap - 1):  # N = k -> R = k + 1
        pois = np.exp(k * x - lam - math.lgamma(k + 1))
        f = density * pois
        pmf[k] = (x[1] - x[0]) * (f.sum() - 0.5 * (f[0] + f[-1]))
    pmf[cap - 1] = 1.0 - pmf[: cap - 1].sum()
    return pmf


# ---------------------------------------------------------------------------------------------
# 5. PLN pmf
# ---------------------------------------------------------------------------------------------
def test_paper_table_is_a_pmf_with_mean_5():
    assert PAPER_PLN5.shape == (64,)
    assert abs(PAPER_PLN5.sum() - 1) < 1e-12
    assert abs(np.dot(R, PAPER_PLN5) - 5) < 1e-10


def test_pln5_matches_paper_table():
    p = pln_pmf(5.0)
    assert p.shape == (64,)
    np.testing.assert_allclose(p, PAPER_PLN5, rtol=0, atol=1e-12)
    assert abs(p.sum() - 1) < 1e-12
    assert abs(np.dot(R, p) - 5) < 1e-10
    assert (p > 0).all()


def test_calibrated_mu_for_target_5():
    assert abs(calibrate_mu(5.0) - 1.26129) < 1e-5


@pytest.mark.parametrize("target", [2.0, 3.0, 10.0, 20.0])
def test_other_targets_have_requested_mean(target):
    p = pln_pmf(target)
    assert abs(p.sum() - 1) < 1e-12
    assert (p >= 0).all()
    assert abs(np.dot(R, p) - target) < 1e-9


@pytest.mark.parametrize("mu,atol", [(0.3, 1e-10), (1.26129, 1e-10), (2.5, 1e-6)])
def test_gauss_hermite_matches_independent_quadrature(mu, atol):
    # 64-node Gauss-Hermite (design §3) is exact to ~1e-12 near the PLN-5 mu; at larger mu the
    # Poisson factor is sharply peaked in ln(lambda) and its quadrature error grows (~6e-8 at 2.5).
    np.testing.assert_allclose(pln_pmf_given_mu(mu), trapezoid_pln_pmf(mu), rtol=0, atol=atol)


def test_small_cap_puts_tail_mass_in_last_bucket():
    mu = 1.0
    full = pln_pmf_given_mu(mu, cap=64)
    capped = pln_pmf_given_mu(mu, cap=6)
    np.testing.assert_allclose(capped[:5], full[:5], rtol=0, atol=1e-14)
    assert abs(capped[5] - full[5:].sum()) < 1e-12


def test_calibrate_mu_rejects_impossible_targets():
    for target in (1.0, 0.5, 64.0, 100.0):
        with pytest.raises(ValueError):
            calibrate_mu(target)


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


@pytest.mark.parametrize("cfg", [
    DepthConfig(sampler="pln", depth=5.0, seed=5),
    DepthConfig(sampler="uniform", low=1, high=12, seed=5),
    DepthConfig(sampler="fixed", depth=4, seed=5),
])
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


@pytest.mark.parametrize("cfg", [
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
])
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
