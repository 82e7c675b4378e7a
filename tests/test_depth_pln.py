"""The capped Poisson-lognormal depth prior (design §3) against the paper's PLN-5 table and an independent
trapezoid-rule integral of the Poisson-lognormal."""

from __future__ import annotations

import math

import numpy as np
import pytest

from looplm.depth import calibrate_mu, pln_pmf
from looplm.depth.pln import pln_pmf_given_mu

# The paper's PLN-5 pmf over R = 1..64 (the paper's table, copied verbatim; design appendix).
PAPER_PLN5 = np.array(
    [
        0.05768747546482591,
        0.1271367387177668,
        0.1634086392890813,
        0.1619074983340164,
        0.13796282734225382,
        0.10698272319110169,
        0.07804764707860895,
        0.05470693907876852,
        0.037361700976777726,
        0.025099433949814245,
        0.016697717702268286,
        0.011052629620047851,
        0.007304055652903804,
        0.004830737772361538,
        0.003203151771039994,
        0.002132081017445029,
        0.0014258721987138567,
        0.0009586921076838706,
        0.0006483099746274615,
        0.0004410716241755722,
        0.000301944551073642,
        0.00020800269392146997,
        0.00014419125207641085,
        0.00010058218331207551,
        7.059667258419262e-05,
        4.9852412062464184e-05,
        3.5414136427653425e-05,
        2.5304622107571485e-05,
        1.8184285152127846e-05,
        1.3140259666362847e-05,
        9.546846563012203e-06,
        6.972695919262932e-06,
        5.118738343708846e-06,
        3.7764502416124336e-06,
        2.7996353510214844e-06,
        2.085238462098128e-06,
        1.5602277964955316e-06,
        1.1725776685897305e-06,
        8.850369680325107e-07,
        6.708005361757733e-07,
        5.104868279453078e-07,
        3.900165388933937e-07,
        2.9911563900765575e-07,
        2.3025345865338855e-07,
        1.778857064050211e-07,
        1.3791253597731962e-07,
        1.0728910765229482e-07,
        8.3744719506e-08,
        6.557941898380174e-08,
        5.151599353655518e-08,
        4.059163481228815e-08,
        3.207815872458309e-08,
        2.5422939995903076e-08,
        2.020502320279681e-08,
        1.6102459981160398e-08,
        1.286800205515741e-08,
        1.0311018925701726e-08,
        8.284031836490163e-09,
        6.672645135115369e-09,
        5.387960542342231e-09,
        4.3608027065798596e-09,
        3.5372756494056925e-09,
        2.8753142244955275e-09,
        1.3322268843651841e-08,
    ]
)

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


# 1.5: the cap bucket's remainder 1 - sum(body) rounds to -2e-16 there (a negative probability that
# `rng.choice` refuses) unless clamped at 0; 60: a mean near the cap needs mu above ln(cap), so the
# bisection's bracket must reach past it.
@pytest.mark.parametrize("target", [1.5, 2.0, 3.0, 10.0, 20.0, 60.0])
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


@pytest.mark.parametrize("sigma", [float("nan"), -0.5, float("inf")])
def test_bad_sigma_is_refused(sigma):
    # NaN gave a NaN pmf (an error only at the first draw of a training run); -0.5 ran as 0.5
    with pytest.raises(ValueError, match="PLN sigma"):
        pln_pmf(5.0, sigma)


@pytest.mark.parametrize("target,cap", [(5.0, 8), (3.0, 4), (7.5, 16)])
def test_a_small_cap_is_calibrated_for_its_own_cap(target, cap):
    """mu is calibrated for the capped pmf the sampler uses (not for cap 64): E[R] is the target at
    any cap, and the pmf covers depths 1..cap."""
    p = pln_pmf(target, cap=cap)
    assert p.shape == (cap,) and abs(p.sum() - 1) < 1e-12 and (p >= 0).all()
    assert abs(np.dot(np.arange(1, cap + 1), p) - target) < 1e-9


def test_sigma_zero_is_the_capped_poisson():
    """sigma = 0 (a fixed lambda) is a valid PLN: the capped shifted Poisson, whose mean 1 + lambda
    (up to the cap's negligible tail) fixes lambda = target - 1."""
    lam = 4.0
    want = np.array([math.exp(k * math.log(lam) - lam - math.lgamma(k + 1)) for k in range(63)])
    p = pln_pmf(5.0, 0.0)
    np.testing.assert_allclose(p[:63], want, rtol=1e-9, atol=1e-15)
    assert abs(p[63] - (1 - want.sum())) < 1e-12


def trapezoid_log_pln_pmf(mu: float, sigma: float, cap: int, n: int = 40001) -> np.ndarray:
    """log of the capped PLN pmf by a dense trapezoid rule over ln(lambda), each term in log space, the cap
    bucket integrating scipy's Poisson survival function P(N >= cap - 1) (not 1 minus the other depths)."""
    from scipy.stats import poisson

    x = np.linspace(mu - 12 * sigma, mu + 12 * sigma, n)
    log_density = -0.5 * ((x - mu) / sigma) ** 2 - math.log(sigma * math.sqrt(2 * math.pi))
    out = np.empty(cap)
    for k in range(cap):
        terms = log_density + (poisson.logpmf(k, np.exp(x)) if k < cap - 1 else poisson.logsf(cap - 2, np.exp(x)))
        top = terms.max()
        out[k] = top + math.log((x[1] - x[0]) * np.exp(terms - top).sum())
    return out


@pytest.mark.parametrize(("target", "cap"), [(2.0, 96), (5.0, 64), (5.0, 256), (1.5, 64)])
def test_no_depth_gets_probability_zero_and_the_cap_bucket_is_the_poisson_tail(target, cap):
    """The cap bucket was 1 minus the other depths, which is 0 (cancellation) once the true tail is below
    ~1e-16 (3e-20 at target 2, cap 96): a learned prior started from log(pmf) then never drew depth = cap.
    Depths far in the tail underflowed to 0 the same way. Now every depth's log-probability is finite, the
    cap bucket is the Poisson tail's integral, and the pmf is unchanged where it is not tiny."""
    pytest.importorskip("scipy")
    from looplm.depth.learned import initial_logits
    from looplm.depth.pln import pln_log_pmf

    mu = calibrate_mu(target, 0.5, cap)
    got, ref = pln_log_pmf(target, 0.5, cap), trapezoid_log_pln_pmf(mu, 0.5, cap)
    assert np.isfinite(got).all() and np.isfinite(initial_logits("pln", cap, target, 0.5, 1, cap)).all()
    assert abs(got[-1] - ref[-1]) < 0.02 * max(1.0, abs(ref[-1])), (got[-1], ref[-1])
    np.testing.assert_allclose(np.exp(got), np.exp(ref), rtol=0, atol=1e-11)  # the two quadratures' agreement
    np.testing.assert_allclose(np.exp(got), pln_pmf(target, 0.5, cap), rtol=1e-12, atol=0)
