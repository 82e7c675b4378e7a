"""Procedural depth-sensitive tasks with verifiable answers.

Each task needs a number of sequential reasoning steps that grows with ``difficulty``,
so a looped model should benefit from more recurrences on harder instances.
Formats are terse to keep sequences short (byte-tokenizer friendly):

* ``chain``  -- variable binding through ``k`` alias hops, statements shuffled:
  ``"c=7;a=c;x=4;q=a;?q="`` -> ``"7"``.
* ``add``    -- addition of two ``k``-digit numbers; the answer is written
  **reversed** (least significant digit first) so the carry chain is produced in
  output order: ``"+357,486="`` -> ``"348"`` (357 + 486 = 843).
* ``sum``    -- sum mod 10 of ``2k`` digits: ``"%3141="`` -> ``"9"`` (difficulty 2).

All generation is driven by an explicit :class:`random.Random`; the global RNG is never used.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from looplm.errors import UserError


@dataclass(frozen=True)
class Example:
    """One task instance: the model sees ``prompt`` and must produce ``answer``."""

    prompt: str
    answer: str
    kind: str
    difficulty: int

    @property
    def text(self) -> str:
        """Training text: prompt, answer and a terminating newline."""
        return self.prompt + self.answer + "\n"


_LETTERS = string.ascii_lowercase
MAX_CHAIN_HOPS = 12  # root + hops + as many distractors must fit in 26 letters
DEFAULT_TASK_EXAMPLES = 200_000
"""Training examples drawn from the generator for source 'tasks' when nothing else is said: the one
default of training (DataConfig), the caches (looplm.data.packing) and `looplm tokenize`."""


def make_chain(rng: random.Random, difficulty: int) -> Example:
    """Variable-binding chain with ``difficulty`` alias hops and ``difficulty`` distractors."""
    k = difficulty
    if not 1 <= k <= MAX_CHAIN_HOPS:
        raise UserError(f"chain difficulty must be in [1, {MAX_CHAIN_HOPS}], got {k}")
    names = rng.sample(_LETTERS, 2 * k + 1)
    chain, distractors = names[: k + 1], names[k + 1 :]
    value = rng.randrange(10)
    statements = [f"{chain[0]}={value}"]
    statements += [f"{chain[i]}={chain[i - 1]}" for i in range(1, k + 1)]
    # Distractors form their own little alias trees so aliasing alone does not give
    # away which variables belong to the queried chain.
    for i, name in enumerate(distractors):
        if i > 0 and rng.random() < 0.5:
            statements.append(f"{name}={distractors[rng.randrange(i)]}")
        else:
            statements.append(f"{name}={rng.randrange(10)}")
    rng.shuffle(statements)
    prompt = ";".join(statements) + f";?{chain[-1]}="
    return Example(prompt, str(value), "chain", k)


def make_add(rng: random.Random, difficulty: int) -> Example:
    """Sum of two ``difficulty``-digit numbers, answer digits reversed."""
    k = difficulty
    if k < 1:
        raise UserError(f"add difficulty must be >= 1, got {k}")
    lo = 0 if k == 1 else 10 ** (k - 1)
    a, b = rng.randrange(lo, 10**k), rng.randrange(lo, 10**k)
    return Example(f"+{a},{b}=", str(a + b)[::-1], "add", k)


def make_add_msd(rng: random.Random, difficulty: int) -> Example:
    """Sum of two ``difficulty``-digit numbers, answer most-significant digit first: the first
    answer digit already depends on the whole carry chain, so it cannot be read off locally."""
    k = difficulty
    if k < 1:
        raise UserError(f"add_msd difficulty must be >= 1, got {k}")
    lo = 0 if k == 1 else 10 ** (k - 1)
    a, b = rng.randrange(lo, 10**k), rng.randrange(lo, 10**k)
    return Example(f"+{a},{b}=", str(a + b), "add_msd", k)


def make_sum(rng: random.Random, difficulty: int) -> Example:
    """Sum modulo 10 of ``2 * difficulty`` random digits (a running-state task)."""
    k = difficulty
    if k < 1:
        raise UserError(f"sum difficulty must be >= 1, got {k}")
    digits = [rng.randrange(10) for _ in range(2 * k)]
    return Example("%" + "".join(map(str, digits)) + "=", str(sum(digits) % 10), "sum", k)


TASKS: dict[str, Callable[[random.Random, int], Example]] = {
    "chain": make_chain,
    "add": make_add,
    "add_msd": make_add_msd,
    "sum": make_sum,
}


TaskKind = Literal["chain", "add", "add_msd", "sum"]
TASK_KINDS: tuple[str, ...] = get_args(TaskKind)
"""The generator's task kinds (the keys of TASKS)."""


@dataclass(frozen=True)
class TaskConfig:
    """Which tasks to generate and at which difficulties."""

    kinds: tuple[TaskKind, ...] = ("chain", "add", "sum")
    """Tasks, used round-robin: chain (variable binding through k alias hops), add (sum of two k-digit numbers,
    answer least-significant digit first), add_msd (the same sum, most-significant digit first), sum (sum mod 10
    of 2k digits)."""
    min_difficulty: int = 1
    """Smallest difficulty k (inclusive); the same range applies to every kind."""
    max_difficulty: int = 6
    """Largest difficulty k (inclusive); chain allows at most 12."""

    def validate(self) -> None:
        """Raise ``ValueError`` on unknown kinds or an empty difficulty range."""
        if not self.kinds:
            raise UserError("TaskConfig.kinds is empty")
        for kind in self.kinds:
            get_task(kind)
        if not 1 <= self.min_difficulty <= self.max_difficulty:
            raise UserError(
                f"need 1 <= min_difficulty <= max_difficulty, got {self.min_difficulty}..{self.max_difficulty}"
            )


def get_task(kind: str) -> Callable[[random.Random, int], Example]:
    """Look up a task generator by name."""
    try:
        return TASKS[kind]
    except KeyError:
        raise UserError(f"unknown task kind {kind!r}; known kinds: {sorted(TASKS)}") from None


def generate_examples(config: TaskConfig, n: int, seed: int) -> list[Example]:
    """``n`` examples, kinds round-robin, difficulty uniform in the configured range."""
    config.validate()
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = config.kinds[i % len(config.kinds)]
        difficulty = rng.randint(config.min_difficulty, config.max_difficulty)
        out.append(TASKS[kind](rng, difficulty))
    return out


def check_answer(example: Example, output: str) -> bool:
    """True iff the first line of ``output`` is exactly the expected answer."""
    return output.split("\n", 1)[0].strip() == example.answer
