"""Quality of prefill arms (the paper's Table 5): teacher prefill, distilled prefill, R = 1, R = 2.

Decoding is the same for every arm (the teacher at depth R with the terminal cache); only the way
the prompt enters the cache differs (`looplm.infer.prefill`). Per arm and depth:
- continuation perplexity: prefill the first half of each held-out row with the arm and score the
  second half at R as one teacher-forced chunk (`cached_perplexity`), over the documents that have a
  prefilled part (a document that starts past the midpoint is scored the same by every arm);
- generator-task exact match: prefill the prompt with the arm, then greedy decoding at R;
- bank error: how far the arm's terminal banks are from those of teacher prefill at R, each
  document of the first half prefilled from its own start (no attention crosses documents).
Any arm works here, given its `Prefill`; training students is `looplm.distill`'s business.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from looplm.eval.cached import cached_perplexity, document_segments
from looplm.eval.generation import exact_match_generator_tasks
from looplm.infer.cache import TerminalCache
from looplm.infer.prefill import Prefill


def prefill_table(
    model,
    tokenizer,
    val,
    examples: Sequence,
    arms: Sequence[Prefill],
    depths: Sequence[int],
    *,
    rows: int = 32,
    device="cpu",
    batch_size: int = 16,
    progress=None,
) -> dict:
    """{arm: {R: {"continuation_ppl", "tokens", "acc", "n", "bank_rel_err", "block_passes"}}}; "acc" is None
    without examples, "continuation_ppl" and "bank_rel_err" (`bank_error`) None when rows = 0."""
    table: dict = {}
    for arm in arms:
        table[arm.arm] = {}
        for r in depths:
            ppl = (
                cached_perplexity(
                    model, val, r, "terminal", max_sequences=rows, device=device, prefill=arm, prefilled_only=True
                )
                if rows > 0
                else None
            )
            acc = (
                exact_match_generator_tasks(model, tokenizer, examples, depth=r, prefill=arm, batch_size=batch_size)
                if examples
                else None
            )
            err = bank_error(model, val, arm, r, rows=rows, device=device) if rows > 0 else None
            table[arm.arm][r] = {
                "continuation_ppl": ppl["ppl"] if ppl else None,
                "tokens": ppl["tokens"] if ppl else 0,
                "acc": acc["acc"] if acc else None,
                "n": acc["n"] if acc else 0,
                "bank_rel_err": err,
                "block_passes": arm.block_passes(model.cfg, r),
            }
            if progress is not None:
                progress(r)
    return table


@torch.no_grad()
def bank_error(model, val, arm: Prefill, depth: int, *, rows: int = 16, device="cpu") -> float:
    """Relative error of the arm's core and coda terminal banks against teacher prefill at `depth`:
    sqrt(sum |dK|^2 + |dV|^2) / sqrt(sum |K|^2 + |V|^2) over the first half of each held-out row, each
    of its documents prefilled from its own start as real use does (prelude banks are the same in
    every arm), averaged over rows."""
    errs = []
    for i in range(min(rows, len(val))):
        b = val.get_batch([i]).to(device)
        half = max(1, b.inputs.shape[1] // 2)
        diff = norm = 0.0
        for start, end in document_segments(b.doc_ids[0, :half]):
            x = b.inputs[:, start:end]
            dtype = next(model.parameters()).dtype  # the banks hold what the model writes (bf16 too)
            ref_cache, arm_cache = (
                TerminalCache(model.cfg, 1, x.shape[1], device=device, dtype=dtype) for _ in range(2)
            )
            Prefill("teacher")(model, x, ref_cache, depth, example_ids=b.example_ids)
            arm(model, x, arm_cache, depth, example_ids=b.example_ids)
            for r, g in zip([*ref_cache.core, *ref_cache.coda], [*arm_cache.core, *arm_cache.coda]):
                diff += (g.k - r.k).double().pow(2).sum().item() + (g.v - r.v).double().pow(2).sum().item()
                norm += r.k.double().pow(2).sum().item() + r.v.double().pow(2).sum().item()
        errs.append(math.sqrt(diff / max(norm, 1e-30)))
    return sum(errs) / max(len(errs), 1)


def format_prefill_table(table: dict) -> str:
    """One row per (depth, arm): block passes per prompt token, bank error, continuation PPL, exact match (n)."""
    head = f"{'R':>4} {'prefill':>8} {'blocks':>7} {'bank err':>9} {'cont. ppl':>10} {'acc':>7} {'n':>5}"
    lines = [head, "-" * len(head)]
    depths = sorted({r for per_arm in table.values() for r in per_arm})
    for r in depths:
        for arm, per_depth in table.items():
            v = per_depth[r]
            ppl = f"{v['continuation_ppl']:>10.4f}" if v["continuation_ppl"] is not None else f"{'-':>10}"
            acc = f"{100 * v['acc']:>6.1f}%" if v["acc"] is not None else f"{'-':>7}"
            err = f"{v['bank_rel_err']:>9.4f}" if v.get("bank_rel_err") is not None else f"{'-':>9}"
            lines.append(f"{r:>4} {arm:>8} {v['block_passes']:>7} {err} {ppl} {acc} {v['n']:>5}")
    return "\n".join(lines)
