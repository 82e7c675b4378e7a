"""`extend`: prefill, parallel scoring and one-token decoding through the model's cached forward (design §7).

A chunk of n new tokens at positions c..c+n-1 runs the prelude, the recurrence and the coda
against a cache of the c earlier tokens, writes its own K/V into the cache and returns the
model's `LoopOutput` (logits, depths used, endpoint). A thin layer: the forward is `LoopedLM`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from looplm.infer.cache import KVCache
from looplm.model.exits import DepthPlan
from looplm.model.looped import LoopOutput


@torch.no_grad()
def extend(
    model,
    tokens: torch.Tensor,
    cache: KVCache,
    depth,
    *,
    example_ids: torch.Tensor | None = None,
    seed: int = 0,
    pad: torch.Tensor | None = None,
    exit_tau=None,
    min_depth=1,
    initial: Callable | None = None,
    exit_gate: float | None = None,
) -> LoopOutput:
    """Run `tokens` [B, n] after the `cache.length` cached tokens at `depth` recurrences, without
    autograd: `LoopedLM.forward` with the cache, a `DepthPlan` and the seeded initial state.

    Returns the model's `LoopOutput`: fp32 `logits` [B, n, V], `depths` [B, n] (the recurrences each
    token used) and `endpoint` [B, n, d] (the state that entered the coda; RL rollout-state reuse
    saves it, design §10); the cache grows by n. The initial state is seeded by (example id,
    absolute position), as in the native forward with init="seeded". `pad` [B] counts left-padding
    tokens at the start of each row (batched prompts of different lengths): no token attends to them
    and positions start at 0 at each row's first real token.

    Adaptive depth (design §13, beyond the paper): with `exit_tau`, `depth` is the largest depth and a
    token stops recurring once r >= `min_depth` and its relative state change
    |s^r - s^(r-1)| / |s^(r-1)| < exit_tau; its state is frozen and the K/V of its last recurrence
    become its terminal K/V, for later tokens and for the tokens of its own chunk that still recur
    (the cache masks a stopped token's writes, design §16).

    Continuous batching (`looplm.serve`): `depth`, `exit_tau` and `min_depth` may be per-row tensors
    [B] (a row's `exit_tau` of 0 never exits; its rows stop at their own depth, frozen like an exit),
    and `cache.length` may be per-row lengths [B] for one-token steps (n = 1, no `pad`): row b's
    token sits at position length_b and attends to its row's [0, length_b].

    `initial(e, rope, mask)` replaces the seeded initial state by a function of the chunk's prelude
    output (the distilled prefill's student endpoint, design §9; see `looplm.infer.prefill`). It sees
    only the chunk, so it needs an empty cache.

    `exit_gate` q (a model with `cfg.exit_gate`, design §14; Ouro's threshold exit): every `depth`
    recurrence runs and writes its K/V, and each token's coda and logits read the state of the first
    recurrence whose cumulative exit probability reaches q (else the last); `depths` then gives that
    recurrence.
    """
    if tokens.shape[0] != cache.batch:
        raise ValueError(f"batch {tokens.shape[0]} does not match the cache's batch {cache.batch}")
    if initial is not None and (isinstance(cache.length, torch.Tensor) or cache.length > 0):
        raise ValueError(
            f"a student-predicted initial state needs an empty cache, this one holds {cache.length} tokens"
        )
    plan = DepthPlan(depth, exit_tau, min_depth, exit_gate)
    return model(tokens, plan, cache=cache, pad=pad, init="seeded", initial=initial, example_ids=example_ids, seed=seed)
