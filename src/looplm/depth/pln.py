"""Capped Poisson-lognormal (PLN) depth prior (design §3).

R = min(cap, 1 + N), N ~ Poisson(lambda), ln lambda ~ N(mu, sigma^2). The pmf integrates the
Poisson pmf over ln lambda with 64-node Gauss-Hermite quadrature, in log space; the cap bucket takes
the remaining mass (summed as its own series where that mass is too small to be 1 minus the rest). mu is calibrated by bisection so that E[R] equals the target.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from looplm.errors import UserError

GH_NODES = 64


TAIL_TERMS = 512
"""Terms of the Poisson series summed for a node whose cap-bucket mass is below `_SERIES_BELOW`."""
_SERIES_BELOW = 1e-6


def _logsumexp(a: np.ndarray, axis: int) -> np.ndarray:
    top = a.max(axis=axis, keepdims=True)
    return np.squeeze(top, axis) + np.log(np.exp(a - top).sum(axis=axis))


def pln_log_pmf_given_mu(mu: float, sigma: float = 0.5, cap: int = 64) -> np.ndarray:
    """log pmf over R = 1..cap (index r-1) for a given mu, computed in log space so that no depth's
    probability underflows to 0 (a learned prior started from it would never draw that depth)."""
    if not (math.isfinite(sigma) and sigma >= 0):
        raise UserError(f"PLN sigma (the standard deviation of ln lambda) must be a finite number >= 0, got {sigma}")
    x, w = np.polynomial.hermite.hermgauss(GH_NODES)
    log_lam = mu + math.sqrt(2.0) * sigma * x  # ln lambda = mu + sqrt(2) sigma x
    lam = np.exp(log_lam)
    log_w = np.log(w / math.sqrt(math.pi))

    def log_poisson(n: np.ndarray) -> np.ndarray:  # [nodes, len(n)]
        log_fact = np.array([math.lgamma(k + 1.0) for k in n])
        return n[None, :] * log_lam[:, None] - lam[:, None] - log_fact[None, :]

    body = log_poisson(np.arange(cap - 1, dtype=np.float64))  # N = 0..cap-2 give R = 1..cap-1
    # the cap bucket, P(N >= cap-1 | lambda) per node: the mass the body leaves, except where that is
    # cancellation noise (below 1e-6), where the series itself is summed (its terms fall geometrically)
    rest = 1.0 - np.exp(body).sum(axis=1)
    series = _logsumexp(log_poisson(np.arange(cap - 1, cap - 1 + TAIL_TERMS, dtype=np.float64)), axis=1)
    with np.errstate(divide="ignore"):
        tail = np.where(rest > _SERIES_BELOW, np.log(np.maximum(rest, _SERIES_BELOW)), series)
    out = np.empty(cap, dtype=np.float64)
    out[: cap - 1] = _logsumexp(log_w[:, None] + body, axis=0)
    out[cap - 1] = _logsumexp(log_w + tail, axis=0)
    return out


def pln_pmf_given_mu(mu: float, sigma: float = 0.5, cap: int = 64) -> np.ndarray:
    """pmf over R = 1..cap (index r-1) for a given mu."""
    return np.exp(pln_log_pmf_given_mu(mu, sigma, cap))


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


def pln_log_pmf(target: float = 5.0, sigma: float = 0.5, cap: int = 64) -> np.ndarray:
    """log of `pln_pmf`, finite at every depth however small its probability."""
    return pln_log_pmf_given_mu(calibrate_mu(target, sigma, cap), sigma, cap)
