"""Quality of each prefill arm (the paper's Table 5): teacher prefill, distilled prefill, R = 1 and R = 2.

Decoding is the same for every arm (the teacher at depth R with the terminal cache); only the way
the prompt enters the cache differs (`looplm.infer.prefill`). Per arm and depth:
- continuation perplexity: prefill each held-out row's midpoint document up to the midpoint with
  the arm, score the rest of that document at R as one chunk (`cached_perplexity`);
- generator-task exact match: prefill the prompt with the arm, then greedy decoding at R;
- bank error: how far the arm's terminal banks are from those of teacher prefill at R.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from looplm.eval.cached import cached_perplexity
from looplm.eval.generation import exact_match_generator_tasks
from looplm.infer.cache import TerminalCache
from looplm.infer.prefill import Prefill


def prefill_table(model, tokenizer, val, examples: Sequence, arms: Sequence[Prefill], depths: Sequence[int], *,
                  rows: int = 32, device="cpu", batch_size: int = 16, progress=None) -> dict:
    """{arm: {R: {"continuation_ppl", "tokens", "acc", "n", "bank_rel_err", "block_passes"}}}; "acc" is None
    without examples, "continuation_ppl" and "bank_rel_err" (`bank_error`) None when rows = 0."""
    table: dict = {}
    for arm in arms:
        table[arm.arm] = {}
        for r in depths:
            ppl = cached_perplexity(model, val, r, "terminal", max_sequences=rows, device=device,
                                    prefill=arm) if rows > 0 else None
            acc = exact_match_generator_tasks(model, tokenizer, examples, depth=r, prefill=arm,
                                              batch_size=batch_size) if examples else None
            err = bank_error(model, val, arm, r, rows=rows, device=device) if rows > 0 else None
            table[arm.arm][r] = {"continuation_ppl": ppl["ppl"] if ppl else None, "tokens": ppl["tokens"] if ppl else 0,
                                 "acc": acc["acc"] if acc else None, "n": acc["n"] if acc else 0,
                                 "bank_rel_err": err, "block_passes": arm.block_passes(model.cfg, r)}
            if progress is not None:
                progress()
    return table


@torch.no_grad()
def bank_error(model, val, arm: Prefill, depth: int, *, rows: int = 16, device="cpu") -> float:
    """Relative error of the arm's core and coda terminal banks against teacher prefill at `depth`:
    sqrt(sum |dK|^2 + |dV|^2) / sqrt(sum |K|^2 + |V|^2) over the first half of each held-out row
    (prelude banks are the same in every arm), averaged over rows."""
    errs = []
    for i in range(min(rows, len(val))):
        b = val.get_batch([i]).to(device)
        x = b.inputs[:, : max(1, b.inputs.shape[1] // 2)]
        ref, got = (TerminalCache(model.cfg, 1, x.shape[1], device=device) for _ in range(2))
        Prefill("teacher")(model, x, ref, depth, example_ids=b.example_ids)
        arm(model, x, got, depth, example_ids=b.example_ids)
        diff = norm = 0.0
        for r, g in zip([*ref.core, *ref.coda], [*got.core, *got.coda]):
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


def teacher_data(job: dict, tokenizer, seq_len: int | None = None):
    """(train, held-out) PackedDatasets of the data a teacher checkpoint's job trained on, cut into
    rows of `seq_len` tokens (default: the job's)."""
    from looplm.data import build_datasets
    from looplm.eval.report import job_tasks

    data = job["data"]
    return build_datasets(data["source"], tokenizer, seq_len=seq_len or data["seq_len"], holdout=data["holdout"],
                          cache_dir=Path(data["cache_dir"]), text_field=data["text_field"], task_config=job_tasks(job),
                          n_task_examples=data["n_task_examples"], seed=job["train"]["seed"])


def build_arms(model, names: Sequence[str], student_path=None) -> list[Prefill]:
    """Prefill arms by name for `model`; the student arm loads `student_path` (refused if it was
    distilled from another teacher)."""
    student = None
    if "student" in names:
        if student_path is None:
            raise ValueError("--prefill student needs --student PATH (a `looplm distill` checkpoint or run folder)")
        from looplm.distill.checkpoint import load_student

        student, _ = load_student(student_path, model)
    return [Prefill(name, student if name == "student" else None) for name in dict.fromkeys(names)]


def arms_after_distill(model, tokenizer, job: dict, val, student, depth: int, *, rows: int, n_examples: int,
                       device="cpu") -> dict:
    """The Table-5 comparison `looplm distill` prints when it ends: teacher, student, r1 and r2 at `depth`
    on held-out rows of the teacher's data and fresh generator examples."""
    from looplm.eval.report import EvalConfig, held_out_examples, job_tasks

    data = job["data"]
    examples = []
    if data["source"] == "tasks" and n_examples > 0:
        examples = held_out_examples(job_tasks(job), n_examples, EvalConfig.task_seed, data["n_task_examples"],
                                     job["train"]["seed"])
    arms = [Prefill("teacher"), Prefill("student", student), Prefill("r1"), Prefill("r2")]
    return prefill_table(model, tokenizer, val, examples, arms, (depth,), rows=rows, device=device)
