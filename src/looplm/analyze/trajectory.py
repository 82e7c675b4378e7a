"""Recurrent trajectories past the trained depth: per-recurrence state change and core K/V (design §11).

The model's own pieces are reused (prelude, context, recurrence with `return_kv`); the recurrence
is called directly, so a trajectory may run beyond `max_depth` (the cap applies to `forward`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from looplm.errors import UserError
from looplm.model.exits import relative_change
from looplm.model.looped import Context
from looplm.model.state import StateInit, StateStart


@dataclass
class Start:
    """What every recurrence of one batch shares: the context and the initial state."""

    ctx: Context
    state0: torch.Tensor
    """s^0 [B, L, d] (evaluation-time seeded initialisation unless asked otherwise)."""
    positions: torch.Tensor
    """RoPE positions [B, L] (document-local for packed rows)."""


@torch.no_grad()
def start(
    model,
    tokens: torch.Tensor,
    *,
    doc_ids: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    example_ids: torch.Tensor | None = None,
    init: StateInit = "seeded",
    seed: int = 0,
) -> Start:
    """The prelude, context and s^0 of `LoopedLM.forward` (evaluation-time seeded state by default)."""
    if positions is None:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape)
    ctx, s0 = model.begin(
        tokens, StateStart(init, example_ids=example_ids, seed=seed), doc_ids=doc_ids, positions=positions
    )
    return Start(ctx, s0, positions)


@dataclass
class Trajectory:
    """Quantities recorded along s^0 -> s^1 -> ... -> s^steps."""

    change: torch.Tensor
    """delta^r for r = 1..horizon: |s^r - s^(r-1)| / |s^(r-1)| per token, [horizon, B, L]."""
    endpoint: torch.Tensor
    """s^horizon [B, L, d]."""
    kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    """recurrence r -> per core layer (K, V) [B, H_kv, L, hd] computed during recurrence r."""


@torch.no_grad()
def run_trajectory(
    model, begin: Start, horizon: int, *, kv_at: tuple[int, ...] = (), on_step: Callable[[int], None] | None = None
) -> Trajectory:
    """Iterate the recurrence max(horizon, max(kv_at)) times from `begin.state0`; record the
    token-wise relative change up to `horizon`, the state at `horizon` and the core K/V at `kv_at`."""
    if horizon < 1:
        raise UserError(f"horizon must be >= 1, got {horizon}")
    steps = max(horizon, *kv_at) if kv_at else horizon
    want = set(kv_at)
    s = begin.state0
    changes, endpoint, kv = [], None, {}
    for r in range(1, steps + 1):
        new, kvs = model.recurrence(s, begin.ctx, return_kv=True)
        if r <= horizon:
            changes.append(relative_change(new, s))
        if r == horizon:
            endpoint = new
        if r in want:
            kv[r] = kvs
        s = new
        if on_step is not None:
            on_step(r)
    return Trajectory(torch.stack(changes), endpoint, kv)
