"""Evaluating a distilled student against the other prefill arms on its teacher's data (the
comparison `looplm distill` prints when it ends), with `looplm.eval.prefill_arms`."""

from __future__ import annotations

from pathlib import Path

from looplm.data import build_datasets
from looplm.eval.prefill_arms import prefill_table
from looplm.eval.report import EvalConfig, held_out_examples, job_tasks
from looplm.infer.prefill import Prefill


def teacher_data(job: dict, tokenizer, seq_len: int | None = None):
    """(train, held-out) PackedDatasets of the data a teacher checkpoint's job trained on, cut into
    rows of `seq_len` tokens (default: the job's)."""
    data = job["data"]
    return build_datasets(data["source"], tokenizer, seq_len=seq_len or data["seq_len"], holdout=data["holdout"],
                          cache_dir=Path(data["cache_dir"]), text_field=data["text_field"], task_config=job_tasks(job),
                          n_task_examples=data["n_task_examples"], seed=job["train"]["seed"])


def arms_after_distill(model, tokenizer, job: dict, val, student, depth: int, *, rows: int, n_examples: int,
                       device="cpu") -> dict:
    """The Table-5 comparison `looplm distill` prints when it ends: teacher, student, r1 and r2 at `depth`
    on held-out rows of the teacher's data and fresh generator examples."""
    data = job["data"]
    examples = []
    if data["source"] == "tasks" and n_examples > 0:
        examples = held_out_examples(job_tasks(job), n_examples, EvalConfig.task_seed, data["n_task_examples"],
                                     job["train"]["seed"])
    arms = [Prefill("teacher"), Prefill("student", student), Prefill("r1"), Prefill("r2")]
    return prefill_table(model, tokenizer, val, examples, arms, (depth,), rows=rows, device=device)
