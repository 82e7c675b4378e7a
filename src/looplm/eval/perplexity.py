"""Native perplexity: one parallel forward per depth, exp(token-mean CE) (design §8)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from looplm.data import IGNORE_INDEX, PackedDataset
from looplm.errors import UserError
from looplm.model.exits import relative_change

EVAL_CE_CHUNK_ROWS = 1024
"""Rows per chunk of the evaluation's cross-entropy: [1024, V] fp32 logits at a time (0.26 GB at V = 64256)."""


@torch.no_grad()
def native_perplexity(
    model,
    data: PackedDataset,
    depths: Sequence[int],
    *,
    batch_size: int = 8,
    max_sequences: int | None = 64,
    device: torch.device | str = "cpu",
    progress=None,
    tokenizer=None,
    ce_chunk_rows: int = EVAL_CE_CHUNK_ROWS,
) -> dict[int, dict[str, float]]:
    """{depth: {"loss", "ppl", "tokens", "state_change", "bits_per_byte"}} over the first
    `max_sequences` sequences of `data`, with the deterministic seeded initial state so results do
    not depend on batching.

    `bits_per_byte` (with a `tokenizer`): the summed CE in bits over the UTF-8 bytes of the scored
    target tokens' text, comparable across tokenizers (end-of-text targets add bits, no bytes).

    `state_change` is the token mean of |s^R - s^(R-1)| / |s^(R-1)| at the last recurrence (design §11):
    how far the recurrence still is from a fixed point at depth R (None at R = 1).

    Memory (`looplm.eval.memory`): the CE is summed `ce_chunk_rows` rows at a time (no [B, L, V] fp32
    logits) and only the last two recurrence states are kept."""
    n = len(data) if max_sequences is None else min(len(data), max_sequences)
    if n == 0:
        raise UserError("no evaluation sequences")
    n_bytes = scored_bytes(data, n, tokenizer) if tokenizer is not None else None
    results = {}
    for depth in depths:
        total, count, change, n_tok = 0.0, 0, 0.0, 0
        for start in range(0, n, batch_size):
            batch = data.get_batch(list(range(start, min(n, start + batch_size)))).to(device)
            out = model(
                batch.inputs,
                depth,
                doc_ids=batch.doc_ids,
                positions=batch.positions,
                init="seeded",
                example_ids=batch.example_ids,
                return_states=depth > 1,
                keep_states=2,
                targets=batch.targets,
                ce_chunk_rows=ce_chunk_rows,
            )
            total += out.ce_sum.item()
            count += batch.n_targets
            if depth > 1:
                prev, last = out.states[-2], out.states[-1]
                change += relative_change(last, prev).sum().item()
                n_tok += last.shape[0] * last.shape[1]
            if progress is not None:
                progress(depth)  # the depth: a batch at R costs about R batches at 1
        loss = total / max(count, 1)
        results[depth] = {
            "loss": loss,
            "ppl": math.exp(min(loss, 50.0)),
            "tokens": count,
            "state_change": change / n_tok if n_tok else None,
            "bits_per_byte": total / math.log(2) / n_bytes if n_bytes else None,
        }
    return results


def scored_bytes(data: PackedDataset, n: int, tokenizer) -> int:
    """UTF-8 bytes the supervised targets in the first `n` sequences of `data` add to the text: each
    token's own bytes (a byte of a character whose other bytes are not targets counts once, not as
    the 3 bytes of the U+FFFD a decode would give it; special tokens add none)."""
    total = 0
    for i in range(n):
        targets = data.get_batch([i]).targets[0]
        for t in targets[targets != IGNORE_INDEX].tolist():
            piece = tokenizer.token_piece(t)
            total += len(piece) if isinstance(piece, bytes) else 0
    return total
