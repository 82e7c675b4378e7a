"""How many recurrences each token runs in a forward: a fixed depth, per-row depths, adaptive exit
by state change (design §13, beyond the paper) or the model's learned exit gate (design §14).

A `DepthPlan` states the rule of one forward and `Exits` applies it inside the recurrence loop of
`LoopedLM.forward`; its depths are checked by `looplm.config.check_depth`, the one depth-range check
of the library.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from looplm.config import check_depth


def relative_change(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Token-wise relative state change |new - old| / |old| over the last dimension, in fp32 or wider:
    the quantity adaptive exit compares with exit_tau (design §13) and the analyses call delta_t^r
    (design §11). A zero `old` gives a huge change (0 when `new` is zero too), never a division by zero."""
    dtype = torch.promote_types(new.dtype, torch.float32)
    new, old = new.to(dtype), old.to(dtype)
    return (new - old).norm(dim=-1) / old.norm(dim=-1).clamp_min(1e-30)


def _per_row(value, B: int, device, dtype) -> torch.Tensor:
    """A scalar or per-row [B] setting as a [B, 1] tensor (broadcast over a chunk's tokens)."""
    t = torch.as_tensor(value, device=device, dtype=dtype)
    return (t.expand(B) if t.ndim == 0 else t).reshape(B, 1)


@dataclass(frozen=True)
class DepthPlan:
    """The recurrences of one forward.

    `depth`: the number of recurrences, or each row's [B] (continuous batching). With `exit_tau`,
    `depth` is the largest depth and a token stops recurring once r >= `min_depth` and its relative
    state change |s^r - s^(r-1)| / |s^(r-1)| < exit_tau; `exit_tau` and `min_depth` may be per row
    [B] (a row's exit_tau of 0 never exits). A stopped token's state is frozen and the K/V of its
    last recurrence become its terminal K/V (the terminal cache). `exit_gate` q (a model with
    `cfg.exit_gate`; Ouro's threshold exit): every recurrence runs and each token's coda reads the
    state of the first recurrence whose cumulative exit probability reaches q (else the last).
    """

    depth: int | torch.Tensor
    exit_tau: float | torch.Tensor | None = None
    min_depth: int | torch.Tensor = 1
    exit_gate: float | None = None

    @property
    def per_row(self) -> bool:
        return isinstance(self.depth, torch.Tensor)

    @property
    def adaptive(self) -> bool:
        return self.exit_tau is not None

    @property
    def largest(self) -> int:
        return int(self.depth.max()) if self.per_row else int(self.depth)

    @property
    def freezes(self) -> bool:
        """Tokens may stop before the loop's last recurrence (their state is then frozen)."""
        return self.adaptive or self.per_row

    def check(self, max_depth: int, *, has_gate: bool, cache: str | None) -> None:
        """Raise ValueError with a one-line reason for a plan this model or cache kind (`cache`) cannot run."""
        if not self.per_row:
            check_depth("depth", self.depth, max_depth)
        else:
            _integer_rows("depths", self.depth)
            low = int(self.depth.min())
            check_depth("depth", low if low < 1 else self.largest, max_depth)
        if self.adaptive:
            if cache != "terminal":
                raise ValueError(
                    "adaptive depth (exit_tau) needs the terminal cache (a full cache would miss the skipped visits)"
                )
            tensors = isinstance(self.exit_tau, torch.Tensor) or isinstance(self.min_depth, torch.Tensor)
            if not tensors and (not self.exit_tau > 0 or not 1 <= self.min_depth <= self.largest):
                raise ValueError(
                    f"adaptive depth needs exit_tau > 0 and 1 <= min_depth <= depth, "
                    f"got exit_tau={self.exit_tau}, min_depth={self.min_depth}"
                )
            if isinstance(self.min_depth, torch.Tensor):
                _integer_rows("min_depth", self.min_depth)
            else:
                check_depth("min_depth", self.min_depth, self.largest)
        if self.exit_gate is not None:
            if not has_gate:
                raise ValueError("exit_gate needs a model with an exit gate (cfg.exit_gate)")
            if self.adaptive or self.per_row:
                raise ValueError("exit_gate needs one fixed depth and no exit_tau")
            if not 0 <= self.exit_gate <= 1:
                raise ValueError(f"exit_gate must be a probability threshold in [0, 1], got {self.exit_gate}")


def _integer_rows(name: str, values: torch.Tensor) -> None:
    """ValueError unless the per-row `values` [B] are integers (a fractional depth would be truncated)."""
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise ValueError(f"per-row {name} must be an integer tensor, got {values.dtype}")


class Exits:
    """The per-token bookkeeping of a plan whose tokens may stop early: which tokens are still
    recurring (`active` [B, n]) and how many recurrences each used (`used` [B, n])."""

    def __init__(self, plan: DepthPlan, B: int, n: int, device):
        self.plan = plan
        self.limit = _per_row(plan.depth, B, device, torch.long)  # [B, 1] each row's largest depth
        self.tau = _per_row(plan.exit_tau if plan.adaptive else 0.0, B, device, torch.float32)
        self.floor = _per_row(plan.min_depth, B, device, torch.long)
        self.used = self.limit.expand(B, n).clone()
        self.active = torch.ones(B, n, dtype=torch.bool, device=device)

    def after(self, r: int, s: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """After 0-based recurrence r took `prev` to `s`: freeze the stopped tokens' states, mark
        the tokens that stop now. Returns the state to carry on with."""
        s = torch.where(self.active[..., None], s, prev)
        stop = self.active & (r + 1 >= self.limit)
        if self.plan.adaptive:
            change = relative_change(s, prev)
            stop |= self.active & (change < self.tau) & (r + 1 >= self.floor)
        self.used[stop] = r + 1
        self.active = self.active & ~stop  # a new tensor: the torch.where above keeps this one for backward
        return s

    def compact(self) -> torch.Tensor | None:
        """The rows [b] still recurring when some (not all) rows of a one-token step stopped, else None."""
        active = self.active[:, 0]
        n_active = int(active.sum())
        return None if n_active in (0, active.numel()) else active.nonzero()[:, 0]

    @property
    def done(self) -> bool:
        return not bool(self.active.any())
