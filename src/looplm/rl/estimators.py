"""Update estimators: how the policy loss of a rollout is scored and backpropagated (design §10, A.2).

- `bptt`: replay all R recurrences with autograd and backpropagate through them (the baseline).
- `recompute`: rerun the R recurrences without autograd to rebuild the endpoints z^R, then the
  one-recurrence Neumann update below.
- `reuse`: the endpoints saved during the rollout (checked: same parameters, same tokens, same
  depth), then the one-recurrence Neumann update. Cost and memory do not depend on R.

The Neumann update at an endpoint z (paper A.2): z_bar = F(stopgrad(z); x) once with autograd over
the whole sequence (its attention reads the K/V this recurrence makes), the coda/head and the loss
on z_bar; g = dl/dz_bar and the direct coda/head gradients c; v <- g, then `steps` times
v <- g + J^T v with J^T v the VJP of z_bar w.r.t. z through the one recorded recurrence; finally
B^T v (injection, core, and the prelude through the injected input) is added to c. Near a fixed
point this is the truncated implicit gradient c + B^T sum_{k<=steps} (J^T)^k g ("Neumann-4" = 4
state products).

The KL penalty's reference log-probabilities (`reference_logits`) are scored along the path the
estimator scores the policy with, so the penalty is exactly 0 while the policy equals the reference
(see that function for the choice made for each estimator).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from looplm.errors import UserError
from looplm.model.blocks import rope_tables
from looplm.rl.rollout import Rollout, SavedStates, check_saved_states

ESTIMATORS = ("bptt", "recompute", "reuse")
Objective = Callable[[torch.Tensor], torch.Tensor]
"""Maps fp32 logits [N, L, V] to the scalar loss."""


def neumann_backward(
    recurrence: Callable[[torch.Tensor], torch.Tensor],
    head: Callable[[torch.Tensor], torch.Tensor],
    endpoint: torch.Tensor,
    steps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate c + B^T v_{steps+1} into the parameters' .grad, v_{k+1} = g + J^T v_k, v_1 = g.

    `recurrence(z)` is one application of F (its parameters may require grad), `head(z_bar)` the
    scalar loss on its output. Returns (loss, z_bar), both detached.
    """
    if steps < 0:
        raise UserError(f"Neumann steps must be >= 0, got {steps}")
    z_in = endpoint.detach().requires_grad_(steps > 0)
    z_bar = recurrence(z_in)
    z_cut = z_bar.detach().requires_grad_(True)  # the head's backward stops here: g and c
    loss = head(z_cut)
    loss.backward()
    g = z_cut.grad
    v = g
    for _ in range(steps):  # v <- g + J^T v through the one recorded recurrence
        (jtv,) = torch.autograd.grad(z_bar, z_in, v, retain_graph=True)
        v = g + jtv
    z_bar.backward(v)  # B^T v into the recurrence's parameters (and the prelude through its input)
    return loss.detach(), z_bar.detach()


def _recurrence_inputs(model, tokens: torch.Tensor):
    """RoPE tables and the per-forward context (prelude output, injected input) of causal rows
    `tokens` [N, L] starting at position 0: what one recurrence F(z; x) and the coda read."""
    B, L = tokens.shape
    positions = torch.arange(L, device=tokens.device).expand(B, L)
    rope = rope_tables(positions, model.cfg.head_dim, model.cfg.rope_base)
    return rope, model.context(model.run_prelude(tokens, rope, None), rope, None, tokens)


def endpoint_backward(model, tokens: torch.Tensor, endpoint: torch.Tensor, objective: Objective, steps: int) -> dict:
    """The one-recurrence Neumann update of `model` at the endpoints [N, L, d] of `tokens` [N, L]
    (causal rows starting at position 0). Returns {"loss", "residual"}: residual is the mean
    relative change |F(z) - z| / |z| over the tokens, a distance from the fixed point."""
    rope, ctx = _recurrence_inputs(model, tokens)
    loss, z_bar = neumann_backward(
        lambda z: model.recurrence(z, ctx), lambda z: objective(model.run_coda(z, rope, None, ctx)), endpoint, steps
    )
    norm = endpoint.float().norm(dim=-1)
    real = norm > 0
    change = (z_bar.float() - endpoint.float()).norm(dim=-1)[real] / norm[real]
    return {"loss": float(loss), "residual": float(change.mean()) if change.numel() else 0.0}


def bptt_backward(model, tokens, example_ids, depth: int, objective: Objective) -> dict:
    """Full BPTT: all R recurrences with autograd, from the same seeded initial states as the rollout."""
    out = model(tokens, depth, init="seeded", example_ids=example_ids)
    loss = objective(out.logits)
    loss.backward()
    return {"loss": float(loss.detach())}


def recompute_endpoints(model, tokens, example_ids, depth: int) -> torch.Tensor:
    """z^R of a native forward without autograd (the recompute baseline's first pass)."""
    with torch.no_grad():
        return model(tokens, depth, init="seeded", example_ids=example_ids, compute_logits=False).endpoint


@torch.no_grad()
def endpoint_logits(model, tokens: torch.Tensor, endpoint: torch.Tensor) -> torch.Tensor:
    """coda(F(z)) without autograd: the fp32 logits [N, L, V] the one-recurrence update scores at the
    endpoints z [N, L, d] of `tokens` (the same operations as `endpoint_backward`'s forward)."""
    rope, ctx = _recurrence_inputs(model, tokens)
    return model.run_coda(model.recurrence(endpoint, ctx), rope, None, ctx)


@torch.no_grad()
def reference_logits(
    estimator: str, reference, policy, rollout: Rollout, *, depth: int, states: SavedStates | None = None
) -> torch.Tensor:
    """The frozen `reference` model's fp32 logits [N, L, V] of `rollout`, scored along the path that
    `score_and_backward(estimator, policy, ...)` scores the policy with (design §10, optional KL).

    The KL penalty compares the two models' log-probabilities of the same actions. Scoring the
    reference along another path than the policy (e.g. its native depth-R forward while reuse scores
    one recurrence from terminal-KV endpoints) adds the gap between the paths to the KL: it is then
    not 0 at the start, where policy == reference, and the penalty pulls the policy towards the other
    path instead of towards the reference. Per estimator:
    - `bptt`: the reference's native forward at depth R, seeded as in the rollout (exact).
    - `recompute`: the reference's own endpoints, rebuilt the same way (native forward at R without
      autograd), then its one recurrence and coda: exactly the reference's distribution on the
      policy's scoring path, for R + 1 no-grad recurrences (about the native forward it replaces).
    - `reuse`: the reference's one recurrence and coda on the policy's saved endpoints (checked
      against `policy` as the update checks them). Its own endpoints on that path would come from
      terminal-KV decoding, i.e. replaying the rollout sequentially with the reference (as costly as
      the rollout); a native forward would cost R recurrences and still be off the terminal-KV path.
      One recurrence keeps reuse's cost independent of R, equals the policy's scored logits exactly
      while the parameters agree, and afterwards differs from the reference's own one-recurrence
      distribution only through the endpoint gap z^R(policy) - z^R(reference), damped by the
      contraction of F near a fixed point.
    """
    tokens, ids = rollout.tokens, rollout.example_ids
    if estimator == "bptt":
        return reference(tokens, depth, init="seeded", example_ids=ids).logits
    if estimator == "recompute":
        return endpoint_logits(reference, tokens, recompute_endpoints(reference, tokens, ids, depth))
    if estimator == "reuse":
        endpoint = check_saved_states(rollout.states if states is None else states, policy, tokens, ids, depth)
        return endpoint_logits(reference, tokens, endpoint)
    raise UserError(f"unknown estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")


def score_and_backward(
    estimator: str,
    model,
    rollout: Rollout,
    objective: Objective,
    *,
    depth: int,
    neumann_steps: int = 4,
    states: SavedStates | None = None,
) -> dict:
    """Score `rollout` with `objective` and accumulate the gradient into .grad with `estimator`.

    `states` (reuse) defaults to the rollout's own saved states.
    """
    tokens, ids = rollout.tokens, rollout.example_ids
    if estimator == "bptt":
        return bptt_backward(model, tokens, ids, depth, objective)
    if estimator == "recompute":
        return endpoint_backward(
            model, tokens, recompute_endpoints(model, tokens, ids, depth), objective, neumann_steps
        )
    if estimator == "reuse":
        endpoint = check_saved_states(rollout.states if states is None else states, model, tokens, ids, depth)
        return endpoint_backward(model, tokens, endpoint, objective, neumann_steps)
    raise UserError(f"unknown estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
