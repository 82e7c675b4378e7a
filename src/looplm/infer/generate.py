"""Text generation with a KV cache: batched prompts, greedy or seeded sampling, stop strings.

A `DepthRule` says the recurrences: prefill at `prefill_depth` (R_pre), every decoded token at
`depth` (R_dec) or fewer by its exit rule; with the terminal cache the two depths are independent
because decoding reads only terminal banks (design §7).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from looplm.data import Tokenizer
from looplm.errors import UserError
from looplm.infer.cache import make_cache
from looplm.infer.decode import SamplingConfig, TextStream, choose, choose_rows, token_vocab
from looplm.infer.depth_rule import CacheKind, DepthRule
from looplm.infer.prefill import Prefill
from looplm.infer.speculative import Speculation, SpeculationStats, speculative_decode
from looplm.infer.step import DecodeStep, StepRows

__all__ = ["DepthRule", "SamplingConfig", "Speculation", "choose", "decode_step", "generate"]


def encode_prompts(
    tokenizer: Tokenizer, prompts: Sequence[str | Sequence[int]], max_new_tokens: int, max_seq_len: int
) -> list[list[int]]:
    """The prompts' token ids (a text is encoded as a prompt, token ids are taken as they are); a
    UserError for an empty prompt, or one that leaves no room for `max_new_tokens` in the context
    `max_seq_len`."""
    encoded = [tokenizer.encode_prompt(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    for i, ids in enumerate(encoded):
        if not ids:
            raise UserError(f"prompt {i} is empty")
        if len(ids) > max_seq_len:
            raise UserError(f"prompt {i} has {len(ids)} tokens, more than the context max_seq_len={max_seq_len}")
        if len(ids) + max_new_tokens - 1 > max_seq_len:  # the last new token is never fed
            raise UserError(
                f"prompt {i} has {len(ids)} tokens; with max_new_tokens {max_new_tokens} it exceeds "
                f"the context max_seq_len={max_seq_len} (at most {max_seq_len - len(ids) + 1} new tokens)"
            )
    return encoded


def _bucket(n: int, compiled: bool) -> int:
    """The batch size a step runs at for n live rows: n eagerly; compiled, the next power of two
    (one graph per bucket, not one per batch size)."""
    return n if not compiled else 1 << (n - 1).bit_length()


@torch.no_grad()
def generate(
    model,
    tokenizer: Tokenizer,
    prompts: Sequence[str | Sequence[int]],
    rule: DepthRule,
    *,
    cache: CacheKind = "terminal",
    sampling: SamplingConfig | None = None,
    on_token: Callable[[int, str], None] | None = None,
    stats: dict | None = None,
    example_ids: Sequence[int] | None = None,
    prefill: Prefill | None = None,
    compile: bool = False,
    speculate: Speculation | None = None,
    step: DecodeStep | None = None,
) -> list[str]:
    """Continue each prompt (a text, or its token ids) at the recurrences of `rule` with a KV cache of
    kind `cache` (terminal or full); returns the generated texts (stop strings and EOS excluded).

    `on_token(row, text_piece)` is called as text is produced (streaming); `stats`, when given,
    receives "mean_decode_depth" (the mean recurrences per decoded token of the rows still running,
    < depth with adaptive exit), "decoded_tokens", "token_ids" (each row's generated ids, the EOS
    that ends a row not among them), "decode_seconds" (from the end of the prefill),
    "first_step_seconds" and "first_step_tokens" (the time until the first step's end, compiling
    included, and the tokens decided by then; with `speculate` the first round's), and with
    `speculate` also "acceptance_rate" and "tokens_per_verify".
    `example_ids` seed each row's initial state (default: every row 0, so a prompt's result does not
    depend on the batch it is run in: the server, the Transformers wrapper and the vLLM plugin seed
    alike). `prefill` chooses how the prompts enter
    the cache (`looplm.infer.prefill`: teacher at the rule's prefill depth, distilled student, R = 1
    or 2); default: the model at the prefill depth.

    Decoding runs `DecodeStep` (static shapes, no host sync inside a step); `compile=True` compiles
    it (`torch.compile`; its first steps pay the compilation, see BENCHMARKS.md). Rows that finish
    leave the batch. `speculate` decodes each prompt alone by self-speculation (draft at a shallow
    depth, verify at the rule's depth). A model's exit gate (`rule.exit_gate`) decodes through the
    model's forward, one token at a time.
    """
    cfg = sampling or SamplingConfig()
    if not prompts:
        raise UserError("no prompts given")
    cfg.validate()
    rule.check(model.cfg.max_depth, cache=cache, has_gate=model.exit_gate is not None)
    depth = rule.depth
    if speculate is not None:
        speculate.check(depth)
        if rule.exit_tau is not None or rule.exit_gate is not None:
            raise UserError("speculative decoding verifies at one fixed depth: it takes no exit_tau or exit_gate")
    encoded = encode_prompts(tokenizer, prompts, cfg.max_new_tokens, model.cfg.max_seq_len)
    ids_all = [0] * len(prompts) if example_ids is None else list(example_ids)
    if speculate is not None and len(prompts) > 1:  # speculation runs one sequence at a time
        out, totals, decoded, seconds, first, first_tokens = [], SpeculationStats(), 0, 0.0, 0.0, 0
        token_ids: list[list[int]] = []
        step = step or decode_step(model, compile)  # one step (and its compiled graphs) for every prompt
        for i, prompt in enumerate(prompts):
            row_stats: dict = {}
            emit = None if on_token is None else (lambda _row, piece, i=i: on_token(i, piece))
            out += generate(
                model,
                tokenizer,
                [prompt],
                rule,
                cache=cache,
                sampling=cfg,
                on_token=emit,
                stats=row_stats,
                example_ids=[ids_all[i]],
                prefill=prefill,
                compile=compile,
                speculate=speculate,
                step=step,
            )
            for f in ("rounds", "drafted", "accepted"):
                setattr(totals, f, getattr(totals, f) + row_stats["speculation"][f])
            decoded += row_stats["decoded_tokens"]
            token_ids += row_stats["token_ids"]
            seconds += row_stats["decode_seconds"]
            if i == 0:
                first, first_tokens = row_stats["first_step_seconds"], row_stats["first_step_tokens"]
        if stats is not None:
            stats.update(
                _speculation_stats(totals),
                mean_decode_depth=float(depth),
                decoded_tokens=decoded,
                token_ids=token_ids,
                decode_seconds=seconds,
                first_step_seconds=first,
                first_step_tokens=first_tokens,
            )
        return out
    device = next(model.parameters()).device
    B, L = len(encoded), max(len(ids) for ids in encoded)
    pad = torch.tensor([L - len(ids) for ids in encoded], device=device)
    tokens = torch.full((B, L), tokenizer.pad_id, dtype=torch.long, device=device)
    for i, ids in enumerate(encoded):
        tokens[i, L - len(ids) :] = torch.tensor(ids, device=device)
    ids_arg = torch.tensor(ids_all, device=device)
    # a compiled step keeps one graph per batch size: its cache always spans the whole context
    max_len = model.cfg.max_seq_len if compile else L + cfg.max_new_tokens - 1
    kv = make_cache(cache, model.cfg, B, max_len, rule.deepest, device=device, dtype=next(model.parameters()).dtype)
    gate = {} if rule.exit_gate is None else {"exit_gate": rule.exit_gate}
    vocab = token_vocab(model, tokenizer)  # the logits cover the tokenizer's ids
    logits = (prefill or Prefill())(model, tokens, kv, rule.prefill, example_ids=ids_arg, pad=pad, **gate)[
        :, -1, :vocab
    ]
    # sampling: each row draws from its own generator seeded alike, so a prompt's tokens do not depend on
    # the batch it runs in (as the server's requests, and each prompt under `speculate`)
    gens = [torch.Generator(device=device).manual_seed(cfg.seed) for _ in range(B)] if cfg.temperature > 0 else None
    started = time.perf_counter()
    streams = [TextStream(tokenizer, cfg.stop, context=ids) for ids in encoded]
    step = step or decode_step(model, compile)
    step.reset(kv)
    step.vocab = vocab
    if speculate is not None:

        def emit(tok: int) -> bool:
            if tok == tokenizer.eos_id:
                return True
            piece, stopped = streams[0].push(tok)
            if on_token is not None and piece:
                on_token(0, piece)
            return stopped

        totals = SpeculationStats()
        speculative_decode(
            step,
            logits,
            length=L,
            depth=depth,
            draft_depth=speculate.draft_depth,
            k=speculate.k,
            sampling=cfg,
            generator=None if gens is None else gens[0],
            pad=pad,
            example_ids=ids_arg,
            emit=emit,
            stats=totals,
            reuse=speculate.reuse,
            started=started,
        )
        _finish(streams, on_token)
        if stats is not None:
            stats.update(
                _speculation_stats(totals),
                mean_decode_depth=float(depth),
                decoded_tokens=len(streams[0].ids),
                token_ids=[list(streams[0].ids)],
                decode_seconds=time.perf_counter() - started,
                first_step_seconds=totals.first_round_s,
                first_step_tokens=totals.first_round_tokens,
            )
        return [streams[0].text]
    plan = rule.decode_plan()
    live = list(range(B))  # the prompt of each row of the decode batch
    done = [False] * B
    depths_used: list[int] = []
    first = 0.0
    for t in range(cfg.max_new_tokens):
        nxt = choose_rows(logits[: len(live)], cfg, None if gens is None else [gens[i] for i in live])
        for i, tok in zip(live, nxt.tolist()):
            if tok == tokenizer.eos_id:
                done[i] = True
                continue
            piece, done[i] = streams[i].push(tok)
            if on_token is not None and piece:
                on_token(i, piece)
        if all(done) or t + 1 == cfg.max_new_tokens:
            break
        keep = [k for k, i in enumerate(live) if not done[i]]
        if len(keep) < len(live):  # finished rows leave the batch (a compiled step keeps its bucket size)
            live = [live[k] for k in keep]
            index = torch.tensor(keep + keep[-1:] * (_bucket(len(keep), compile) - len(keep)), device=device)
            kv, pad, ids_arg = kv.take(index), pad[index], ids_arg[index]
            nxt = nxt[index[: len(keep)]]
            step.reset(kv)
        if kv.batch > len(live):  # padding rows of the bucket repeat the last live row
            nxt = torch.cat([nxt, nxt[-1:].expand(kv.batch - len(live))])
        write_at = torch.full((kv.batch,), L + t, device=device)
        if rule.exit_gate is not None:
            kv.length = L + t
            out = model(nxt[:, None], plan, cache=kv, pad=pad, init="seeded", example_ids=ids_arg)
            logits, used = out.logits[:, -1, :vocab], out.depths[:, 0]
        else:
            rows_in = StepRows.under(rule, nxt, write_at, pad, ids_arg)
            logits, used = step(rows_in, depth)
        depths_used += used[: len(live)].tolist()
        if t == 0:  # what a first step costs (compiling included) against the steps after it
            first = time.perf_counter() - started
    _finish(streams, on_token)
    if stats is not None:
        stats["mean_decode_depth"] = sum(depths_used) / len(depths_used) if depths_used else float(depth)
        stats["decoded_tokens"] = sum(len(stream.ids) for stream in streams)
        stats["token_ids"] = [list(stream.ids) for stream in streams]
        stats["decode_seconds"] = time.perf_counter() - started
        stats["first_step_seconds"] = first
        # the first step decided each row's first token (from the prompt's logits) and its second
        stats["first_step_tokens"] = min(2 * B, stats["decoded_tokens"]) if first else 0
    return [stream.text for stream in streams]


def decode_step(model, compile: bool = False) -> DecodeStep:
    """`generate`'s decode step. Compiled, a fixed-depth loop runs 8 recurrences per graph call
    (`DecodeStep(unroll=8)`): one command at a time compiles one batch size, and at batch 1 and R = 32
    on a CPU a step took 1.15x less time than at the default 4, for a longer first compile
    (`BENCHMARKS.md`). The serving engine keeps 4: it compiles every batch bucket."""
    return DecodeStep(model, compile=compile, unroll=8)


def _finish(streams: list[TextStream], on_token) -> None:
    for i, stream in enumerate(streams):
        tail = stream.finish()
        if on_token is not None and tail:
            on_token(i, tail)


def _speculation_stats(s: SpeculationStats) -> dict:
    return {
        "acceptance_rate": s.acceptance_rate,
        "tokens_per_verify": s.tokens_per_verify,
        "speculation": {"rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted},
    }
