"""Exact-match accuracy on the generator's tasks versus depth.

The answer (with its closing newline) is scored teacher-forced: an example is correct when the
argmax at every answer position equals the answer token. With causal attention this equals
greedy decoding of the answer followed by the newline that ends it, so no cache is needed. It is
stricter than the report's generation section, which scores decoded text with `check_answer` (the
first line, whitespace stripped, no newline needed): the two accuracies can differ for that reason
as well as for the cache.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from looplm.data import Example, Tokenizer
from looplm.errors import UserError


def encode_examples(tokenizer: Tokenizer, examples: Sequence[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [N, L] right-padded, answer mask [N, L] marking positions whose *next* token is an answer token)."""
    rows, marks = [], []
    for ex in examples:
        p, a = tokenizer.encode_prompt(ex.prompt), tokenizer.encode(ex.answer + "\n")
        rows.append(p + a)
        marks.append([False] * (len(p) - 1) + [True] * len(a) + [False])
    L = max(len(r) for r in rows)
    tokens = torch.full((len(rows), L), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.bool)
    for i, (r, m) in enumerate(zip(rows, marks)):
        tokens[i, : len(r)] = torch.tensor(r)
        mask[i, : len(m)] = torch.tensor(m)
    return tokens, mask


@torch.no_grad()
def task_accuracy(
    model,
    tokenizer: Tokenizer,
    examples: Sequence[Example],
    depths: Sequence[int],
    *,
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    progress=None,
) -> dict[int, dict]:
    """{depth: {"acc", "n", "by_kind": {kind: acc}, "by_difficulty": {k: acc}}}."""
    if not examples:
        raise UserError("no task examples to evaluate")
    tokens, mask = encode_examples(tokenizer, examples)
    max_len = model.cfg.max_seq_len
    if tokens.shape[1] > max_len:
        raise UserError(f"task examples need {tokens.shape[1]} tokens, the model context is {max_len}")
    results = {}
    for depth in depths:
        correct = torch.zeros(len(examples), dtype=torch.bool)
        for start in range(0, len(examples), batch_size):
            sl = slice(start, start + batch_size)
            x, m = tokens[sl].to(device), mask[sl].to(device)
            ids = torch.arange(start, start + x.shape[0], device=device)
            logits = model(x, depth, init="seeded", example_ids=ids).logits
            hit = logits.argmax(-1)[:, :-1] == x[:, 1:]
            correct[sl] = (hit | ~m[:, :-1]).all(-1).cpu()
            if progress is not None:
                progress(depth)
        by_kind, by_diff = defaultdict(list), defaultdict(list)
        for ex, ok in zip(examples, correct.tolist()):
            by_kind[ex.kind].append(ok)
            by_diff[ex.difficulty].append(ok)
        results[depth] = {
            "acc": float(correct.float().mean()),
            "n": len(examples),
            "by_kind": {k: sum(v) / len(v) for k, v in sorted(by_kind.items())},
            "by_difficulty": {k: sum(v) / len(v) for k, v in sorted(by_diff.items())},
        }
    return results
