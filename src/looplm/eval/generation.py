"""Generation tasks scored by exact match (design §8, "Generation").

Greedy decoding with a KV cache (terminal by default) and stop strings. The seeded initial state
uses each example's index in the evaluated list as its example id (as `task_accuracy` does), so a
result does not depend on the batch size. Also: GSM8K-style final-number matching and pass@k.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

from looplm.errors import UserError
from looplm.eval.records import read_records
from looplm.data import Example, Tokenizer
from looplm.data.tasks import check_answer
from looplm.infer.generate import DepthRule, SamplingConfig, generate
from looplm.infer.prefill import Prefill


@dataclass(frozen=True)
class GenItem:
    """One GSM8K-style problem: `gold` is the normalised final number of `answer`."""

    question: str
    answer: str
    gold: str


# a comma-grouped number (1,234,567.5), a plain one (-3, 3.50) or a bare fraction (.5, -.25)
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")


def normalize_number(text: str) -> str | None:
    """'1,234' -> '1234', '3.50' -> '3.5', '2.0' -> '2', '-0' -> '0'; None when not a number."""
    try:
        d = Decimal(text.strip().replace(",", ""))
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def extract_final_number(text: str) -> str | None:
    """The final answer in `text`, normalised (see `normalize_number`), or None: the first number after
    the last '####' when there is one (GSM8K's answer mark, which text after it must not override),
    else the last number."""
    if "####" in text:
        found = _NUMBER.findall(text.rsplit("####", 1)[1])
        if found:
            return normalize_number(found[0])
    found = _NUMBER.findall(text)
    return normalize_number(found[-1]) if found else None


GSM8K_PROMPT = "Question: {question}\nAnswer:"  # what exact_match_gsm8k prompts with by default


def load_gsm8k_jsonl(path: str | Path) -> list[GenItem]:
    """Read lines {"question": str, "answer": str}; the gold is the number after the last '####'."""
    items = []
    for where, row in read_records(path, ("question", "answer")):
        for key in ("question", "answer"):
            if not isinstance(row[key], str):
                raise UserError(f"{where}: {key!r} must be a string")
        if "####" not in row["answer"]:
            raise UserError(f"{where}: 'answer' has no '#### <number>' final answer")
        raw = row["answer"].rsplit("####", 1)[1]
        found = _NUMBER.findall(raw)  # the number after the mark, read as a model's answer is read
        gold = normalize_number(found[0]) if found else None
        if gold is None:
            raise UserError(f"{where}: final answer {raw.strip()!r} after '####' is not a number")
        items.append(GenItem(row["question"], row["answer"], gold))
    return items


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def greedy_generate(
    model,
    tokenizer: Tokenizer,
    prompts: Sequence[str | Sequence[int]],
    example_ids: Sequence[int],
    *,
    depth: int,
    prefill_depth: int | None = None,
    cache: str = "terminal",
    max_new_tokens: int = 16,
    stop: Sequence[str] = ("\n",),
    prefill: Prefill | None = None,
) -> list[str]:
    """Greedy continuations (cut before the first stop string; EOS ends a row), each row seeded by
    its own example id so results do not depend on batching; `prefill` picks the prefill arm."""
    return generate(
        model,
        tokenizer,
        prompts,
        DepthRule(depth, prefill_depth),
        cache=cache,
        sampling=SamplingConfig(max_new_tokens=max_new_tokens, stop=tuple(stop)),
        example_ids=example_ids,
        prefill=prefill,
    )


def _batched(model, tokenizer, prompts, batch_size, **kw) -> list[str]:
    if batch_size < 1:
        raise UserError(f"batch_size must be >= 1, got {batch_size}")
    outputs = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        outputs += greedy_generate(model, tokenizer, chunk, range(start, start + len(chunk)), **kw)
    return outputs


def exact_match_generator_tasks(
    model,
    tokenizer: Tokenizer,
    examples: Sequence[Example],
    *,
    depth: int,
    prefill_depth: int | None = None,
    cache: str = "terminal",
    max_new_tokens: int = 16,
    batch_size: int = 16,
    prefill: Prefill | None = None,
) -> dict:
    """Greedy-generate after each prompt (stop at a newline); correct = `check_answer`.

    Returns {"acc", "n", "by_kind": {kind: acc}, "correct": [bool], "outputs": [str]}. `prefill`
    picks the prefill arm (`looplm.infer.prefill`; default: the model at prefill_depth).
    """
    if not examples:
        raise UserError("no task examples to evaluate")
    outputs = _batched(
        model,
        tokenizer,
        [ex.prompt for ex in examples],
        batch_size,
        depth=depth,
        prefill_depth=prefill_depth,
        cache=cache,
        max_new_tokens=max_new_tokens,
        stop=("\n",),
        prefill=prefill,
    )
    correct = [check_answer(ex, out) for ex, out in zip(examples, outputs)]
    by_kind = defaultdict(list)
    for ex, ok in zip(examples, correct):
        by_kind[ex.kind].append(ok)
    return {
        "acc": sum(correct) / len(correct),
        "n": len(examples),
        "by_kind": {k: sum(v) / len(v) for k, v in sorted(by_kind.items())},
        "correct": correct,
        "outputs": outputs,
    }


def exact_match_gsm8k(
    model,
    tokenizer: Tokenizer,
    items: Sequence[GenItem],
    *,
    depth: int,
    prefill_depth: int | None = None,
    cache: str = "terminal",
    max_new_tokens: int = 256,
    prompt_template: str = GSM8K_PROMPT,
    stop: Sequence[str] = ("\n\n", "Question:"),
    batch_size: int = 8,
) -> dict:
    """Greedy-generate an answer per question; correct when its final number equals the gold.

    Returns {"acc", "n", "correct": [bool], "predictions": [str | None], "outputs": [str]}.
    """
    if not items:
        raise UserError("no GSM8K items to evaluate")
    prompts = [prompt_template.format(question=it.question) for it in items]
    outputs = _batched(
        model,
        tokenizer,
        prompts,
        batch_size,
        depth=depth,
        prefill_depth=prefill_depth,
        cache=cache,
        max_new_tokens=max_new_tokens,
        stop=tuple(stop),
    )
    preds = [extract_final_number(o) for o in outputs]
    correct = [p is not None and p == it.gold for p, it in zip(preds, items)]
    return {
        "acc": sum(correct) / len(correct),
        "n": len(items),
        "correct": correct,
        "predictions": preds,
        "outputs": outputs,
    }
