"""The serving engine's rows speculate together: one self-speculative round over a batch (design §16).

The batch-1 loop of `looplm.infer.speculative` drafts and verifies one row; here every running row
of the engine does the same in lockstep, through one `DecodeStep` on the pool's cache:
1. draft: k one-token steps at `draft_depth`, row b writing positions L_b .. L_b + k - 1 from its
   chosen-but-unfed token, each row choosing its drafts by its own sampling settings;
2. verify: the chunk [last, d_1 .. d_k] of every row at the rows' common depth, in one step;
3. accept per row (`looplm.infer.speculative.accept`: the longest agreeing prefix when greedy, the
   speculative-sampling rule otherwise), so rows move on by different numbers of tokens; the
   engine sets each row's length to L_b + 1 + accepted_b, and a rejected draft's K/V (past that
   length) are never read.
A row speculates when its own request does, at a fixed depth above `draft_depth`, with room for
k + 1 positions (`Engine._plan`; `check_room` refuses a k that never fits a slot); the rows of one
plan speculate together, and rows that do not (a plain step, another plan) ride along in the round
(`members`): they write only at or past their length and nothing of theirs is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from looplm.errors import UserError
from looplm.infer.decode import SamplingConfig, probabilities, sample
from looplm.infer.speculative import accept
from looplm.infer.step import DecodeStep, StepRows

__all__ = ["RoundResult", "check_room", "speculative_round"]


def check_room(name: str, k: int, slot: int) -> None:
    """UserError unless k draft tokens can ever speculate in a slot of `slot` positions: the verify
    chunk of k + 1 tokens starts after at least the prompt's first token."""
    if k > slot - 2:
        raise UserError(
            f"{name} must be <= {slot - 2}: a verify chunk of k + 1 tokens after the prompt's first "
            f"token must fit a slot of {slot} positions, got {k}"
        )


@dataclass
class RoundResult:
    tokens: list[list[int]]
    """Per row: its accepted drafts, then the verifier's own next token (1 .. k + 1 tokens; none for a
    row that rides along)."""
    logits: torch.Tensor
    """The verifier's logits [n, k + 1, V]: row b's token j was chosen from logits[b, j]."""
    drafted: int
    """Draft tokens proposed over the member rows."""


def _draw(logits: torch.Tensor, sampling: list[SamplingConfig], generators: list) -> tuple[torch.Tensor, list]:
    """Each row's draft token from its logits [B, V] (argmax for a greedy row), and its draft
    distribution (None for a greedy row)."""
    tokens = logits.argmax(-1)
    dists: list = [None] * len(sampling)
    for b, (cfg, gen) in enumerate(zip(sampling, generators)):
        if gen is not None:  # a sampling row
            dists[b] = probabilities(logits[b : b + 1], cfg)[0]
            tokens[b] = sample(dists[b][None], gen)[0]
    return tokens, dists


@torch.no_grad()
def speculative_round(
    step: DecodeStep,
    rows: StepRows,
    n: int,
    *,
    depth: int,
    draft_depth: int,
    k: int,
    sampling: list[SamplingConfig],
    generators: list,
    keys: int | None = None,
    members: list[bool] | None = None,
) -> RoundResult:
    """One round for the first `n` of `rows` (the rest are padding rows of the step's batch bucket).

    `rows.tokens` [B] are the rows' chosen-but-unfed tokens and `rows.write_at` their cached
    lengths; `sampling`/`generators` are the n live rows' settings (generator None = greedy).
    `keys`: every step of the round attends over cache positions [0, keys) (`DecodeStep.__call__`;
    the rows' lengths + k + 1 must fit). `members` (default: all): the live rows that speculate; the
    others ride along: drafted greedily (their generators untouched), no tokens, no drafts counted."""
    members = [True] * n if members is None else members
    sampling = [cfg if m else SamplingConfig() for cfg, m in zip(sampling, members)]
    generators = [gen if m else None for gen, m in zip(generators, members)]
    B = rows.tokens.shape[0]
    pad = [SamplingConfig()] * (B - n)
    tok, drafts, dists = rows.tokens, [], []
    for i in range(k):
        logits, _ = step(
            StepRows(tok, rows.write_at + i, rows.first, rows.example_ids), draft_depth, fill=False, keys=keys
        )  # a draft's deeper visits are never read: the verifier rewrites them
        tok, q = _draw(logits, list(sampling) + pad, list(generators) + [None] * (B - n))
        drafts.append(tok)
        dists.append(q)
    drafted = torch.stack(drafts, 1)  # [B, k]
    chunk = torch.cat([rows.tokens[:, None], drafted], 1)
    verify, _ = step(StepRows(chunk, rows.write_at, rows.first, rows.example_ids), depth, keys=keys)
    verify = verify[:n]
    out = []
    for b in range(n):
        if not members[b]:
            out.append([])
            continue
        gen = generators[b]
        if gen is None:
            kept, nxt = accept(drafted[b], verify[b], None, None)
        else:
            p = probabilities(verify[b], sampling[b])
            kept, nxt = accept(drafted[b], p, torch.stack([d[b] for d in dists]), gen)
        out.append([*drafted[b, :kept].tolist(), int(nxt)])
    return RoundResult(out, verify, sum(members) * k)
