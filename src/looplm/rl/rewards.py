"""Verifiable problems for RL and pluggable reward functions (design §10).

A `Problem` is a prompt and the reference its completions are checked against: a generator
`Example` (data/tasks.py) or a GSM8K-format `GenItem` (eval/generation.py). A reward function maps
(reference, completion text cut before its stop string) to a float; 1.0 means correct (pass@1
counts completions with reward >= 1). Answers are checked exactly as `looplm eval` checks them.
Register more with `register_reward`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from looplm.data import Example, TaskConfig, check_answer, generate_examples
from looplm.errors import UserError
from looplm.eval.generation import GenItem, extract_final_number, load_gsm8k_jsonl

RewardFn = Callable[[object, str], float]


@dataclass(frozen=True)
class Problem:
    prompt: str
    reference: Example | GenItem


def exact_answer(reference: Example, completion: str) -> float:
    """Generator tasks: 1 when the first line is exactly the answer (as `looplm eval` scores it)."""
    return float(check_answer(reference, completion))


def answer_digits(reference: Example, completion: str) -> float:
    """Generator tasks, partial credit: the fraction of answer characters matched in place, minus
    the share of extra characters; 1 only for an exact answer."""
    got, want = completion.split("\n", 1)[0].strip(), reference.answer
    hits = sum(a == b for a, b in zip(got, want))
    return max(0.0, (hits - max(0, len(got) - len(want))) / len(want))


def final_number(reference: GenItem, completion: str) -> float:
    """GSM8K format: 1 when the completion's last number equals the gold final number."""
    return float(extract_final_number(completion) == reference.gold)


REWARDS: dict[str, RewardFn] = {"exact": exact_answer, "digits": answer_digits, "final_number": final_number}
_READS: dict[RewardFn, type] = {exact_answer: Example, answer_digits: Example, final_number: GenItem}
"""The reference each built-in reward reads: a generator example, or a GSM8K item."""


def register_reward(name: str, fn: RewardFn) -> None:
    """Make `fn(reference, completion) -> float` selectable by name (e.g. `looplm rl --reward NAME`)."""
    REWARDS[name] = fn


def get_reward(name: str, source: str) -> RewardFn:
    """The reward called `name`; "auto" is exact match for generator tasks, final number for GSM8K."""
    if name == "auto":
        name = "exact" if source == "tasks" else "final_number"
    if name not in REWARDS:
        raise UserError(f"unknown reward {name!r}; known rewards: {', '.join(sorted(REWARDS))}")
    fn, gives = REWARDS[name], Example if source == "tasks" else GenItem
    reads = _READS.get(fn)  # None for a registered reward: it knows its references
    if reads is not None and reads is not gives:
        fits = sorted(n for n, f in REWARDS.items() if _READS.get(f) is gives)
        raise UserError(
            f"reward {name!r} checks {'generator tasks' if reads is Example else 'GSM8K answers'}, "
            f"not the problems of {source!r}: use {' or '.join(fits)} (or auto)"
        )
    return fn


class ProblemSource:
    """Prompts per RL step: fresh generator examples, or a seeded walk over GSM8K-format items.
    Draws are pure functions of (seed, step), so a resumed run sees the same prompts."""

    def __init__(
        self,
        source: str,
        *,
        tasks: TaskConfig | None = None,
        prompt_template: str = "Question: {question}\nAnswer:",
        seed: int = 0,
    ):
        self.source, self.tasks, self.template, self.seed = source, tasks, prompt_template, seed
        if source == "tasks":
            if tasks is None:
                raise UserError("the task source needs a TaskConfig")
            tasks.validate()
            self.items = None
        else:
            path = Path(source)
            if not path.is_file():
                raise UserError(f"problem source {source!r} is neither 'tasks' nor a GSM8K-format JSONL file")
            self.items = load_gsm8k_jsonl(path)
            if not self.items:
                raise UserError(f"{source} holds no problems")

    def problem(self, reference: Example | GenItem) -> Problem:
        if isinstance(reference, Example):
            return Problem(reference.prompt, reference)
        return Problem(self.template.format(question=reference.question), reference)

    def draw(self, step: int, n: int) -> list[Problem]:
        if self.items is None:  # seeds far from the pretraining corpus's (train.seed) draw
            return [
                self.problem(ex) for ex in generate_examples(self.tasks, n, seed=1_000_003 * (self.seed + 1) + step)
            ]
        per_epoch = len(self.items)
        out = []
        for k in range(step * n, (step + 1) * n):
            epoch, i = divmod(k, per_epoch)
            order = list(range(per_epoch))
            random.Random(self.seed * 7919 + epoch).shuffle(order)
            out.append(self.problem(self.items[order[i]]))
        return out
