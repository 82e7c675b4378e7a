"""Warmup-stable-decay learning-rate multiplier (design §6)."""

from __future__ import annotations

import math


def wsd_multiplier(step: int, total: int, warmup_frac: float = 0.05, decay_frac: float = 0.1) -> float:
    """Multiplier of update t (0-based) of T: linear warmup from 1e-4 (update 0) towards 1 over the
    first W = T*warmup_frac updates, 1 until update T - D (D = T*decay_frac), then cosine decay over
    the last D updates, 0.1 + 0.45 (1 + cos(pi (t - T + D + 1) / D)), so that the last update, T - 1,
    trains at 0.1 (evaluated at t - T + D, the decay's last update trained above the floor and a decay
    of one update not at all). A fraction above 0 takes at least one update; a fraction of 0 none (no
    warmup, or no decay). Past T the multiplier stays at 0.1."""
    W = max(1, round(total * warmup_frac)) if warmup_frac > 0 else 0
    D = max(1, round(total * decay_frac)) if decay_frac > 0 else 0
    if step < W:
        return 1e-4 + (1.0 - 1e-4) * step / W
    if D == 0 or step < total - D:
        return 1.0
    frac = min(1.0, (step - total + D + 1) / D)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * frac))
