"""Self-speculative decoding: the looped model drafts at a shallow depth and verifies at its own
depth (design §16). Near a fixed point the argmax at depth 2-4 already equals the argmax at depth
32 at most positions, so the same weights serve as draft and verifier.

One round, after the cache holds `length` tokens and the next token `last` has been chosen:
1. draft: k one-token steps at depth r_d (`DecodeStep`) from `last`, writing positions
   length..length+k-1 and proposing d_1..d_k (greedy: `DecodeStep.drafts`, the k steps in one call,
   one compiled graph, design §16);
2. verify: the chunk [last, d_1..d_k] at depth R, one chunk of the same step (the cached
   forward's chunk protocol with static shapes), which rewrites positions length..length+k with
   the verifier's K/V;
3. accept the longest prefix on which the verifier agrees (greedy), or by the speculative-sampling
   rule (accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), on rejection draw from
   norm(max(p_i - q_i, 0))), which leaves each emitted token distributed as the verifier's p;
   the verifier's distribution after the last accepted token gives one more token for free;
4. roll back: the cache's length becomes length + 1 + accepted, so a rejected draft's K/V (past
   the length) are never read and the next round overwrites them.

With the full cache the verify chunk at depth R is the parallel forward, so greedy output equals
plain decoding at depth R token for token. With the terminal cache the chunk's tokens read each
other's current-recurrence K/V (the chunk protocol of design §7), so the output equals decoding in
which each accepted window was written as one chunk; BENCHMARKS.md measures what that costs.

Reuse (full cache, `reuse=True`, the default): a draft's recurrence r < r_d reads the visit-r
banks, which for the earlier chunk positions hold the earlier drafts' visit-r K/V, exactly what
the verify chunk's recurrence r computes there; so its state after r_d recurrences is the
verifier's, and its visits 1..r_d stay in the cache. The drafts fed [last, d_1..d_{k-1}] (`last`,
the verifier's own token, is not cached yet: the first draft feeds it); d_k was never fed, so it
runs recurrences 1..r_d alone first, then the chunk of k + 1 runs r_d + 1..R (`DecodeStep`'s
`resume`, design §16). The prelude reruns on the chunk (it rewrites the same K/V).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from looplm.errors import UserError
from looplm.infer.decode import SamplingConfig, probabilities, sample
from looplm.infer.depth_rule import check_depth
from looplm.infer.step import DecodeStep, StepRows

__all__ = ["Speculation", "SpeculationStats", "accept", "speculative_decode"]


@dataclass
class Speculation:
    """Self-speculative decoding's settings: draft `k` tokens at `draft_depth`, verify them in one
    chunk at the decode depth."""

    k: int = 4
    """Draft tokens per verify chunk."""
    draft_depth: int = 2
    """Recurrences per draft token (r_d < depth)."""
    reuse: bool = True
    """Full cache: the verify starts at recurrence r_d + 1 from the drafts' states (False: all R)."""

    def check(self, depth: int) -> None:
        if self.k < 1:
            raise UserError(f"speculate needs k >= 1 draft tokens, got {self.k}")
        check_depth("draft_depth", self.draft_depth, depth - 1, f"below the decode depth {depth}")


@dataclass
class SpeculationStats:
    rounds: int = 0
    """Verify chunks run."""
    drafted: int = 0
    """Draft tokens proposed."""
    accepted: int = 0
    """Draft tokens the verifier accepted."""
    first_round_s: float = 0.0
    """Seconds until the first round's end (drafts and verify; compiling included when compiled),
    counted from `speculative_decode`'s `started`."""
    first_round_tokens: int = 0
    """Tokens emitted by the first round's end: the first token, the accepted drafts and the
    verifier's own token, less any after the row stopped (max_new_tokens, a stop)."""

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens emitted per verify chunk (accepted drafts + the verifier's own token)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


def accept(
    drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator | None
) -> tuple[int, torch.Tensor]:
    """How many of `drafts` [k] to keep, and the next token after them.

    Greedy (`q` None): `p` [k + 1, V] are the verifier's logits; keep the longest prefix where
    d_i = argmax p_i, then argmax p at the first disagreement (or after the last draft).
    Sampling: `p` [k + 1, V] and `q` [k, V] are the verifier's and the draft's distributions; keep
    d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from
    norm(max(p_i - q_i, 0)); when every draft is kept, draw from p_k."""
    k = drafts.shape[0]
    if q is None:
        agree = (p[:k].argmax(-1) == drafts).int()
        n = int(agree.cumprod(0).sum())
        return n, p[n].argmax(-1)
    idx = torch.arange(k, device=drafts.device)
    ratio = p[idx, drafts] / q[idx, drafts].clamp_min(1e-30)
    u = torch.rand(k, generator=generator, device=drafts.device)
    keep = (u < ratio.clamp(max=1.0)).int()
    n = int(keep.cumprod(0).sum())
    if n == k:
        return n, sample(p[k : k + 1], generator)[0]
    residual = (p[n] - q[n]).clamp_min(0)
    total = residual.sum()
    residual = residual / total if float(total) > 0 else p[n]  # p == q: any draw from p is exact
    return n, sample(residual[None], generator)[0]


@torch.no_grad()
def speculative_decode(
    step: DecodeStep,
    first_logits: torch.Tensor,
    *,
    length: int,
    depth: int,
    draft_depth: int,
    k: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    pad: torch.Tensor,
    example_ids: torch.Tensor,
    emit: Callable[[int], bool],
    stats: SpeculationStats,
    reuse: bool = True,
    started: float | None = None,
) -> None:
    """Decode one row (batch 1) speculatively from `first_logits` [1, V] (the prompt's last position)
    with `length` tokens cached; `emit(token)` takes each new token and returns True to stop.
    At most `sampling.max_new_tokens` tokens are emitted. `reuse` (full cache): the verify chunk
    starts at recurrence draft_depth + 1 from the drafts' states (design §16); False (or the
    terminal cache) runs its every recurrence. `started`: the `time.perf_counter()` that
    `stats.first_round_s` counts from (default: this call's start; `generate` passes its decode's
    start, so that building the step counts in the first round as it counts in a plain first step).
    UserError (a ValueError) for k < 1 or a draft depth not below `depth`."""
    Speculation(k, draft_depth).check(depth)
    greedy = sampling.temperature <= 0
    reuse = reuse and step.cache.mode == "full" and draft_depth <= step.cache.depth
    started = time.perf_counter() if started is None else started
    dev = first_logits.device

    def choose_from(logits):  # (token [1], distribution or None)
        if greedy:
            return logits.argmax(-1), None
        probs = probabilities(logits, sampling)
        return sample(probs, generator), probs

    last, _ = choose_from(first_logits)
    emitted = 1
    if emit(int(last)) or emitted >= sampling.max_new_tokens:
        return
    while True:
        # drafts past the cache cannot be written; past what may still be emitted they are wasted, but a
        # compiled step keeps k (a shorter chunk is a new graph to compile)
        room = step.cache.max_len - length - 1
        if room < 0:  # the last round filled the cache: its last token cannot be fed
            return
        n_draft = min(k, room) if step.compiled else min(k, sampling.max_new_tokens - emitted - 1, room)
        if n_draft < 1:  # the last token: one plain step at the verifier's depth
            logits, _ = step(StepRows(last, torch.tensor([length], device=dev), pad, example_ids), depth)
            emit(int(choose_from(logits)[0]))
            return
        at = StepRows(last, torch.tensor([length], device=dev), pad, example_ids)
        # a draft's deeper visits are never read: the verifier rewrites them; `states` [1, n_draft, d]: after
        # recurrence draft_depth, of the tokens fed (last, d_1, ...)
        if greedy:  # the drafts in one call (one graph when compiled)
            drafted, *states = step.drafts(at, draft_depth, n_draft, endpoint=reuse)
            drafts, qs = drafted[0], None
        else:
            tok, toks, qs, states = last, [], [], []
            for i in range(n_draft):
                logits, _, *z = step(
                    replace(at, tokens=tok, write_at=at.write_at + i), draft_depth, fill=False, endpoint=reuse
                )
                tok, q = choose_from(logits)
                toks.append(tok)
                qs.append(q)
                states += z
            drafts, qs, states = torch.cat(toks), torch.cat(qs), [torch.stack(states, 1)] if reuse else []
        chunk = torch.cat([last, drafts])[None]
        resume = (states[0], draft_depth) if reuse else None  # d_k, never fed, catches up in the step
        verify, _ = step(StepRows(chunk, at.write_at, pad, example_ids), depth, resume=resume)
        verify = verify[0]
        p = verify if greedy else probabilities(verify, sampling)
        n, nxt = accept(drafts, p, qs, generator)
        stats.rounds += 1
        if stats.rounds == 1:
            stats.first_round_s = time.perf_counter() - started
        stats.drafted += n_draft
        stats.accepted += n
        length += 1 + n
        # roll back: the next round writes from `length` on, so a rejected draft's K/V are never read
        stop = False
        for t in [*drafts[:n].tolist(), int(nxt)]:
            emitted += 1
            stop = emit(t) or emitted >= sampling.max_new_tokens
            if stop:
                break
        if stats.rounds == 1:
            stats.first_round_tokens = emitted
        if stop:
            return
        last = nxt.reshape(1)
