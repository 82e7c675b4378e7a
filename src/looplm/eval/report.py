"""The depth report: native perplexity and task accuracy against test-time depth, as one table."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from looplm.data import TaskConfig, build_datasets, generate_examples
from looplm.eval.cached import sharing_table
from looplm.eval.perplexity import native_perplexity
from looplm.eval.tasks import task_accuracy


@dataclass
class EvalConfig:
    """What `looplm eval` (and the end of `looplm train`) measures."""

    depths: tuple[int, ...] = (1, 2, 3, 5, 8, 16, 32)
    """Test-time recurrence counts R to evaluate."""
    max_sequences: int = 64
    """Held-out sequences for native perplexity."""
    task_examples: int = 600
    """Fresh generator examples for exact-match accuracy (0 skips; needs a task-trained model)."""
    task_seed: int = 1234
    """Seed of the evaluation examples (prompts seen in training are dropped)."""
    batch_size: int = 32
    """Sequences per forward pass."""
    sharing_sequences: int = 32
    """Held-out rows for terminal-KV vs full-KV perplexity and the sharing penalty (0 skips)."""
    output: Path | None = None
    """Write the report as JSON here (default: <run>/eval.json next to the checkpoint's run)."""


def held_out_examples(tasks: TaskConfig, n: int, seed: int, n_train: int, train_seed: int):
    """`n` fresh examples whose prompts do not occur in the training set."""
    seen = {ex.prompt for ex in generate_examples(tasks, n_train, train_seed)}
    return [ex for ex in generate_examples(tasks, n, seed) if ex.prompt not in seen]


def depth_report(model, tokenizer, job: dict, cfg: EvalConfig, device="cpu", progress=None) -> dict:
    """{"perplexity": {R: ...}, "tasks": {R: ...} or None} for a trained model and its job config."""
    data = job["data"]
    tasks = TaskConfig(**{**data["tasks"], "kinds": tuple(data["tasks"]["kinds"])})
    _, val = build_datasets(
        data["source"], tokenizer, seq_len=data["seq_len"], holdout=data["holdout"], cache_dir=Path(data["cache_dir"]),
        text_field=data["text_field"], task_config=tasks, n_task_examples=data["n_task_examples"],
        seed=job["train"]["seed"],
    )
    ppl = native_perplexity(model, val, cfg.depths, batch_size=cfg.batch_size, max_sequences=cfg.max_sequences,
                            device=device, progress=progress)
    acc = None
    if data["source"] == "tasks" and cfg.task_examples > 0:
        examples = held_out_examples(tasks, cfg.task_examples, cfg.task_seed, data["n_task_examples"], job["train"]["seed"])
        acc = task_accuracy(model, tokenizer, examples, cfg.depths, batch_size=cfg.batch_size, device=device,
                            progress=progress)
    sharing = None
    if cfg.sharing_sequences > 0:
        sharing = sharing_table(model, val, cfg.depths, max_sequences=cfg.sharing_sequences, device=device,
                                progress=progress)
    return {"perplexity": ppl, "tasks": acc, "sharing": sharing}


def format_report(report: dict) -> str:
    """A plain-text table: one row per depth."""
    ppl, acc = report["perplexity"], report["tasks"]
    kinds = list(next(iter(acc.values()))["by_kind"]) if acc else []
    head = f"{'R':>4} {'val ppl':>9} {'dstate':>8}" + (f" {'acc':>7}" + "".join(f" {k:>7}" for k in kinds) if acc else "")
    lines = [head, "-" * len(head)]
    for depth, p in ppl.items():
        dstate = f"{p['state_change']:>8.4f}" if p.get("state_change") is not None else f"{'-':>8}"
        row = f"{depth:>4} {p['ppl']:>9.4f} {dstate}"
        if acc:
            a = acc[depth]
            row += f" {100 * a['acc']:>6.1f}%" + "".join(f" {100 * a['by_kind'][k]:>6.1f}%" for k in kinds)
        lines.append(row)
    if report.get("sharing"):
        sh = report["sharing"]
        n = next(iter(sh.values()))["tokens"]
        lines += ["", f"terminal-KV sharing (prefill to each row's midpoint, score the rest of that document; {n} tokens;",
                  "chunk = one parallel pass, decode = teacher-forced one-token decoding as in CacheEval):",
                  f"{'R':>4} {'full':>9} {'terminal':>9} {'penalty':>9} {'decode':>9} {'penalty':>9}"]
        lines += [f"{r:>4} {v['full_ppl']:>9.4f} {v['terminal_ppl']:>9.4f} {v['sharing_penalty']:>8.3f}% "
                  f"{v['cacheeval_terminal_ppl']:>9.4f} {v['cacheeval_penalty']:>8.3f}%" for r, v in sh.items()]
    return "\n".join(lines)


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
