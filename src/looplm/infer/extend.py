"""One `extend` path for prefill, parallel scoring and one-token decoding (design §7).

A chunk of n new tokens at positions c..c+n-1 runs the prelude, the recurrence and the coda
against a cache of the c earlier tokens, writes its own K/V into the cache and returns logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from looplm.infer.cache import KVCache
from looplm.model.blocks import rope_tables
from looplm.model.exit_gate import exit_distribution, select_depth, threshold_exit
from looplm.model.looped import value_kw


def chunk_mask(prefix: int, n: int, device) -> torch.Tensor:
    """[1, 1, n, prefix + n]: every cached token, then causal within the chunk (bottom-right aligned)."""
    mask = torch.ones(n, prefix + n, dtype=torch.bool, device=device)
    mask[:, prefix:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return mask[None, None]


def _per_row(value, B: int, device, dtype) -> torch.Tensor:
    """A scalar or per-row [B] setting as a [B, 1] tensor (broadcast over a chunk's tokens)."""
    t = torch.as_tensor(value, device=device, dtype=dtype)
    return (t.expand(B) if t.ndim == 0 else t).reshape(B, 1)


@torch.no_grad()
def extend(model, tokens: torch.Tensor, cache: KVCache, depth, *, example_ids: torch.Tensor | None = None,
           seed: int = 0, pad: torch.Tensor | None = None, exit_tau=None, min_depth=1,
           return_depths: bool = False, return_endpoint: bool = False, initial: Callable | None = None,
           exit_gate: float | None = None):
    """Run `tokens` [B, n] after the `cache.length` cached tokens at `depth` recurrences.

    Returns fp32 logits [B, n, V]; the cache grows by n. The initial state is seeded by
    (example id, absolute position), as in the native forward with init="seeded". `pad` [B]
    counts left-padding tokens at the start of each row (batched prompts of different lengths):
    no token attends to them and positions start at 0 at each row's first real token.

    Adaptive depth (design §13, beyond the paper): with `exit_tau`, `depth` is the largest depth and a
    token stops recurring once r >= `min_depth` and its relative state change
    |s^r - s^(r-1)| / |s^(r-1)| < exit_tau; its state is frozen and the K/V of its last recurrence
    become its terminal K/V. Exact per token for one-token decoding; inside a longer chunk,
    tokens that are still recurring read a stopped token's K/V recomputed from its frozen state.
    `return_depths` also returns the depth each token used, [B, n]. `return_endpoint` also returns
    each token's endpoint z^R, the state that entered the coda, [B, n, d] (last in the tuple; RL
    rollout-state reuse saves it, design §10).

    Continuous batching (`looplm.serve`): `depth`, `exit_tau` and `min_depth` may be per-row tensors
    [B] (a row's `exit_tau` of 0 never exits; its rows stop at their own depth, frozen like an exit),
    and `cache.length` may be per-row lengths [B] for one-token steps (n = 1, no `pad`): row b's
    token sits at position length_b and attends to its row's [0, length_b].

    `initial(e, rope, mask)` replaces the seeded initial state by a function of the chunk's prelude
    output (the distilled prefill's student endpoint, design §9; see `looplm.infer.prefill`). It sees
    only the chunk, so it needs an empty cache.

    `exit_gate` q (a model with `cfg.exit_gate`, design §14; Ouro's threshold exit): every `depth`
    recurrence runs and writes its K/V, and each token's coda and logits read the state of the first
    recurrence whose cumulative exit probability reaches q (else the last); `return_depths` then
    gives that recurrence.
    """
    B, n = tokens.shape
    c = cache.length
    per_row_length = isinstance(c, torch.Tensor)
    if n < 1:
        raise ValueError("extend needs at least one token")
    if B != cache.batch:
        raise ValueError(f"batch {B} does not match the cache's batch {cache.batch}")
    device = tokens.device
    if per_row_length:
        if n != 1 or pad is not None or initial is not None:
            raise ValueError("per-row cache lengths take one token per row, without padding or a student")
        if int(c.max()) + 1 > cache.max_len:
            raise ValueError(f"{int(c.max())} cached + 1 new token exceed the cache length {cache.max_len}")
    elif c + n > cache.max_len:
        raise ValueError(f"{c} cached + {n} new tokens exceed the cache length {cache.max_len}")
    per_row_depth = isinstance(depth, torch.Tensor)
    limit = _per_row(depth, B, device, torch.long)  # [B, 1] each row's largest depth
    max_depth = int(depth.max()) if per_row_depth else depth
    if per_row_depth and int(depth.min()) < 1:
        raise ValueError(f"depth must be in 1..{model.cfg.max_depth}, got {int(depth.min())}")
    model.check_inputs(tokens, max_depth)
    if initial is not None and c > 0:
        raise ValueError(f"a student-predicted initial state needs an empty cache, this one holds {c} tokens")
    if per_row_length:
        positions = c.to(device)[:, None]
        mask = (torch.arange(cache.max_len, device=device)[None, :] <= positions)[:, None, None, :]
    else:
        positions = (c + torch.arange(n, device=device)).expand(B, n)
        mask = chunk_mask(c, n, device)
    if pad is not None:
        pad = pad.to(device)
        positions = (positions - pad[:, None]).clamp(min=0)
        real = torch.arange(c + n, device=device)[None, :] >= pad[:, None]  # [B, c+n] real keys
        own = torch.zeros(n, c + n, dtype=torch.bool, device=device)
        own[:, c:] = torch.eye(n, dtype=torch.bool, device=device)  # a pad query sees itself only
        mask = mask & (real[:, None, None, :] | own[None, None])
    rope = rope_tables(positions, model.cfg.head_dim, model.cfg.rope_base)

    x = model.embed(tokens)
    rows = model.value_rows("prelude", tokens)  # value embeddings (None for a model without them)
    for i, (block, bank) in enumerate(zip(model.prelude, cache.prelude)):
        x = block(x, rope, mask, kv_buffer=bank.buffer(c), **value_kw(rows, i))
    ctx = model.context(x, rope, mask, tokens)
    if initial is not None:
        # a student of a value-embedding teacher reads the core's value embeddings too
        s = initial(x, rope, mask) if ctx.core_values is None else initial(x, rope, mask, values=ctx.core_values)
    else:
        s = model.initial_state(x, "seeded", positions=positions, example_ids=example_ids, seed=seed)
    adaptive = exit_tau is not None
    if adaptive and cache.mode != "terminal":
        raise ValueError("adaptive depth needs the terminal cache (a full cache would miss the skipped visits)")
    if adaptive and not isinstance(exit_tau, torch.Tensor) and not isinstance(min_depth, torch.Tensor) and (
            exit_tau <= 0 or not 1 <= min_depth <= max_depth):
        raise ValueError(f"adaptive depth needs exit_tau > 0 and 1 <= min_depth <= depth, got {exit_tau}, {min_depth}")
    gated = exit_gate is not None
    if gated and (model.exit_gate is None or adaptive or per_row_depth):
        raise ValueError("exit_gate needs a model with an exit gate (cfg.exit_gate), one fixed depth and no exit_tau")
    visited: list = []  # each recurrence's state, for the gate's exit rule
    frozen = adaptive or per_row_depth  # rows or tokens may stop before the loop ends
    tau = _per_row(exit_tau if adaptive else 0.0, B, device, torch.float32)
    floor = _per_row(min_depth, B, device, torch.long)
    used = limit.expand(B, n).clone()
    active = torch.ones(B, n, dtype=torch.bool, device=device)
    kept: list = [None] * len(model.core)  # each token's K/V from its last recurrence
    for r in range(max_depth):
        prev = s
        s = model.injection(s, ctx.injected)
        for j, block in enumerate(model.core):
            offsets = ctx.qkv_offsets[j] if ctx.qkv_offsets else None
            s, kv = block(s, rope, mask, offsets, kv_buffer=cache.core_read(r, j).buffer(c), return_kv=True,
                          **value_kw(ctx.core_values, j))
            keep = active[:, None, :, None]  # [B, 1, n, 1] against K/V [B, H, n, hd]
            kept[j] = kv if kept[j] is None or not frozen else tuple(
                torch.where(keep, a, b) for a, b in zip(kv, kept[j]))
        s = model.injection.exit(s)
        if gated:
            visited.append(s)
        if frozen:
            s = torch.where(active[..., None], s, prev)
            stop = active & (r + 1 >= limit)
            if adaptive:
                change = (s - prev).float().norm(dim=-1) / prev.float().norm(dim=-1).clamp_min(1e-12)
                stop |= active & (change < tau) & (r + 1 >= floor)
            used[stop] = r + 1
            active &= ~stop
            if not active.any():
                break
    for j, kv in enumerate(kept):
        cache.keep_terminal(j, c, kv, used, early=frozen)
    if gated:  # the gate's exit: each token's state at its exit recurrence enters the coda
        index = threshold_exit(exit_distribution([model.exit_gate(v) for v in visited]), exit_gate)
        s, used = select_depth(torch.stack(visited, 2), index), index + 1
    endpoint = s
    values = model.coda_values(ctx)
    s = model.coda_input(s)
    for i, (block, bank) in enumerate(zip(model.coda, cache.coda)):
        s = block(s, rope, mask, kv_buffer=bank.buffer(c), **value_kw(values, i))
    cache.length = c + n
    logits = model.logits(s)
    out = (logits,) + ((used,) if return_depths else ()) + ((endpoint,) if return_endpoint else ())
    return out if len(out) > 1 else logits
