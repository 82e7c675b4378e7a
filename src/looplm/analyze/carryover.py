"""Carryover alignment at the endpoint (design §2, 11).

Every injection but DEQ-QKV enters a recurrence as s' = carryover(s, q) + q (model/injection.py):
for Parcae the carryover is Lambda s (per-channel decay), for OrthoInj the decayed state with its
component along q removed, for Huginn-Linear A_s s, for the additive baseline s itself. At the
endpoint s*, cos(carryover, q) and the amplification 1 + <carryover, q> / |q|^2 (the component of s'
along q, in units of q) say how much the state re-injects the input (paper: Parcae cos 0.81-0.91,
amplification 2.2-3.4x; OrthoInj exactly 1 by construction).
"""

from __future__ import annotations

import torch

from looplm.model.injection import DeqQKV, NoInjection


def carryover_alignment(injection, endpoint: torch.Tensor, injected: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Per-token {"cos", "amplification"} [B, L] in fp64 at state `endpoint` with injected input q;
    None for DEQ-QKV, which has no core-entrance injection, and for no injection at all (Ouro: the
    input enters only through s0, so there is no injected input to align with)."""
    if isinstance(injection, (DeqQKV, NoInjection)):
        return None
    c = injection.carryover(endpoint, injected).double()
    q = injected.double()
    cq, qq = (c * q).sum(-1), q.square().sum(-1)
    return {
        "cos": cq / (c.norm(dim=-1) * q.norm(dim=-1)).clamp_min(1e-300),
        "amplification": 1.0 + cq / qq.clamp_min(1e-300),
    }


def summarize(values: torch.Tensor) -> dict[str, float]:
    """{"mean", "median", "q10", "q90", "min", "max"} of a tensor of per-token values."""
    v = values.flatten().double()
    q = torch.quantile(v, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64, device=v.device))
    return {
        "mean": float(v.mean()),
        "median": float(q[1]),
        "q10": float(q[0]),
        "q90": float(q[2]),
        "min": float(v.min()),
        "max": float(v.max()),
    }
