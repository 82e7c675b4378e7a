"""Multiple-choice scoring by cached decoding (design §8, "Choice tasks").

lm-eval-harness formatting: trailing whitespace of the context moves into the continuation, and
the target tokens are enc(context + continuation)[len(enc(context)):]. The context is prefilled at
`prefill_depth`, then the target is fed one decode step at a time (teacher forcing) at `depth`;
the first target token is scored by the prefill's last logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from looplm.errors import UserError
from looplm.eval.records import read_records
from looplm.data import Tokenizer
from looplm.infer.cache import make_cache
from looplm.infer.decode import token_vocab
from looplm.infer.extend import extend


@dataclass(frozen=True)
class ChoiceItem:
    """One multiple-choice question: `choices[gold]` is the right continuation of `context`."""

    context: str
    choices: tuple[str, ...]
    gold: int


def load_choice_jsonl(path: str | Path) -> list[ChoiceItem]:
    """Read lines {"context": str, "choices": [str, ...] (>= 2), "gold": int}; blank lines are skipped."""
    items = []
    for where, row in read_records(path, ("context", "choices", "gold")):
        context, choices, gold = row["context"], row["choices"], row["gold"]
        if not isinstance(context, str):
            raise UserError(f"{where}: 'context' must be a string")
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise UserError(f"{where}: 'choices' must be a list of strings")
        if len(choices) < 2:
            raise UserError(f"{where}: need at least 2 choices, got {len(choices)}")
        if not context.strip():  # scoring needs a context to prefill: refused here, before any work
            raise UserError(f"{where}: 'context' is empty")
        if "" in choices:
            raise UserError(f"{where}: choice {choices.index('')} is empty (it adds no tokens to score)")
        if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
            raise UserError(f"{where}: 'gold' must be an index in 0..{len(choices) - 1}, got {gold!r}")
        items.append(ChoiceItem(context, tuple(choices), gold))
    return items


def split_context(context: str, choice: str) -> tuple[str, str]:
    """(context without trailing whitespace, that whitespace + choice)."""
    stripped = context.rstrip()
    return stripped, context[len(stripped) :] + choice


def pick(logliks: Sequence[float], lengths: Sequence[int]) -> tuple[int, int]:
    """(argmax of log-likelihood, argmax of log-likelihood per character); ties go to the first."""
    if len(logliks) != len(lengths) or not logliks:
        raise ValueError("need one length per log-likelihood, and at least one choice")
    best = max(range(len(logliks)), key=lambda i: (logliks[i], -i))
    norm = [ll / max(n, 1) for ll, n in zip(logliks, lengths)]
    best_norm = max(range(len(norm)), key=lambda i: (norm[i], -i))
    return best, best_norm


@torch.no_grad()
def score_continuation(
    model,
    tokenizer: Tokenizer,
    context: str,
    continuation: str,
    *,
    depth: int,
    prefill_depth: int | None = None,
    cache: str = "terminal",
    example_id: int = 0,
    device="cpu",
    truncate: bool = False,
) -> tuple[float, bool]:
    """(sum of ln p over the target tokens, whether every target token was the argmax), over the
    tokenizer's ids (a padded embedding's other rows are no token). `truncate`: a context too long
    for the model keeps its last tokens (lm-evaluation-harness's rule) instead of an error."""
    ctx_ids = tokenizer.encode_prompt(context)
    if not ctx_ids:
        raise UserError("choice context is empty (nothing to prefill)")
    target = tokenizer.encode_prompt(context + continuation)[len(ctx_ids) :]
    if not target:
        raise UserError(f"continuation {continuation!r} adds no tokens to the context")
    keep = model.cfg.max_seq_len + 1 - len(target)  # context tokens that fit before the targets
    if truncate and 1 <= keep < len(ctx_ids):
        ctx_ids = ctx_ids[-keep:]
    return score_tokens(
        model,
        ctx_ids,
        target,
        depth=depth,
        prefill_depth=prefill_depth,
        cache=cache,
        example_id=example_id,
        device=device,
        vocab=token_vocab(model, tokenizer),
    )


@torch.no_grad()
def score_tokens(
    model,
    ctx_ids: Sequence[int],
    target: Sequence[int],
    *,
    depth: int,
    prefill_depth: int | None = None,
    cache: str = "terminal",
    example_id: int = 0,
    device="cpu",
    vocab: int | None = None,
) -> tuple[float, bool]:
    """(sum of ln p over the `target` ids, whether each was the argmax) after the context `ctx_ids`
    (non-empty): the context prefilled at `prefill_depth` into a fresh batch-1 cache of kind
    `cache`, then the target fed one decode step at a time at `depth` (the first target scored by the
    prefill's last logits); the log-probabilities over the first `vocab` ids (default: all)."""
    prefill_depth = prefill_depth or depth
    ctx_ids, target = list(ctx_ids), list(target)
    if not ctx_ids or not target:
        raise UserError("scoring needs a context and at least one target token")
    need = len(ctx_ids) + len(target) - 1  # the last target token is never fed
    if need > model.cfg.max_seq_len:
        raise UserError(f"context + continuation need {need} tokens, the model context is {model.cfg.max_seq_len}")
    dtype = next(model.parameters()).dtype
    kv = make_cache(cache, model.cfg, 1, need, max(depth, prefill_depth), device=device, dtype=dtype)
    ids = torch.tensor([example_id], device=device)
    logits = extend(model, torch.tensor([ctx_ids], device=device), kv, prefill_depth, example_ids=ids).logits[0, -1]
    total, greedy = 0.0, True
    for t, tok in enumerate(target):
        logits = logits[:vocab]
        logp = torch.log_softmax(logits.double(), -1)
        total += float(logp[tok])
        greedy &= int(logits.argmax()) == tok
        if t + 1 < len(target):
            logits = extend(model, torch.tensor([[tok]], device=device), kv, depth, example_ids=ids).logits[0, -1]
    return total, greedy


def score_choices(
    model,
    tokenizer: Tokenizer,
    items: Sequence[ChoiceItem],
    *,
    depth: int,
    prefill_depth: int | None = None,
    cache: str = "terminal",
    device="cpu",
) -> dict:
    """{"acc", "acc_norm", "n", "items": [{"loglik", "greedy", "pred", "pred_norm", "gold"}, ...]}.

    A fresh batch-1 cache per (item, choice); the seeded initial state uses the item index as the
    example id, so results do not depend on anything else.
    """
    if not items:
        raise UserError("no choice items to score")
    details, hits, hits_norm = [], 0, 0
    for idx, item in enumerate(items):
        if not item.context.strip():
            raise UserError(f"item {idx}: empty context")
        logliks, greedy, lengths = [], [], []
        for choice in item.choices:
            ctx, cont = split_context(item.context, choice)
            ll, g = score_continuation(
                model,
                tokenizer,
                ctx,
                cont,
                depth=depth,
                prefill_depth=prefill_depth,
                cache=cache,
                example_id=idx,
                device=device,
            )
            logliks.append(ll)
            greedy.append(g)
            lengths.append(len(choice))  # lm-evaluation-harness's acc_norm: the choice's own characters
        pred, pred_norm = pick(logliks, lengths)
        hits += pred == item.gold
        hits_norm += pred_norm == item.gold
        details.append({"loglik": logliks, "greedy": greedy, "pred": pred, "pred_norm": pred_norm, "gold": item.gold})
    n = len(items)
    return {"acc": hits / n, "acc_norm": hits_norm / n, "n": n, "items": details}
