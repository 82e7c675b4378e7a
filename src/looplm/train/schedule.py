"""Warmup-stable-decay learning-rate multiplier (design §6)."""

from __future__ import annotations

import math


def wsd_multiplier(step: int, total: int, warmup_frac: float = 0.05, decay_frac: float = 0.1) -> float:
    """Multiplier at step t of T: linear warmup from 1e-4 to 1 over W = T*warmup_frac, 1 until
    T - D (D = T*decay_frac), then 0.1 + 0.45 (1 + cos(pi (t - T + D) / D)). A fraction above 0 takes at
    least one step; a fraction of 0 none (no warmup, or no decay)."""
    W = max(1, round(total * warmup_frac)) if warmup_frac > 0 else 0
    D = max(1, round(total * decay_frac)) if decay_frac > 0 else 0
    if step < W:
        return 1e-4 + (1.0 - 1e-4) * step / W
    if D == 0 or step < total - D:
        return 1.0
    frac = min(1.0, (step - total + D) / D)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * frac))
