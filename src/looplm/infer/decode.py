"""The decoding core shared by `generate`, the serving engine and RL rollouts (design §7, §15, §16).

- `SamplingConfig`: how tokens are chosen and when generation stops (the recurrences of a decode
  are its `looplm.infer.DepthRule`).
- `choose`: the next token from last-position logits (greedy, temperature, top-k, top-p).
- `TextStream`: incremental detokenisation with stop strings. Each new token decodes only a short
  window of recent ids, so a step costs the same at the thousandth token as at the first; text is
  released except for what may still become a stop string or an incomplete character, and the
  released pieces join into exactly the final text (for a tokenizer whose decoding of a longer
  sequence never rewrites what a shorter one gave, as byte, BPE and SentencePiece decoding do; one
  that removes spaces before punctuation after the fact keeps `text` right, not the pieces). Given the prompt's ids as `context`, the reply
  is decoded after them, so prompt + reply reads as the decode of both (SentencePiece spaces).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from looplm.data import Tokenizer
from looplm.errors import UserError


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

    def validate(self) -> None:
        """Raise UserError with a one-line reason when a field is out of range."""
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


def token_vocab(model, tokenizer: Tokenizer) -> int:
    """How many logits are tokens: the tokenizer's ids, where a release pads the model's embedding
    and head past them (rows no token reaches, which nothing may choose or normalise over)."""
    return min(model.cfg.vocab_size, tokenizer.vocab_size)


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution [B, V] that `choose` samples from at temperature > 0: softmax(logits / T)
    restricted to the top-k tokens, then to the nucleus (the smallest set of most likely tokens
    whose probability reaches top_p), renormalised."""
    logits = logits.float()
    # shifted by the row's largest logit first (the same softmax): a tiny temperature then sends the
    # others to -inf instead of every logit to +-inf (a NaN distribution)
    logits = (logits - logits.amax(-1, keepdim=True)) / cfg.temperature
    if cfg.top_k > 0:
        kth = logits.topk(min(cfg.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= cfg.top_p  # tokens after the nucleus reached top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row [B] drawn from `probs` [B, V] without a host sync: the exponential race
    argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with probability p_i."""
    race = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / race).argmax(-1)


def choose(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, V] (greedy at temperature 0)."""
    if cfg.temperature <= 0:
        return logits.argmax(-1)
    return sample(probabilities(logits, cfg), generator)


def choose_rows(
    logits: torch.Tensor, cfg: SamplingConfig, generators: Sequence[torch.Generator] | None
) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, V], row b sampled with `generators[b]` (greedy
    at temperature 0): a row's draws do not depend on the other rows."""
    if cfg.temperature <= 0:
        return logits.argmax(-1)
    probs = probabilities(logits, cfg)
    return torch.cat([sample(probs[b : b + 1], g) for b, g in enumerate(generators)])


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """`text` cut before the earliest stop string, and whether one occurred."""
    hits = [text.index(s) for s in stop if s and s in text]
    return (text[: min(hits)], True) if hits else (text, False)


def _stop_prefix(text: str, stop: Sequence[str]) -> int:
    """Length of the longest proper prefix of a stop string that `text` ends with."""
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


CONTEXT_IDS = 8
"""How many of the prompt's last ids `TextStream` decodes the reply after (`context`)."""


def decode_context(tokenizer: Tokenizer, ids: Sequence[int]) -> list[int]:
    """The last `CONTEXT_IDS` of `ids` to decode a continuation after, or none when they end inside a
    character (the continuation may complete it, so their text is not a prefix of the whole)."""
    ctx = [int(t) for t in list(ids)[-CONTEXT_IDS:]]
    return [] if ctx and tokenizer.decode(ctx).endswith("\ufffd") else ctx


class TextStream:
    """The text of one generated sequence, built token by token.

    `push(token)` returns the newly released text and whether a stop string ended the sequence.
    Decoding works on a window: `_prefix` ids already turned into text give the context a
    tokenizer needs to decode the ids after them (leading spaces, multi-byte characters), and only
    ids from `_prefix` on are decoded again, so a step's cost does not grow with the output.
    `context` (the prompt's ids; its last `CONTEXT_IDS` are kept) starts the first window, so the
    text is decode(prompt + reply) minus decode(prompt), what a reader joining the two sees: a
    SentencePiece tokenizer drops the space of a text's first `▁word`, not of the reply's. Without
    it, or when the prompt ends inside a character, the reply is decoded on its own.
    `ids` are the generated ids; `text` is everything decoded so far (cut at a stop string);
    `released` is how much of it was handed out; `finish()` returns the rest.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), context: Sequence[int] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        ctx = decode_context(tokenizer, context)
        self.ids: list[int] = []
        self._all: list[int] = list(ctx)  # the context, then `ids`: what the windows index
        self._n_context = len(ctx)
        self.text = ""
        self.released = 0
        self.stopped = False
        self._prefix = 0  # first id of the decode window (in `_all`)
        self._read = len(ctx)  # ids before this are in `text` (or are the context)
        self._longest_stop = max((len(s) for s in self.stop), default=0)

    def push(self, token: int) -> tuple[str, bool]:
        if self.stopped:
            raise RuntimeError("the sequence already ended at a stop string")
        self.ids.append(token)
        self._all.append(token)
        before = len(self.text)
        done = self.tokenizer.decode(self._all[self._prefix : self._read])
        window = self.tokenizer.decode(self._all[self._prefix :])
        if len(window) > len(done) and not window.endswith("\ufffd") and window.startswith(done):
            self.text += window[len(done) :]
            self._prefix, self._read = self._read, len(self._all)
        if self.stop and len(self.text) > before:
            # a stop string can only end in the new text: search from where it could start
            start = max(0, before - self._longest_stop + 1)
            cut, hit = cut_at_stop(self.text[start:], self.stop)
            if hit:
                self.text, self.stopped = self.text[:start] + cut, True
        return self._release(), self.stopped

    def _release(self) -> str:
        end = len(self.text) if self.stopped else len(self.text) - _stop_prefix(self.text, self.stop)
        piece = self.text[self.released : end] if end > self.released else ""
        self.released = max(self.released, end)
        return piece

    def finish(self) -> str:
        """At the end of the sequence: decode what the window still holds back; the rest of the text."""
        if not self.stopped and self._read < len(self._all):  # held back: an incomplete character at the end
            done = self.tokenizer.decode(self._all[self._prefix : self._read])
            window = self.tokenizer.decode(self._all[self._prefix :])
            if window.startswith(done):
                self.text += window[len(done) :]
            else:  # a tokenizer whose window decodes differently: once, the whole sequence
                self.text = self._whole()
            self._prefix = self._read = len(self._all)
            self.text, self.stopped = cut_at_stop(self.text, self.stop)
        tail = self.text[self.released :]
        self.released = len(self.text)
        return tail

    def _whole(self) -> str:
        """The whole reply's text: decoded after the context when the context's text is kept as it is."""
        whole = self.tokenizer.decode(self._all)
        context = self.tokenizer.decode(self._all[: self._n_context])
        return whole[len(context) :] if whole.startswith(context) else self.tokenizer.decode(self.ids)
