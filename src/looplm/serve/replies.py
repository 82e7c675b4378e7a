"""OpenAI's response bodies and stream chunks, made from a request's engine events.

`CompletionReply` and `ChatReply` each answer one request, both ways: as the chunks of its stream
(`events.Chunks`: `start`, `event`, `finish`, `usage`) or as one body from its collected events
(`whole`), so a streamed reply and a whole one spell tokens, log-probabilities and offsets alike.
"""

from __future__ import annotations

import os

from collections.abc import Sequence
from typing import ClassVar, NamedTuple

from looplm.data import Tokenizer
from looplm.infer.decode import decode_context
from looplm.serve.engine import Finish, PromptLogprobs, Token
from looplm.serve.events import Collected
from looplm.serve.protocol import ChatRequest, CompletionRequest


class Envelope(NamedTuple):
    """The fields every response body and stream chunk of a request starts with (`created`: the
    request's time, the same in every chunk of a stream)."""

    id: str
    model: str
    created: int

    def head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def usage(prompt_tokens: int, finishes: Sequence[Finish]) -> dict:
    completion = sum(f.completion_tokens for f in finishes)
    weight = sum(max(f.completion_tokens, 1) for f in finishes)
    depth = sum(f.mean_decode_depth * max(f.completion_tokens, 1) for f in finishes) / weight
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "mean_decode_depth": round(depth, 4),
    }


def spelling(tok: Tokenizer, token_id: int) -> tuple[str, list[int] | None]:
    """A token as OpenAI's logprobs spell it, and its own bytes: its text; `bytes:\\xe6\\x97` for a
    token whose bytes are not whole UTF-8 characters (as OpenAI's completions spell them); a
    special token by its name, with no bytes."""
    piece = tok.token_piece(token_id)
    if isinstance(piece, str):
        return piece, None
    try:
        return piece.decode("utf-8"), list(piece)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece), list(piece)


class Offsets:
    """`text_offset`s of a sequence of tokens: where each token's text starts in the text they decode
    to, i.e. how many whole characters the tokens before it decode to. A token holding the later
    bytes of a character gets the offset of that character (the one it contributes to), so offsets
    never decrease; and an offset depends only on the tokens before it, so a stream sends the same
    ones as a whole response. Decodes a short window, as `TextStream` does, so that each token
    costs the same however long the sequence. `context` (the prompt's ids) starts the first window as
    it starts `TextStream`'s, so the offsets count the characters the reply's text has (a SentencePiece
    reply's first `▁word` keeps its space)."""

    def __init__(self, tok: Tokenizer, start: int = 0, context: Sequence[int] = ()):
        self.tok, self.ids = tok, decode_context(tok, context)
        self._prefix, self._read = 0, len(self.ids)  # ids[prefix:read] are decoded: the window's context
        self._done = start  # characters of ids[:read] (plus `start`)
        self._next = start
        self._context = self._window = tok.decode(self.ids)  # decode(ids[prefix:read]), decode(ids[prefix:])

    def push(self, token_id: int) -> int:
        """The offset of `token_id`, the sequence's next token: where the text first changes when the
        token is added (decoding is prefix-stable but for a trailing incomplete character, one U+FFFD,
        which a continuation byte completes in place or leaves unchanged, and any other byte breaks
        off as a character of its own)."""
        before, done = self._window, self._context
        self.ids.append(token_id)
        window = self._window = self.tok.decode(self.ids[self._prefix :])
        if window == before:  # nothing new, or a character still incomplete: the pending character's
            at = len(before) - before.endswith("\ufffd")
        else:
            at = len(os.path.commonprefix([before, window]))
        offset = max(self._next, self._done - len(done) + at)
        new = window[len(done) :] if window.startswith(done) else ""
        if new and not new.endswith("\ufffd"):  # whole characters: the next window starts after them
            self._done += len(new)
            self._prefix, self._read = self._read, len(self.ids)
            self._context = self._window = self.tok.decode(self.ids[self._prefix :])
        self._next = offset
        return offset


_Scored = tuple[int, float | None, list[tuple[int, float]] | None]
"""A token in a completion's logprobs: its id, its log-probability (None: the first prompt token), the top
alternatives (token id, log-probability)."""


class _Reply:
    """What the replies of both endpoints share: the envelope, the prompt's length, the usage chunk."""

    chunk_kind: ClassVar[str]
    """The `object` of a stream chunk."""

    def __init__(self, tok: Tokenizer, envelope: Envelope, prompt_tokens: int, include_usage: bool):
        self.tok, self.envelope, self.prompt_tokens, self.include_usage = tok, envelope, prompt_tokens, include_usage

    def usage(self, finishes: list[Finish]) -> dict | None:
        """The stream's last chunk before `[DONE]`, if the request asked for it (`stream_options`)."""
        if not self.include_usage:
            return None
        return {**self.envelope.head(self.chunk_kind), "choices": [], "usage": usage(self.prompt_tokens, finishes)}


class CompletionReply(_Reply):
    """A /v1/completions reply: choice i answers prompt i // n; with echo its text starts with the
    prompt's, and with echo and logprobs its logprobs with the prompt's scores."""

    chunk_kind = "text_completion"

    def __init__(
        self,
        tok: Tokenizer,
        body: CompletionRequest,
        ids: list[list[int]],
        envelope: Envelope,
    ):
        super().__init__(tok, envelope, sum(len(i) for i in ids), body.include_usage())
        self.n, self.ids, self.logprobs = body.n, ids, body.logprobs
        # the prompt as the model read it (its ids decoded): what the echoed logprobs' offsets index, and the
        # prompt itself for any tokenizer that spells every text (not one with an unknown token)
        self.prefix = [tok.decode(i) if body.echo else "" for i in ids]
        self.echo_logprobs = body.echo and body.logprobs is not None
        self.offsets: dict[int, Offsets] = {}  # a stream's, by choice

    def _top(self, alternatives: list[tuple[int, float]] | None) -> dict[str, float] | None:
        top: dict[str, float] = {}
        for i, lp in alternatives or []:  # most likely first: of two tokens spelled alike, it stays
            top.setdefault(spelling(self.tok, i)[0], lp)
        return top or None

    def _block(self, entries: Sequence[_Scored], offsets: Offsets) -> dict:
        """OpenAI's logprobs of (token id, its log-prob, the top alternatives), the next tokens of `offsets`."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp, top in entries:
            out["tokens"].append(spelling(self.tok, token_id)[0])
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(self._top(top))
            out["text_offset"].append(offsets.push(token_id))
        return out

    def _generated(self, tokens: list[Token], offsets: Offsets) -> dict:
        return self._block([(t.token_id, t.logprob, t.top_logprobs) for t in tokens], offsets)

    def _scored_prompt(self, i: int, scores: PromptLogprobs) -> dict:
        """Choice i's echoed prompt's logprobs: the first token's are null (nothing precedes it); offsets
        into the prompt's text, which the returned text starts with."""
        prompt_ids = self.ids[i // self.n]
        tops = scores.top_logprobs or [None] * len(scores.logprobs)
        return self._block(
            [(prompt_ids[0], None, None), *zip(prompt_ids[1:], scores.logprobs, tops)], Offsets(self.tok)
        )

    def _completion_offsets(self, i: int) -> Offsets:
        """Choice i's completion follows the echoed prompt and is decoded after the prompt's ids."""
        return Offsets(self.tok, len(self.prefix[i // self.n]), self.ids[i // self.n])

    def _chunk(self, index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
        return {
            **self.envelope.head(self.chunk_kind),
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        }

    def _no_tokens(self) -> dict | None:
        return self._generated([], Offsets(self.tok)) if self.logprobs is not None else None

    def start(self, i: int) -> dict | None:
        self.offsets[i] = self._completion_offsets(i)
        head = self.prefix[i // self.n]
        # an echo with logprobs is sent with the prompt's scores (the choice's first event)
        return self._chunk(i, head, None, self._no_tokens()) if head and not self.echo_logprobs else None

    def event(self, i: int, ev: PromptLogprobs | Sequence[Token]) -> dict | None:
        if isinstance(ev, PromptLogprobs):
            if not self.echo_logprobs:
                return None
            return self._chunk(i, self.prefix[i // self.n], None, self._scored_prompt(i, ev))
        text = "".join(t.text for t in ev)
        if self.logprobs is None:
            return self._chunk(i, text, None, None) if text else None
        return self._chunk(i, text, None, self._generated(list(ev), self.offsets[i]))

    def finish(self, i: int, ev: Finish) -> dict:
        return self._chunk(i, ev.tail, ev.reason, self._no_tokens())

    def whole(self, got: Collected) -> dict:
        out = []
        for i, finish in sorted(got.finishes.items()):
            logprobs = None
            if self.logprobs is not None:
                logprobs = self._generated(got.tokens.get(i, []), self._completion_offsets(i))
                if self.echo_logprobs:  # the prompt's tokens first, then the completion's
                    prompt = self._scored_prompt(i, got.prompts[i])
                    logprobs = {key: prompt[key] + logprobs[key] for key in prompt}
            out.append(
                {
                    "index": i,
                    "text": self.prefix[i // self.n] + finish.text,
                    "logprobs": logprobs,
                    "finish_reason": finish.reason,
                }
            )
        return {
            **self.envelope.head("text_completion"),
            "choices": out,
            "usage": usage(self.prompt_tokens, list(got.finishes.values())),
        }


class ChatReply(_Reply):
    """A /v1/chat/completions reply: each choice is one assistant message."""

    chunk_kind = "chat.completion.chunk"

    def __init__(self, tok: Tokenizer, body: ChatRequest, prompt_tokens: int, logprobs: int | None, envelope: Envelope):
        super().__init__(tok, envelope, prompt_tokens, body.include_usage())
        self.logprobs = logprobs

    def _entry(self, token_id: int, lp: float) -> dict:
        spelled, raw = spelling(self.tok, token_id)
        return {"token": spelled, "logprob": lp, "bytes": raw}

    def _content(self, tokens: list[Token]) -> dict | None:
        if self.logprobs is None:
            return None
        return {
            "content": [
                {
                    **self._entry(t.token_id, t.logprob),
                    "top_logprobs": [self._entry(i, lp) for i, lp in (t.top_logprobs or [])],
                }
                for t in tokens
            ]
        }

    def _chunk(self, index: int, delta: dict, finish: str | None, tokens: list[Token]) -> dict:
        return {
            **self.envelope.head(self.chunk_kind),
            "choices": [{"index": index, "delta": delta, "logprobs": self._content(tokens), "finish_reason": finish}],
        }

    def start(self, i: int) -> dict:
        return self._chunk(i, {"role": "assistant", "content": ""}, None, [])

    def event(self, i: int, ev: PromptLogprobs | Sequence[Token]) -> dict | None:  # tokens: chat scores no prompt
        text = "".join(t.text for t in ev)
        return self._chunk(i, {"content": text}, None, list(ev)) if text or self.logprobs is not None else None

    def finish(self, i: int, ev: Finish) -> dict:
        return self._chunk(i, {"content": ev.tail} if ev.tail else {}, ev.reason, [])

    def whole(self, got: Collected) -> dict:
        out = [
            {
                "index": i,
                "message": {"role": "assistant", "content": f.text},
                "logprobs": self._content(got.tokens.get(i, [])),
                "finish_reason": f.reason,
            }
            for i, f in sorted(got.finishes.items())
        ]
        return {
            **self.envelope.head("chat.completion"),
            "choices": out,
            "usage": usage(self.prompt_tokens, list(got.finishes.values())),
        }
