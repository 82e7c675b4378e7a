"""Cached perplexity: terminal-KV vs full-KV scoring and the sharing penalty (SPEC 8).

Per held-out row: take the document that crosses the row's midpoint, prefill it up to the
midpoint at depth R, then score the rest of that document as one parallel chunk against the
cache. Starting the prefill at the document's first token means no attention crosses a document
boundary. With the full cache this equals the native forward over the same tokens; with the
terminal cache the chunk reads the prefix only through terminal banks.

`stepwise=True` is the CacheEval protocol (App. D.4): the same targets are scored by
teacher-forced one-token decoding, so each continuation token also reads the earlier continuation
tokens through the cache (terminal banks, for the terminal cache) instead of their same-recurrence K/V.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from looplm.data import IGNORE_INDEX, PackedDataset
from looplm.infer import extend, make_cache
from looplm.infer.prefill import Prefill


def _midpoint_document(doc_ids: torch.Tensor) -> tuple[int, int, int]:
    """(start, mid, end) of the document segment that crosses the middle of a row."""
    L = doc_ids.shape[0]
    mid = L // 2
    seg = doc_ids[mid]
    where = (doc_ids == seg).nonzero()[:, 0]
    start, end = int(where[0]), int(where[-1]) + 1
    return start, max(mid, start + 1), end


def _document_with_room(doc_ids: torch.Tensor, need: int) -> int | None:
    """Start of the first document segment of a row with at least `need` tokens, or None."""
    ids = doc_ids.tolist()
    start = 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or ids[t] != ids[start]:
            if t - start >= need:
                return start
            start = t
    return None


@torch.no_grad()
def cached_perplexity(model, data: PackedDataset, depth: int, mode: str, *, max_sequences: int = 16,
                      device="cpu", stepwise: bool = False, exit_tau: float | None = None,
                      min_depth: int = 1, span: tuple[int, int] | None = None,
                      prefill: Prefill | None = None) -> dict[str, float]:
    """{"loss", "ppl", "tokens"} of the second part of each row's midpoint document, scored as one
    chunk after a prefill of its first part, with a `mode` ("terminal" or "full") cache at `depth`.

    `span=(P, C)` fixes the split instead (the paper's CacheEval uses 1,024 + 512): P prompt tokens
    from the start of the row's first document that is long enough, then C scored targets; rows
    without such a document are skipped. `prefill` writes the first part (`looplm.infer.prefill`:
    distilled student, R = 1 or 2; default: the model at `depth`); the rest is scored at `depth`."""
    total, count, depth_sum, n_dec = 0.0, 0, 0, 0
    for i in range(min(len(data), max_sequences)):
        b = data.get_batch([i]).to(device)
        if span is None:
            start, mid, end = _midpoint_document(b.doc_ids[0])
        else:
            found = _document_with_room(b.doc_ids[0], sum(span))
            if found is None:
                continue
            start, mid, end = found, found + span[0], found + span[0] + span[1]
        if end - mid < 1:
            continue
        cache = make_cache(mode, model.cfg, 1, end - start, depth, device=device)
        (prefill or Prefill())(model, b.inputs[:, start:mid], cache, depth, example_ids=b.example_ids)
        if stepwise:
            steps = [extend(model, b.inputs[:, t:t + 1], cache, depth, example_ids=b.example_ids,
                            exit_tau=exit_tau, min_depth=min_depth, return_depths=True) for t in range(mid, end)]
            logits = torch.cat([lg for lg, _ in steps], dim=1)
            depth_sum += sum(int(u.sum()) for _, u in steps)
            n_dec += len(steps)
        else:
            logits = extend(model, b.inputs[:, mid:end], cache, depth, example_ids=b.example_ids)
        targets = b.targets[:, mid:end]
        total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                                 reduction="sum").item()
        count += int((targets != IGNORE_INDEX).sum())
    if count == 0:
        raise ValueError("no scored tokens for cached perplexity (no supervised targets after the midpoints)")
    loss = total / count
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count,
            "mean_decode_depth": depth_sum / n_dec if n_dec else float(depth)}


def sharing_table(model, data: PackedDataset, depths: Sequence[int], *, max_sequences: int = 16,
                  device="cpu", progress=None, span: tuple[int, int] | None = None) -> dict[int, dict[str, float]]:
    """{R: {"terminal_ppl", "full_ppl", "sharing_penalty", "cacheeval_terminal_ppl", "cacheeval_penalty"}};
    penalty = 100 (PPL_terminal / PPL_full - 1). Full-cache scoring is the same for both protocols."""
    out = {}
    for depth in depths:
        kw = dict(max_sequences=max_sequences, device=device, span=span)
        term = cached_perplexity(model, data, depth, "terminal", **kw)
        full = cached_perplexity(model, data, depth, "full", **kw)
        step = cached_perplexity(model, data, depth, "terminal", stepwise=True, **kw)
        out[depth] = {"terminal_ppl": term["ppl"], "full_ppl": full["ppl"], "tokens": term["tokens"],
                      "sharing_penalty": 100.0 * (term["ppl"] / full["ppl"] - 1.0),
                      "cacheeval_terminal_ppl": step["ppl"],
                      "cacheeval_penalty": 100.0 * (step["ppl"] / full["ppl"] - 1.0)}
        if progress is not None:
            progress()
    return out
