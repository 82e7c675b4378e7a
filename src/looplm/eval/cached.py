"""Cached perplexity: terminal-KV vs full-KV scoring and the sharing penalty (design §8).

Index convention: row position t holds input token x[t] and target y[t] = x[t + 1]; the logits
computed at input position t score target t. Every document segment is read from its own start
(the cache starts there), so no attention crosses a document boundary and positions match the
native forward's.

Two protocols choose the scored targets:

- **Row halves** (default; §5.1, "prefill the first half, score the second half"): every supervised
  target t in the second half of the row, L // 2 <= t < L. The document that straddles the midpoint
  is prefilled from its start up to the midpoint; a document that starts at or after the midpoint
  has nothing before it to prefill (its cache starts empty). Its targets are then scored as one
  parallel chunk over inputs [first, end) (`stepwise=False`), or by teacher-forced one-token decoding
  of the same inputs (`stepwise=True`): the same target set either way. A chunk over an empty cache
  is the native forward (App. D.3), so in the chunk column only the straddling document's targets
  read a prefix through terminal banks; in the decode column every token reads its predecessors
  through the cache.
- **CacheEval spans** (`span=(P, C)`, App. D.4): in the first document of the row that holds at least
  P + C tokens, starting at s, the prompt x[s .. s+P-1] is prefilled; the prefill's last logits (input
  s+P-1) score the first continuation target y[s+P-1] = x[s+P]; then the C - 1 continuation tokens
  x[s+P .. s+P+C-2] are teacher-forced one at a time (`stepwise=True`) or as one chunk, scoring
  y[s+P .. s+P+C-2]. So C targets are scored and the cache ends at P + C - 1 tokens (the paper's
  1,024 + 512 grows the cache from 1,024 to 1,535).

With the full cache both protocols equal the native forward on the same targets; with the terminal
cache earlier tokens are read only through their terminal banks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from looplm.data import IGNORE_INDEX, PackedDataset
from looplm.errors import UserError
from looplm.infer import extend, make_cache
from looplm.infer.prefill import Prefill


def document_segments(doc_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each document segment of a row, in order."""
    ids = doc_ids.tolist()
    out, start = [], 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or ids[t] != ids[start]:
            out.append((start, t))
            start = t
    return out


def _second_half_segments(doc_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, first, end) for each document segment with inputs in the second half of the row:
    the segment is read from `start`, inputs [start, first) are prefilled and targets [first, end)
    scored; first = max(start, L // 2)."""
    mid = doc_ids.shape[0] // 2
    return [(s, max(s, mid), e) for s, e in document_segments(doc_ids) if e > mid]


def _document_with_room(doc_ids: torch.Tensor, need: int) -> int | None:
    """Start of the first document segment of a row with at least `need` tokens, or None."""
    return next((s for s, e in document_segments(doc_ids) if e - s >= need), None)


def require_span_room(data: PackedDataset, span: tuple[int, int]) -> None:
    """A UserError naming the span when no row of `data` holds a document of P + C tokens (the CacheEval
    protocol would read every row and score nothing); stops at the first row that has one."""
    need, longest = span[0] + span[1], 0
    for i in range(len(data)):
        longest = max([longest] + [e - s for s, e in document_segments(data.get_batch([i]).doc_ids[0])])
        if longest >= need:
            return
    raise UserError(
        f"cacheeval span {span[0]} {span[1]}: no held-out document has {need} tokens "
        f"(the longest has {longest}); choose a shorter span"
    )


@torch.no_grad()
def cached_perplexity(
    model,
    data: PackedDataset,
    depth: int,
    mode: str,
    *,
    max_sequences: int = 16,
    device="cpu",
    stepwise: bool = False,
    exit_tau: float | None = None,
    min_depth: int = 1,
    span: tuple[int, int] | None = None,
    prefill: Prefill | None = None,
    prefilled_only: bool = False,
) -> dict[str, float]:
    """{"loss", "ppl", "tokens", "mean_decode_depth"} with a `mode` ("terminal" or "full") cache at
    `depth`, under the row-halves protocol (default) or CacheEval spans (`span=(P, C)`; the paper uses
    1,024 + 512; rows without a document of P + C tokens are skipped, and `max_sequences` counts the
    spans scored; none at all is a UserError naming the span). See the module docstring for
    exactly which targets are scored; "tokens" counts them.

    `stepwise=True` scores by teacher-forced one-token decoding instead of one parallel chunk (same
    targets); only it runs adaptive exit (`exit_tau`, `min_depth`). `prefill` writes the prompt part
    (`looplm.infer.prefill`: distilled student, R = 1 or 2; default: the model at `depth`); the rest
    is scored at `depth`. `prefilled_only` scores only the
    documents that have a prefilled part (what compares prefill arms). Caches use the model's dtype."""
    dtype = next(model.parameters()).dtype
    total, count, depth_sum, n_dec = 0.0, 0, 0, 0
    if span is not None and (span[0] < 1 or span[1] < 1):
        raise UserError(f"span needs P >= 1 prompt tokens and C >= 1 targets, got {span}")
    if not stepwise and (exit_tau is not None or min_depth != 1):
        rule = "exit_tau" if exit_tau is not None else "min_depth"
        raise UserError(f"{rule} (adaptive exit) is a rule of one-token decoding: score with stepwise=True")
    # spans: the first `max_sequences` rows that hold a document of P + C tokens; halves: the first rows
    rows, spans = range(len(data) if span is not None else min(len(data), max_sequences)), 0
    for i in rows:
        if span is not None and spans == max_sequences:
            break
        b = data.get_batch([i]).to(device)
        if span is None:
            # (context start, first fed input after the prompt, end of fed inputs, first scored target)
            plans = [(s, first, e, first) for s, first, e in _second_half_segments(b.doc_ids[0])]
            if prefilled_only:  # documents that start at or after the midpoint have no prompt to prefill
                plans = [plan for plan in plans if plan[1] > plan[0]]
        else:
            P, C = span
            s = _document_with_room(b.doc_ids[0], P + C)
            plans = [] if s is None else [(s, s + P, s + P + C - 1, s + P - 1)]
            spans += bool(plans)
        for start, fed, end, scored in plans:
            targets = b.targets[:, scored:end]
            n = int((targets != IGNORE_INDEX).sum())
            if n == 0:
                continue
            cache = make_cache(mode, model.cfg, 1, end - start, depth, device=device, dtype=dtype)
            logits = []
            if fed > start:
                out = (prefill or Prefill())(model, b.inputs[:, start:fed], cache, depth, example_ids=b.example_ids)
                if scored < fed:  # CacheEval: the prefill's last logits score the first target
                    logits.append(out[:, scored - fed :].clone())  # not a view holding all P rows' logits
                del out
            if end > fed and stepwise:
                for t in range(fed, end):
                    step = extend(
                        model,
                        b.inputs[:, t : t + 1],
                        cache,
                        depth,
                        example_ids=b.example_ids,
                        exit_tau=exit_tau,
                        min_depth=min_depth,
                    )
                    logits.append(step.logits)
                    depth_sum += int(step.depths.sum())
                    n_dec += 1
            elif end > fed:
                logits.append(extend(model, b.inputs[:, fed:end], cache, depth, example_ids=b.example_ids).logits)
            logits = torch.cat(logits, dim=1)
            total += F.cross_entropy(
                logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            ).item()
            count += n
    if count == 0 and span is not None and spans == 0:  # every row was read: name the longest document
        require_span_room(data, span)
    if count == 0:
        raise UserError("no scored tokens for cached perplexity (no supervised targets in the scored part of any row)")
    loss = total / count
    return {
        "loss": loss,
        "ppl": math.exp(min(loss, 50.0)),
        "tokens": count,
        "mean_decode_depth": depth_sum / n_dec if n_dec else float(depth),
    }


def sharing_table(
    model,
    data: PackedDataset,
    depths: Sequence[int],
    *,
    max_sequences: int = 16,
    device="cpu",
    progress=None,
    span: tuple[int, int] | None = None,
) -> dict[int, dict[str, float]]:
    """{R: {"terminal_ppl", "full_ppl", "sharing_penalty", "cacheeval_terminal_ppl", "cacheeval_penalty",
    "tokens", "span"}}; penalty = 100 (PPL_terminal / PPL_full - 1). The chunk ("terminal_ppl") and
    decode ("cacheeval_terminal_ppl") columns score the same "tokens" targets (`cached_perplexity`);
    full-cache scoring is the same for both protocols. "span" is the (P, C) used, or None for row halves."""
    out = {}
    for depth in depths:
        kw = dict(max_sequences=max_sequences, device=device, span=span)
        term = cached_perplexity(model, data, depth, "terminal", **kw)
        full = cached_perplexity(model, data, depth, "full", **kw)
        step = cached_perplexity(model, data, depth, "terminal", stepwise=True, **kw)
        if not term["tokens"] == full["tokens"] == step["tokens"]:
            raise RuntimeError(
                f"sharing protocols scored different targets: {term['tokens']}, {full['tokens']}, {step['tokens']}"
            )
        out[depth] = {
            "terminal_ppl": term["ppl"],
            "full_ppl": full["ppl"],
            "tokens": term["tokens"],
            "sharing_penalty": 100.0 * (term["ppl"] / full["ppl"] - 1.0),
            "cacheeval_terminal_ppl": step["ppl"],
            "cacheeval_penalty": 100.0 * (step["ppl"] / full["ppl"] - 1.0),
            "span": None if span is None else tuple(span),
        }
        if progress is not None:
            progress(depth)
    return out
