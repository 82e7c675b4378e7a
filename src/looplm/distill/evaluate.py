"""Evaluating a distilled student against the other prefill arms on its teacher's data (the
comparison `looplm distill` prints when it ends), with `looplm.eval.prefill_arms`."""

from __future__ import annotations

from looplm.data.record import DataRecord
from looplm.eval.prefill_arms import prefill_table
from looplm.eval.report import EvalConfig
from looplm.infer.prefill import Prefill


def arms_after_distill(
    model, tokenizer, data: DataRecord, val, student, depth: int, *, rows: int, n_examples: int, device="cpu"
) -> dict:
    """The Table-5 comparison `looplm distill` prints when it ends: teacher, student, r1 and r2 at `depth`
    on held-out rows `val` of the teacher's data (`data`, its data record) and fresh generator examples."""
    examples = data.held_out_examples(n_examples, EvalConfig.task_seed) if data.is_tasks and n_examples > 0 else []
    arms = [Prefill("teacher"), Prefill("student", student), Prefill("r1"), Prefill("r2")]
    return prefill_table(model, tokenizer, val, examples, arms, (depth,), rows=rows, device=device)
