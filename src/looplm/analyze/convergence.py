"""Convergence profile: token-wise convergence depth at tau and how it varies with position (design §11).

delta_t^r = |h_t^r - h_t^(r-1)| / |h_t^(r-1)| is the change made by recurrence r. A token is converged
at depth c, the earliest c in 0..H-1 after which every further recurrence up to the horizon H changes
it by less than tau: delta_t^r < tau for r = c+1..H. A token whose last change delta_t^H is still
>= tau never converged within the horizon (`NEVER`).
"""

from __future__ import annotations

import torch

from looplm.errors import UserError

NEVER = -1
"""Convergence depth of a token that did not converge within the horizon."""


def convergence_depths(change: torch.Tensor, tau: float) -> torch.Tensor:
    """Convergence depth per token (int64, `NEVER` where not converged) from delta [H, ...]."""
    if tau <= 0:
        raise UserError(f"tau must be > 0, got {tau}")
    H = change.shape[0]
    below = (change < tau).flip(0).long()
    trailing = below.cumprod(0).sum(0)  # length of the run of small changes that ends at r = H
    return torch.where(trailing > 0, H - trailing, torch.full_like(trailing, NEVER))


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks of a 1-D tensor, ties sharing their average rank (fp64)."""
    _, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
    last = counts.cumsum(0).double()
    return (last - (counts.double() - 1) / 2)[inverse]


def spearman(x: torch.Tensor, y: torch.Tensor) -> float | None:
    """Spearman rank correlation (Pearson correlation of average ranks); None when undefined."""
    if x.numel() < 2:
        return None
    rx, ry = average_ranks(x.flatten()), average_ranks(y.flatten())
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = (rx.square().sum() * ry.square().sum()).sqrt()
    return None if denom == 0 else float((rx * ry).sum() / denom)


def median_or_none(x: torch.Tensor) -> float | None:
    """The (interpolated) median of a tensor's values; None when it is empty."""
    return float(torch.quantile(x.double(), 0.5)) if x.numel() else None


def convergence_profile(change: torch.Tensor, positions: torch.Tensor, tau: float, interval: int = 128) -> dict:
    """Summary of delta [H, B, L] at tau, with RoPE positions [B, L]:

    histogram (tokens per convergence depth 0..H-1, and `never`), fraction converged, median depth,
    the median depth per `interval`-position bucket, Spearman correlation of position vs depth over
    the converged tokens, and per-recurrence quantiles of delta (the relative-change curve)."""
    if interval < 1:
        raise UserError(f"position interval must be >= 1, got {interval}")
    H = change.shape[0]
    depth = convergence_depths(change, tau).flatten()
    pos = positions.expand(change.shape[1:]).flatten().to(depth.device)
    done = depth != NEVER
    hist = torch.bincount(depth[done], minlength=H)
    buckets = []
    for lo in range(0, int(pos.max()) + 1, interval):
        inside = (pos >= lo) & (pos < lo + interval)
        if inside.any():
            d = depth[inside & done]
            buckets.append(
                {
                    "start": lo,
                    "end": lo + interval,
                    "tokens": int(inside.sum()),
                    "fraction_converged": float(done[inside].float().mean()),
                    "median_depth": median_or_none(d),
                }
            )
    flat = change.flatten(1).double()
    q = torch.quantile(flat, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64, device=flat.device), dim=1)
    return {
        "tau": tau,
        "horizon": H,
        "tokens": int(depth.numel()),
        "fraction_converged": float(done.float().mean()),
        "median_depth": median_or_none(depth[done]),
        "histogram": hist.tolist(),
        "never": int((~done).sum()),
        "intervals": buckets,
        "spearman_position_depth": spearman(pos[done], depth[done]),
        "change": {"q25": q[0].tolist(), "median": q[1].tolist(), "q75": q[2].tolist(), "mean": flat.mean(1).tolist()},
    }
