"""Text generation with a KV cache: batched prompts, greedy or seeded sampling, stop strings.

Prefill runs at depth `prefill_depth` (R_pre) and every decoded token at `depth` (R_dec); with
the terminal cache the two are independent because decoding reads only terminal banks (design §7).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from looplm.data import Tokenizer
from looplm.errors import UserError
from looplm.infer.cache import make_cache
from looplm.infer.decode import DecodeSpec, SamplingConfig, TextStream, choose
from looplm.infer.prefill import Prefill

__all__ = ["SamplingConfig", "choose", "generate"]


def encode_prompts(tokenizer: Tokenizer, prompts: Sequence[str], max_new_tokens: int, max_seq_len: int) -> list[list[int]]:
    """The prompts' token ids; a UserError for an empty prompt, or one that leaves no room for
    `max_new_tokens` in the context `max_seq_len`."""
    encoded = [tokenizer.encode_prompt(p) for p in prompts]
    for i, ids in enumerate(encoded):
        if not ids:
            raise UserError(f"prompt {i} is empty")
        if len(ids) + max_new_tokens - 1 > max_seq_len:  # the last new token is never fed
            raise UserError(f"prompt {i} has {len(ids)} tokens; with max_new_tokens {max_new_tokens} it exceeds "
                            f"the context max_seq_len={max_seq_len}")
    return encoded


@torch.no_grad()
def generate(
    model, tokenizer: Tokenizer, prompts: Sequence[str], *, depth: int, prefill_depth: int | None = None,
    cache_mode: str = "terminal", sampling: SamplingConfig | None = None,
    on_token: Callable[[int, str], None] | None = None, stats: dict | None = None,
    example_ids: Sequence[int] | None = None, prefill: Prefill | None = None,
) -> list[str]:
    """Continue each prompt; returns the generated texts (stop strings and EOS excluded).

    `on_token(row, text_piece)` is called as text is produced (streaming); `stats`, when given,
    receives "mean_decode_depth" (the mean recurrences per decode step, < depth with adaptive exit).
    `example_ids` seed each row's initial state (default 0..B-1); give each example a fixed id so
    its result does not depend on the batch it was run in. `prefill` chooses how the prompts enter
    the cache (`looplm.infer.prefill`: teacher at prefill_depth, distilled student, R = 1 or 2);
    default: the model at prefill_depth.
    """
    cfg = sampling or SamplingConfig()
    if not prompts:
        raise UserError("no prompts given")
    spec = DecodeSpec(depth, prefill_depth, cache_mode, cfg).check(model.cfg.max_depth,
                                                                    has_gate=model.exit_gate is not None)
    encoded = encode_prompts(tokenizer, prompts, cfg.max_new_tokens, model.cfg.max_seq_len)
    device = next(model.parameters()).device
    B, L = len(encoded), max(len(ids) for ids in encoded)
    pad = torch.tensor([L - len(ids) for ids in encoded], device=device)
    tokens = torch.full((B, L), tokenizer.pad_id, dtype=torch.long, device=device)
    for i, ids in enumerate(encoded):
        tokens[i, L - len(ids):] = torch.tensor(ids, device=device)
    ids_arg = torch.arange(B, device=device) if example_ids is None else torch.tensor(list(example_ids), device=device)
    cache = make_cache(cache_mode, model.cfg, B, L + cfg.max_new_tokens - 1, max(depth, spec.prefill), device=device,
                       dtype=next(model.parameters()).dtype)
    gate = {} if cfg.exit_gate is None else {"exit_gate": cfg.exit_gate}
    logits = (prefill or Prefill())(model, tokens, cache, spec.prefill, example_ids=ids_arg, pad=pad, **gate)[:, -1]
    gen = torch.Generator(device=device).manual_seed(cfg.seed) if cfg.temperature > 0 else None
    streams = [TextStream(tokenizer, cfg.stop, context=ids) for ids in encoded]
    done = [False] * B
    plan = spec.decode_plan()
    depths_used: list[float] = []
    for step in range(cfg.max_new_tokens):
        nxt = choose(logits, cfg, gen)
        for i, tok in enumerate(nxt.tolist()):
            if done[i]:
                continue
            if tok == tokenizer.eos_id:
                done[i] = True
                continue
            piece, done[i] = streams[i].push(tok)
            if on_token is not None and piece:
                on_token(i, piece)
        if all(done) or step + 1 == cfg.max_new_tokens:
            break
        out = model(nxt[:, None], plan, cache=cache, pad=pad, init="seeded", example_ids=ids_arg)
        logits = out.logits[:, -1]
        depths_used.append(float(out.depths.float().mean()))
    for i, stream in enumerate(streams):
        tail = stream.finish()
        if on_token is not None and tail:
            on_token(i, tail)
    if stats is not None:
        stats["mean_decode_depth"] = sum(depths_used) / len(depths_used) if depths_used else float(depth)
    return [stream.text for stream in streams]
