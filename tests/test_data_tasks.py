"""Tests for looplm.data.tasks: answers checked against independent reference solvers."""

from __future__ import annotations

import random
import re

import pytest

from looplm.data import TASKS, Example, TaskConfig, check_answer, generate_examples


def solve_chain(prompt: str) -> tuple[str, int]:
    """Resolve the queried variable by repeated lookup; return (value, hops)."""
    body, query = prompt.split(";?")
    assert query.endswith("=")
    env = dict(stmt.split("=") for stmt in body.split(";"))
    assert len(env) == len(body.split(";")), "each variable assigned once"
    name, hops = query[:-1], 0
    while not env[name].isdigit():
        name, hops = env[name], hops + 1
    return env[name], hops


def solve_add(prompt: str) -> str:
    m = re.fullmatch(r"\+(\d+),(\d+)=", prompt)
    assert m
    return str(int(m.group(1)) + int(m.group(2)))[::-1]


def solve_sum(prompt: str) -> str:
    m = re.fullmatch(r"%(\d+)=", prompt)
    assert m
    total = 0
    for ch in m.group(1):
        total = (total + int(ch)) % 10
    return str(total)


@pytest.mark.parametrize("difficulty", range(1, 9))
def test_chain_answers_and_hops(difficulty: int) -> None:
    rng = random.Random(difficulty)
    for _ in range(50):
        ex = TASKS["chain"](rng, difficulty)
        value, hops = solve_chain(ex.prompt)
        assert ex.answer == value
        assert hops == difficulty
        names = re.findall(r"[a-z]", ex.prompt.split(";?")[0].replace("=", " "))
        assert all(len(n) == 1 for n in names)


def test_chain_statements_are_shuffled() -> None:
    rng = random.Random(0)
    in_order = 0
    for _ in range(50):
        ex = TASKS["chain"](rng, 5)
        root = next(s for s in ex.prompt.split(";") if re.fullmatch(r"[a-z]=\d", s) and ex.answer in s)
        in_order += ex.prompt.startswith(root)
    assert in_order < 50


@pytest.mark.parametrize("difficulty", range(1, 8))
def test_add_answers(difficulty: int) -> None:
    rng = random.Random(difficulty)
    for _ in range(50):
        ex = TASKS["add"](rng, difficulty)
        assert ex.answer == solve_add(ex.prompt)
        a, b = ex.prompt[1:-1].split(",")
        assert len(a) == len(b) == difficulty


@pytest.mark.parametrize("difficulty", range(1, 8))
def test_add_msd_answers(difficulty: int) -> None:
    rng = random.Random(100 + difficulty)
    for _ in range(50):
        ex = TASKS["add_msd"](rng, difficulty)
        a, b = ex.prompt[1:-1].split(",")
        assert ex.answer == solve_add(ex.prompt)[::-1]  # same sum, most-significant digit first
        assert int(ex.answer) == int(a) + int(b) and len(a) == len(b) == difficulty


def test_add_answer_is_reversed() -> None:
    ex = Example("+357,486=", "348", "add", 3)
    assert solve_add(ex.prompt) == ex.answer


@pytest.mark.parametrize("difficulty", range(1, 8))
def test_sum_answers(difficulty: int) -> None:
    rng = random.Random(difficulty)
    for _ in range(50):
        ex = TASKS["sum"](rng, difficulty)
        assert ex.answer == solve_sum(ex.prompt)
        assert len(ex.prompt) == 2 * difficulty + 2


def test_generate_is_deterministic_and_valid() -> None:
    cfg = TaskConfig(min_difficulty=1, max_difficulty=6)
    a = generate_examples(cfg, 300, seed=7)
    assert a == generate_examples(cfg, 300, seed=7)
    assert a != generate_examples(cfg, 300, seed=8)
    assert {ex.kind for ex in a} == set(cfg.kinds)
    assert {ex.difficulty for ex in a} == set(range(1, 7))
    solvers = {"chain": lambda p: solve_chain(p)[0], "add": solve_add, "sum": solve_sum}
    for ex in a:
        assert ex.answer == solvers[ex.kind](ex.prompt)
        assert ex.text == ex.prompt + ex.answer + "\n"
        assert check_answer(ex, ex.answer + "\nmore text")


def test_global_rng_untouched() -> None:
    random.seed(123)
    expected = random.random()
    random.seed(123)
    generate_examples(TaskConfig(), 50, seed=1)
    assert random.random() == expected


def test_difficulty_increases_length() -> None:
    for kind in TASKS:
        lengths = []
        for d in (1, 3, 6):
            exs = generate_examples(TaskConfig(kinds=(kind,), min_difficulty=d, max_difficulty=d), 20, seed=0)
            lengths.append(sum(len(e.text) for e in exs))
        assert lengths[0] < lengths[1] < lengths[2], kind


def test_check_answer() -> None:
    ex = Example("+1,2=", "3", "add", 1)
    assert check_answer(ex, "3")
    assert check_answer(ex, "3\n+4,5=9")
    assert not check_answer(ex, "30")
    assert not check_answer(ex, "")


def test_unknown_kind_lists_known() -> None:
    with pytest.raises(ValueError, match="chain"):
        generate_examples(TaskConfig(kinds=("nope",)), 1, seed=0)
    with pytest.raises(ValueError):
        generate_examples(TaskConfig(min_difficulty=3, max_difficulty=2), 1, seed=0)


def test_one_digit_additions_draw_every_digit_including_zero() -> None:
    """One-digit operands are 0..9; k-digit
    ones (k > 1) have no leading zero, 10^(k-1)..10^k - 1."""
    rng = random.Random(0)
    ones = [ex.prompt[1:-1].split(",") for ex in (TASKS["add"](rng, 1) for _ in range(400))]
    assert {int(x) for pair in ones for x in pair} == set(range(10))
    threes = [ex.prompt[1:-1].split(",") for ex in (TASKS["add"](rng, 3) for _ in range(400))]
    assert all(100 <= int(x) <= 999 for pair in threes for x in pair)


def test_chain_distractors_never_alias_the_queried_chain() -> None:
    """Distractors alias only other distractors (or hold a digit): a statement outside the chain
    never names a chain variable."""
    rng = random.Random(0)
    for _ in range(200):
        ex = TASKS["chain"](rng, 6)
        body, query = ex.prompt.split(";?")
        env = dict(stmt.split("=") for stmt in body.split(";"))
        chain, name = {query[:-1]}, query[:-1]
        while not env[name].isdigit():
            name = env[name]
            chain.add(name)
        assert not any(v in chain for k, v in env.items() if k not in chain), ex.prompt


def test_one_digit_msd_additions_draw_zero_too() -> None:
    """add_msd draws its operands like add: 0..9 for k=1."""
    rng = random.Random(0)
    ones = [ex.prompt[1:-1].split(",") for ex in (TASKS["add_msd"](rng, 1) for _ in range(400))]
    assert {int(x) for pair in ones for x in pair} == set(range(10))
