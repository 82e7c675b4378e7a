"""Update estimators: how the policy loss of a rollout is scored and backpropagated (SPEC 10, A.2).

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
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from looplm.model.blocks import rope_tables
from looplm.rl.rollout import Rollout, SavedStates, check_saved_states

ESTIMATORS = ("bptt", "recompute", "reuse")
Objective = Callable[[torch.Tensor], torch.Tensor]
"""Maps fp32 logits [N, L, V] to the scalar loss."""


def neumann_backward(recurrence: Callable[[torch.Tensor], torch.Tensor], head: Callable[[torch.Tensor], torch.Tensor],
                     endpoint: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate c + B^T v_{steps+1} into the parameters' .grad, v_{k+1} = g + J^T v_k, v_1 = g.

    `recurrence(z)` is one application of F (its parameters may require grad), `head(z_bar)` the
    scalar loss on its output. Returns (loss, z_bar), both detached.
    """
    if steps < 0:
        raise ValueError(f"Neumann steps must be >= 0, got {steps}")
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


def endpoint_backward(model, tokens: torch.Tensor, endpoint: torch.Tensor, objective: Objective,
                      steps: int) -> dict:
    """The one-recurrence Neumann update of `model` at the endpoints [N, L, d] of `tokens` [N, L]
    (causal rows starting at position 0). Returns {"loss", "residual"}: residual is the mean
    relative change |F(z) - z| / |z| over the tokens, a distance from the fixed point."""
    B, L = tokens.shape
    positions = torch.arange(L, device=tokens.device).expand(B, L)
    rope = rope_tables(positions, model.cfg.head_dim, model.cfg.rope_base)
    e = model.run_prelude(tokens, rope, None)
    ctx = model.context(e, rope, None)
    loss, z_bar = neumann_backward(lambda z: model.recurrence(z, ctx), lambda z: objective(model.run_coda(z, rope, None)),
                                   endpoint, steps)
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


def score_and_backward(estimator: str, model, rollout: Rollout, objective: Objective, *, depth: int,
                       neumann_steps: int = 4, states: SavedStates | None = None) -> dict:
    """Score `rollout` with `objective` and accumulate the gradient into .grad with `estimator`.

    `states` (reuse) defaults to the rollout's own saved states.
    """
    tokens, ids = rollout.tokens, rollout.example_ids
    if estimator == "bptt":
        return bptt_backward(model, tokens, ids, depth, objective)
    if estimator == "recompute":
        return endpoint_backward(model, tokens, recompute_endpoints(model, tokens, ids, depth), objective,
                                 neumann_steps)
    if estimator == "reuse":
        endpoint = check_saved_states(rollout.states if states is None else states, model, tokens, ids, depth)
        return endpoint_backward(model, tokens, endpoint, objective, neumann_steps)
    raise ValueError(f"unknown estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
