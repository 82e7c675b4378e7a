"""Fixed-point solves: joint iteration vs current-token iteration against a frozen prefix (design §11, A.1).

A span is P prefix tokens and one current token. Three solves start from the evaluation-time seeded
state: prefix-only (the P tokens iterate together), joint (all P + 1 tokens iterate together) and
frozen-prefix (only the current token iterates; each core layer attends to the prefix's K/V from
the prefix solve's endpoint and recomputes the current token's own K/V). At a fixed point of a
causal model the joint and frozen-prefix endpoints coincide (Lemma 1), so their relative state gap
and prediction KL measure how exact terminal-KV sharing is at equilibrium. The depth-R control
freezes the prefix after R plain recurrences instead (terminal KV at depth R) and solves the
current token against it: its gap shows what the lemma needs a converged prefix for.

Every solve runs in fp32 with the math attention kernel and stops at `SolveRule.max_depth`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from looplm.analyze.trajectory import Start, relative_change, start
from looplm.errors import UserError
from looplm.model.kv import KVBank
from looplm.model.looped import Context

Step = Callable[[torch.Tensor], tuple[torch.Tensor, list]]
"""One recurrence: state [B, L, d] -> (next state, per core layer (K, V) [B, H_kv, L, hd])."""


@dataclass
class SolveRule:
    """When a solve counts as converged (design §11): the max per-token relative state change and the
    per-layer relative K/V change (over the row's iterated tokens) stay <= `tol` for `stable_steps`
    consecutive recurrences; then for `confirm_steps` recurrences the state drifts at most
    `drift_tol` (per token, relative) from where the stable run ended; then one more recurrence
    changes it by at most `tol`. A failed confirmation or final check starts the search again.
    Cycles never pass."""

    max_depth: int = 1024
    """Largest number of recurrences a solve may run."""
    tol: float = 1e-5
    """Per-step relative change bound (state and K/V)."""
    stable_steps: int = 8
    """Consecutive steps the change must stay within `tol`."""
    confirm_steps: int = 16
    """Confirmation steps after the stable run."""
    drift_tol: float = 5e-5
    """Largest relative drift from the stable run's endpoint during confirmation."""

    def validate(self) -> None:
        if not (self.tol > 0 and self.drift_tol > 0):  # NaN too: no step would ever qualify
            raise UserError(f"solve tolerances must be > 0, got tol={self.tol}, drift_tol={self.drift_tol}")
        if self.stable_steps < 1 or self.confirm_steps < 0:
            raise UserError("solve stable_steps must be >= 1 and confirm_steps >= 0")
        if self.max_depth < self.stable_steps + self.confirm_steps + 2:  # the first step never counts as stable
            raise UserError(
                f"solve max_depth {self.max_depth} leaves no room for the first step (no earlier K/V to "
                f"compare), {self.stable_steps} stable, {self.confirm_steps} confirmation and 1 final step"
            )


@dataclass
class Solve:
    """Per-row outcome of `solve` on a batch of B rows."""

    qualified: torch.Tensor
    """[B] bool: the row passed the rule."""
    depth: torch.Tensor
    """[B] int64: recurrences until the stable run that went on to qualify was complete (-1: none)."""
    state: torch.Tensor
    """[B, L, d]: the endpoint (after the final check; the last state for rows that did not qualify)."""
    kv: list
    """Per core layer (K, V) computed by the endpoint's recurrence."""
    steps: int
    """Recurrences run (the batch stops when every row qualified, or at max_depth)."""


def _row_max(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1).amax(1)


def solve(step: Step, state0: torch.Tensor, rule: SolveRule, on_step: Callable[[int], None] | None = None) -> Solve:
    """Iterate `step` from `state0` [B, L, d] under `rule`, tracking each row separately."""
    rule.validate()
    B = state0.shape[0]
    dev = state0.device
    SEARCH, CONFIRM, FINAL, DONE = 0, 1, 2, 3
    phase = torch.full((B,), SEARCH, dtype=torch.long, device=dev)
    streak = torch.zeros(B, dtype=torch.long, device=dev)
    confirmed = torch.zeros(B, dtype=torch.long, device=dev)
    depth = torch.full((B,), -1, dtype=torch.long, device=dev)
    s, anchor = state0, state0.clone()
    endpoint, endpoint_kv, last_kv = state0, None, None
    steps = 0
    for r in range(1, rule.max_depth + 1):
        new, kvs = step(s)
        steps = r
        change = _row_max(relative_change(new, s))
        if last_kv is None:
            change = torch.full_like(change, float("inf"))  # no earlier K/V to compare with yet
        else:
            for (k, v), (k0, v0) in zip(kvs, last_kv):
                change = torch.maximum(change, relative_change(k.flatten(1), k0.flatten(1)))  # per layer
                change = torch.maximum(change, relative_change(v.flatten(1), v0.flatten(1)))
        small = change <= rule.tol
        before = phase.clone()
        drift = _row_max(relative_change(new, anchor))

        search = before == SEARCH
        streak = torch.where(search, torch.where(small, streak + 1, 0), streak)
        begin = search & (streak >= rule.stable_steps)
        confirm = before == CONFIRM
        drift_ok = confirm & (drift <= rule.drift_tol)
        confirmed = torch.where(begin, 0, torch.where(drift_ok, confirmed + 1, confirmed))
        final = before == FINAL
        passed = final & small
        restart = (confirm & ~drift_ok) | (final & ~small)

        phase = torch.where(begin, FINAL if rule.confirm_steps == 0 else CONFIRM, phase)
        phase = torch.where(drift_ok & (confirmed >= rule.confirm_steps), FINAL, phase)
        phase = torch.where(passed, DONE, phase)
        phase = torch.where(restart, SEARCH, phase)
        streak = torch.where(restart, 0, streak)
        depth = torch.where(begin, r, depth)
        anchor = torch.where(begin[:, None, None], new, anchor)

        # Rows that are done keep their endpoint (and its K/V); the others follow the iteration.
        keep = before == DONE
        endpoint = torch.where(keep[:, None, None], endpoint, new)
        endpoint_kv = (
            list(kvs)
            if endpoint_kv is None
            else [
                tuple(torch.where(keep[:, None, None, None], e, x) for e, x in zip(ekv, kv))
                for ekv, kv in zip(endpoint_kv, kvs)
            ]
        )
        last_kv, s = kvs, new
        if on_step is not None:
            on_step(r)
        if bool((phase == DONE).all()):
            break
    qualified = phase == DONE
    return Solve(qualified, torch.where(qualified, depth, -1), endpoint, endpoint_kv, steps)


# -- spans -----------------------------------------------------------------------------------------
def slice_context(ctx: Context, lo: int, hi: int, mask_keys: int | None = None) -> Context:
    """The context of tokens lo..hi-1 of a span. Queries keep keys 0..`mask_keys`-1 (default: the
    tokens themselves, lo..hi-1 with lo = 0); a missing (plain causal) mask becomes explicit."""
    cos, sin = ctx.rope
    rope = (cos[:, :, lo:hi], sin[:, :, lo:hi])
    if mask_keys is None:
        mask = None if ctx.mask is None else ctx.mask[:, :, lo:hi, lo:hi]
    elif ctx.mask is None:
        mask = torch.ones(hi - lo, mask_keys, dtype=torch.bool, device=cos.device).tril(lo)[None, None]
    else:
        mask = ctx.mask[:, :, lo:hi, :mask_keys]
    offsets = None if ctx.qkv_offsets is None else [tuple(o[:, lo:hi] for o in layer) for layer in ctx.qkv_offsets]
    core = None if ctx.core_values is None else [None if v is None else v[:, lo:hi] for v in ctx.core_values]
    coda = None if ctx.coda_values is None else [None if v is None else v[:, lo:hi] for v in ctx.coda_values]
    return Context(rope, mask, ctx.injected[:, lo:hi], offsets, core, coda)


def frozen_prefix_step(model, begin: Start, prefix_kv: list) -> Step:
    """One recurrence of the span's last token alone: core layer j attends to the frozen prefix
    K/V `prefix_kv[j]` ([B, H_kv, P, hd] each) and to the current token's own, recomputed K/V."""
    L = begin.state0.shape[1]
    c = L - 1
    ctx = slice_context(begin.ctx, c, L, mask_keys=L)
    slots = []
    for k, v in prefix_kv:
        bank = KVBank.of(
            k.new_zeros(k.shape[0], k.shape[1], L, k.shape[3]), v.new_zeros(v.shape[0], v.shape[1], L, v.shape[3])
        )
        bank.k[:, :, :c], bank.v[:, :, :c] = k, v
        slots.append(bank.slot(c))  # attention writes the current token's K/V at c in place
    return lambda s: model.recurrence(s, ctx, return_kv=True, slots=slots)


def prediction_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row of next-token logits [B, V], in fp64."""
    lp, lq = F.log_softmax(p_logits.double(), -1), F.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


@torch.no_grad()
def span_solves(
    model,
    tokens: torch.Tensor,
    *,
    doc_ids: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    example_ids: torch.Tensor | None = None,
    rule: SolveRule = SolveRule(),
    control_depth: int = 5,
    progress: Callable[[str, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Prefix-only, joint and frozen-prefix solves (and the depth-`control_depth` control) for spans
    `tokens` [B, P + 1] whose last token is the current token. Returns per-row tensors:
    qualified flags and depths of each solve, and the relative current-token state gap and
    prediction KL(joint || frozen), for the solves and for the control. `progress(description,
    units)` hears of every 32nd recurrence (0 units) and of each finished solve (1 unit)."""
    if tokens.shape[1] < 2:
        raise UserError("a span needs at least one prefix token and a current token")
    if control_depth < 1:
        raise UserError(f"control depth must be >= 1, got {control_depth}")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise UserError("fixed-point solves run in fp32: load the model in fp32")
    report = progress or (lambda desc, n: None)

    def run(name: str, step: Step, state0: torch.Tensor) -> Solve:
        out = solve(step, state0, rule, lambda r: report(f"solve {name} r={r}", 0) if r % 32 == 0 else None)
        report(f"solve {name}", 1)
        return out

    with sdpa_kernel(SDPBackend.MATH):
        begin = start(model, tokens, doc_ids=doc_ids, positions=positions, example_ids=example_ids)

        def frozen_run(name: str, prefix_kv: list) -> Solve:
            return run(name, frozen_prefix_step(model, begin, prefix_kv), begin.state0[:, -1:])

        L = tokens.shape[1]
        c = L - 1
        # Causal attention: the prelude output, context and s^0 of the prefix are the span's first c rows.
        pre_ctx = slice_context(begin.ctx, 0, c)
        prefix = run("prefix", lambda s: model.recurrence(s, pre_ctx, return_kv=True), begin.state0[:, :c])
        joint = run("joint", lambda s: model.recurrence(s, begin.ctx, return_kv=True), begin.state0)
        frozen = frozen_run("frozen", prefix.kv)
        s = begin.state0[:, :c]
        for _ in range(control_depth):
            s, ctrl_kv = model.recurrence(s, pre_ctx, return_kv=True)
        control = frozen_run("control", ctrl_kv)

        rope, mask = begin.ctx.rope, begin.ctx.mask

        def predict(prefix_state, current_state):
            return model.run_coda(torch.cat([prefix_state, current_state], dim=1), rope, mask, begin.ctx)[:, -1]

        p_joint = model.run_coda(joint.state, rope, mask, begin.ctx)[:, -1]
        p_frozen, p_control = predict(prefix.state, frozen.state), predict(s, control.state)
    cur = joint.state[:, c]
    return {
        "prefix_qualified": prefix.qualified,
        "prefix_depth": prefix.depth,
        "joint_qualified": joint.qualified,
        "joint_depth": joint.depth,
        "frozen_qualified": frozen.qualified,
        "frozen_depth": frozen.depth,
        "control_qualified": control.qualified,
        "gap": relative_change(frozen.state[:, 0], cur),
        "kl": prediction_kl(p_joint, p_frozen),
        "control_gap": relative_change(control.state[:, 0], cur),
        "control_kl": prediction_kl(p_joint, p_control),
    }
