"""Text generation with a KV cache: batched prompts, greedy or seeded sampling, stop strings.

Prefill runs at depth `prefill_depth` (R_pre) and every decoded token at `depth` (R_dec); with
the terminal cache the two are independent because decoding reads only terminal banks (design §7).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from looplm.data import Tokenizer
from looplm.errors import UserError
from looplm.infer.cache import make_cache
from looplm.infer.extend import extend
from looplm.infer.prefill import Prefill


@dataclass
class SamplingConfig:
    """How tokens are chosen and when generation stops."""

    max_new_tokens: int = 64
    """Largest number of tokens generated per prompt."""
    temperature: float = 0.0
    """0 = greedy; otherwise sample from softmax(logits / temperature)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p (1 = all)."""
    seed: int = 0
    """Seed of the sampler."""
    stop: tuple[str, ...] = ()
    """Stop a prompt's generation when its text contains one of these strings (cut before it)."""
    exit_tau: float | None = None
    """Adaptive decode depth: stop a token's recurrence once its relative state change < exit_tau (terminal cache)."""
    min_depth: int = 1
    """Adaptive decode depth: fewest recurrences per decoded token."""
    exit_gate: float | None = None
    """The model's learned exit gate (Ouro): each token's logits come from the first recurrence whose
    cumulative exit probability reaches this threshold (every recurrence still runs; design §14)."""

    def validate(self) -> None:
        """Raise ValueError with a one-line reason when a field is out of range (`generate` calls it)."""
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"temperature must be >= 0 (0 = greedy decoding), got {self.temperature}")
        if not -(2**63) <= self.seed < 2**64:  # what torch.Generator.manual_seed accepts
            raise UserError(f"seed must be in -2**63..2**64-1, got {self.seed}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 = all tokens), got {self.top_k}")
        if not 0 < self.top_p <= 1:  # also rejects nan
            raise UserError(f"top_p must be in (0, 1] (1 = all tokens), got {self.top_p}")
        for s in self.stop:
            if not s:
                raise UserError("stop strings must be non-empty, got ''")
        if self.exit_tau is not None and not self.exit_tau > 0:
            raise UserError(f"exit_tau must be > 0 (adaptive depth) or unset, got {self.exit_tau}")
        if self.min_depth < 1:
            raise UserError(f"min_depth must be >= 1, got {self.min_depth}")
        if self.exit_gate is not None and not 0 <= self.exit_gate <= 1:
            raise UserError(f"exit_gate must be a probability threshold in [0, 1] or unset, got {self.exit_gate}")
        if self.exit_gate is not None and self.exit_tau is not None:
            raise UserError("choose one exit rule: exit_gate (the model's gate) or exit_tau (state change)")


def choose(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, V]."""
    if cfg.temperature <= 0:
        return logits.argmax(-1)
    logits = logits / cfg.temperature
    if cfg.top_k > 0:
        kth = logits.topk(min(cfg.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > cfg.top_p  # tokens after the nucleus is complete
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


def _cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    hits = [text.index(s) for s in stop if s and s in text]
    return (text[: min(hits)], True) if hits else (text, False)


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
    prefill_depth = prefill_depth or depth
    if not prompts:
        raise UserError("no prompts given")
    cfg.validate()
    for r in (depth, prefill_depth):
        if not 1 <= r <= model.cfg.max_depth:
            raise UserError(f"depth must be in 1..{model.cfg.max_depth}, got {r}")
    if cfg.exit_tau is not None and cache_mode != "terminal":
        raise UserError("adaptive depth (exit_tau) needs the terminal cache")
    if cfg.exit_tau is not None and cfg.min_depth > depth:
        raise UserError(f"min_depth {cfg.min_depth} exceeds the decode depth {depth}")
    encoded = [tokenizer.encode_prompt(p) for p in prompts]
    for i, ids in enumerate(encoded):
        if not ids:
            raise UserError(f"prompt {i} is empty")
        if len(ids) + cfg.max_new_tokens - 1 > model.cfg.max_seq_len:  # the last new token is never fed
            raise UserError(f"prompt {i} has {len(ids)} tokens; with max_new_tokens {cfg.max_new_tokens} it exceeds "
                            f"the context max_seq_len={model.cfg.max_seq_len}")
    device = next(model.parameters()).device
    B, L = len(encoded), max(len(ids) for ids in encoded)
    pad = torch.tensor([L - len(ids) for ids in encoded], device=device)
    tokens = torch.full((B, L), tokenizer.pad_id, dtype=torch.long, device=device)
    for i, ids in enumerate(encoded):
        tokens[i, L - len(ids):] = torch.tensor(ids, device=device)
    ids_arg = torch.arange(B, device=device) if example_ids is None else torch.tensor(list(example_ids), device=device)
    cache = make_cache(cache_mode, model.cfg, B, L + cfg.max_new_tokens - 1, max(depth, prefill_depth), device=device,
                       dtype=next(model.parameters()).dtype)
    gate = {} if cfg.exit_gate is None else {"exit_gate": cfg.exit_gate}
    logits = (prefill or Prefill())(model, tokens, cache, prefill_depth, example_ids=ids_arg, pad=pad, **gate)[:, -1]
    gen = torch.Generator(device=device).manual_seed(cfg.seed) if cfg.temperature > 0 else None
    out_ids: list[list[int]] = [[] for _ in range(B)]
    texts, done = [""] * B, [False] * B
    depths_used: list[float] = []
    for step in range(cfg.max_new_tokens):
        nxt = choose(logits, cfg, gen)
        for i in range(B):
            if done[i]:
                continue
            tok = int(nxt[i])
            if tok == tokenizer.eos_id:
                done[i] = True
                continue
            out_ids[i].append(tok)
            text, stopped = _cut_at_stop(tokenizer.decode(out_ids[i]), cfg.stop)
            if on_token is not None and not stopped and text.startswith(texts[i]):
                on_token(i, text[len(texts[i]):])
            texts[i], done[i] = text, stopped
        if all(done) or step + 1 == cfg.max_new_tokens:
            break
        logits, used = extend(model, nxt[:, None], cache, depth, example_ids=ids_arg, pad=pad,
                              exit_tau=cfg.exit_tau, min_depth=cfg.min_depth, return_depths=True, **gate)
        logits = logits[:, -1]
        depths_used.append(float(used.float().mean()))
    if stats is not None:
        stats["mean_decode_depth"] = sum(depths_used) / len(depths_used) if depths_used else float(depth)
    return texts
