"""`DepthRule`: how many recurrences a decode runs, the one place its settings are named and checked.

A decode runs each prompt token at `prefill_depth` recurrences (R_pre; default: `depth`) and each
decoded token at `depth` (R_dec), or fewer with an exit rule: `exit_tau` stops a decoded token once
its relative state change falls below it (after `min_depth` recurrences; design §13), `exit_gate`
reads each token's logits at the first recurrence whose cumulative exit probability reaches it (a
model with a learned exit gate; design §14). The CLI, the HTTP API, the serving engine's `Request`,
`generate`, the Transformers wrapper and the vLLM plugin all carry one `DepthRule` and check it
with `check`, so a setting is refused with the same message wherever it was given.

What the rule means on its own (an exit threshold's range, one exit rule at a time) is checked when
it is made; what depends on the model and the cache (the depth range, the terminal cache of
adaptive exit, a model with an exit gate) by `check`. Every depth range of the library is checked
by `check_depth` (defined in `looplm.config`, beside the model's max_depth, so that every layer and
the standard-library-only configs can use it; re-exported here).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from looplm.config import check_depth
from looplm.errors import UserError
from looplm.model.exits import DepthPlan

__all__ = ["CACHE_KINDS", "CacheKind", "DepthRule", "check_depth", "check_exit_gate"]

CacheKind = Literal["terminal", "full"]
CACHE_KINDS: tuple[str, ...] = ("terminal", "full")


def check_exit_gate(gate: float | None, exit_tau: float | None, name: str = "exit_gate") -> None:
    """UserError with a one-line reason unless the exit gate's threshold `gate` (spelled `name`, as the
    caller's user wrote it) is unset or a probability in [0, 1], and not given with `exit_tau` (one exit
    rule at a time)."""
    if gate is not None and not 0 <= gate <= 1:
        raise UserError(f"{name} must be a probability in [0, 1] or unset, got {gate}")
    if gate is not None and exit_tau is not None:
        raise UserError(f"choose one exit rule: {name} (the model's gate) or exit_tau (state change)")


@dataclass(frozen=True)
class DepthRule:
    """The recurrences of one decode: prompt tokens at `prefill_depth`, decoded tokens at `depth` or
    fewer by an exit rule (see the module docstring)."""

    depth: int
    """Recurrences per decoded token (R_dec)."""
    prefill_depth: int | None = None
    """Recurrences over the prompt (R_pre); default: depth."""
    exit_tau: float | None = None
    """Adaptive decode depth: stop a token's recurrence once its relative state change < exit_tau (terminal cache)."""
    min_depth: int = 1
    """Adaptive decode depth: fewest recurrences per decoded token."""
    exit_gate: float | None = None
    """The model's learned exit gate (Ouro): each token's logits come from the first recurrence whose
    cumulative exit probability reaches this threshold (every recurrence still runs; design §14)."""

    def __post_init__(self) -> None:
        """Raise UserError with a one-line reason for an exit rule that no model could run."""
        if self.exit_tau is not None and not self.exit_tau > 0:
            raise UserError(f"exit_tau must be > 0 (adaptive depth) or unset, got {self.exit_tau}")
        if isinstance(self.min_depth, bool) or not isinstance(self.min_depth, numbers.Integral) or self.min_depth < 1:
            raise UserError(f"min_depth must be an integer >= 1, got {self.min_depth!r}")
        check_exit_gate(self.exit_gate, self.exit_tau)

    @property
    def prefill(self) -> int:
        """The prompt's recurrences, R_pre."""
        return self.depth if self.prefill_depth is None else self.prefill_depth

    @property
    def deepest(self) -> int:
        """The most recurrences any token runs (what a full cache keeps banks for)."""
        return max(self.depth, self.prefill)

    def check(
        self,
        max_depth: int,
        *,
        cache: str = "terminal",
        has_gate: bool = False,
        what: str | None = None,
        spelling: Mapping[str, str] | None = None,
    ) -> DepthRule:
        """Raise UserError with a one-line reason if this rule cannot run on a model whose deepest
        allowed depth is `max_depth` with a KV cache of kind `cache` (terminal or full); `has_gate`:
        the model has an exit gate. `what` says what sets `max_depth` (the server's --max-depth, ...);
        `spelling` maps `depth`, `prefill_depth`, `cache` and `exit_gate` to the names the caller's user wrote them
        with (a Transformers config's `num_steps`, `prefill_steps`, `cache_kind`,
        `exit_gate_threshold`). Returns self."""
        name = (spelling or {}).get
        if cache not in CACHE_KINDS:
            raise UserError(f"unknown {name('cache', 'cache mode')} {cache!r}; choose terminal or full")
        check_depth(name("depth", "depth"), self.depth, max_depth, what)
        if self.prefill_depth is not None:
            check_depth(name("prefill_depth", "prefill_depth"), self.prefill_depth, max_depth, what)
        if self.min_depth > self.depth:  # refused with or without exit_tau, wherever it was given
            raise UserError(f"min_depth {self.min_depth} exceeds the decode depth {self.depth}")
        if self.exit_tau is not None and cache != "terminal":
            raise UserError("adaptive depth (exit_tau) needs the terminal cache")
        if self.exit_gate is not None and not has_gate:
            raise UserError(f"{name('exit_gate', 'exit_gate')} needs a model with an exit gate (cfg.exit_gate)")
        return self

    def decode_plan(self) -> DepthPlan:
        """The plan of a decode step (a `LoopedLM` forward over decoded tokens)."""
        return DepthPlan(self.depth, self.exit_tau, self.min_depth, self.exit_gate)

    def prefill_plan(self, depth: int | None = None) -> DepthPlan:
        """The prompt's plan at `depth` (default R_pre): the gate applies, adaptive exit does not."""
        return DepthPlan(self.prefill if depth is None else depth, exit_gate=self.exit_gate)
