"""Capped Poisson-lognormal (PLN) depth prior (design §3).

R = min(cap, 1 + N), N ~ Poisson(lambda), ln lambda ~ N(mu, sigma^2). The pmf integrates the
Poisson pmf over ln lambda with 64-node Gauss-Hermite quadrature; the cap bucket takes the
remaining mass. mu is calibrated by bisection so that E[R] equals the target.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from looplm.errors import UserError

GH_NODES = 64


def pln_pmf_given_mu(mu: float, sigma: float = 0.5, cap: int = 64) -> np.ndarray:
    """pmf over R = 1..cap (index r-1) for a given mu."""
    if not (math.isfinite(sigma) and sigma >= 0):
        raise UserError(f"PLN sigma (the standard deviation of ln lambda) must be a finite number >= 0, got {sigma}")
    x, w = np.polynomial.hermite.hermgauss(GH_NODES)
    lam = np.exp(mu + math.sqrt(2.0) * sigma * x)  # ln lambda = mu + sqrt(2) sigma x
    weights = w / math.sqrt(math.pi)
    n = np.arange(cap - 1, dtype=np.float64)  # N = 0..cap-2 give R = 1..cap-1
    log_fact = np.array([math.lgamma(k + 1.0) for k in n])
    log_pois = n[None, :] * np.log(lam)[:, None] - lam[:, None] - log_fact[None, :]
    body = weights @ np.exp(log_pois)
    pmf = np.empty(cap, dtype=np.float64)
    pmf[: cap - 1] = body
    pmf[cap - 1] = max(0.0, 1.0 - body.sum())  # the cap bucket takes the remaining mass
    return pmf


def pmf_mean(pmf: np.ndarray) -> float:
    return float(np.dot(np.arange(1, len(pmf) + 1), pmf))


@lru_cache(maxsize=64)
def calibrate_mu(target: float, sigma: float = 0.5, cap: int = 64) -> float:
    """mu such that E[min(cap, 1+N)] = target, by bisection (the mean is increasing in mu)."""
    if not 1.0 < target < cap:
        raise UserError(f"PLN target mean must lie in (1, {cap}), got {target}")
    lo, hi = -20.0, math.log(cap) + 10.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if pmf_mean(pln_pmf_given_mu(mid, sigma, cap)) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-15:
            break
    return 0.5 * (lo + hi)


def pln_pmf(target: float = 5.0, sigma: float = 0.5, cap: int = 64) -> np.ndarray:
    """The capped PLN-`target` pmf over R = 1..cap."""
    return pln_pmf_given_mu(calibrate_mu(target, sigma, cap), sigma, cap)
