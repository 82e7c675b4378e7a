"""An OpenAI-compatible HTTP API over the continuous-batching `Engine` (FastAPI; design §15).

Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming with server-sent events or
not), GET /v1/models, GET /health, GET /metrics (Prometheus). Errors use OpenAI's body
`{"error": {"message", "type", "param", "code"}}`: 400 for a request that cannot run (checked before
it is queued, including one with more choices than the queue holds), 401 for a wrong API key, 404
for an unknown model, 429 when the queue is full, 503 while the server shuts down. The engine runs on
its own thread; each HTTP request waits on an asyncio queue its events are posted to, and watches
its client meanwhile: a client that disconnects (streaming or not) cancels its requests, and their
slots are freed at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import NamedTuple

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from looplm.data import Tokenizer
from looplm.infer.decode import decode_context
from looplm.serve.engine import (Engine, EngineFull, EngineStopped, Finish, PromptLogprobs, Request, RequestHandle,
                                 Token)
from looplm.serve.protocol import ChatRequest, CompletionRequest

POLL_S = 0.25
"""How often a request checks whether its client is still connected (whether or not tokens arrive)."""


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", *,
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    first = err.errors()[0] if err.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") == "unknown_field":
        return msg, first["ctx"]["first"]
    return (f"{param}: {msg}" if param else msg), param


class _RequireKey:
    """ASGI middleware: /v1/ requests need `Authorization: Bearer <key>`, compared in constant time
    (how long a refusal takes says nothing about how much of the key matched). Plain ASGI, because
    `@app.middleware("http")` wraps `receive` so that endpoints never see their client disconnect."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not secrets.compare_digest(given, self.expected):
                refusal = APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                   "authentication_error", code="invalid_api_key").response()
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)


class _EngineCollector:
    """Prometheus metrics read from `Engine.stats()` at scrape time."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        gauges = {
            "queue_length": "Requests waiting for a cache slot",
            "running_sequences": "Sequences in the running batch",
            "max_batch": "Cache slots",
            "tokens_per_second": "Generated tokens per second over the last 10 s",
            "mean_decode_depth": "Mean recurrences per decoded token since the start (0 before any)",
            "cache_bytes_in_use": "KV-cache bytes holding live tokens",
            "cache_bytes_capacity": "KV-cache bytes preallocated for all slots",
        }
        for name, doc in gauges.items():
            yield GaugeMetricFamily(f"looplm_{name}", doc, value=s[name])
        for name, doc in (("generated_tokens", "Tokens generated"), ("prompt_tokens", "Prompt tokens prefilled")):
            yield CounterMetricFamily(f"looplm_{name}", doc, value=s[f"{name}_total"])
        done = CounterMetricFamily("looplm_requests_finished", "Finished sequences by reason", labels=["reason"])
        for reason, count in sorted(s["finished_total"].items()):
            done.add_metric([reason], count)
        yield done


class _Choices:
    """The engine requests of one HTTP request and the asyncio queue their events arrive on."""

    def __init__(self, engine: Engine, requests: Sequence[Request]):
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        if len(requests) > engine.config.max_queue:  # it would get a 429 however often it is retried
            raise ValueError(f"this request has {len(requests)} choices (prompts x n); the server queues at most "
                             f"max_queue {engine.config.max_queue}")
        for r in requests:
            engine.check(r)  # every choice is checked before any is queued
        self.handles: list[RequestHandle] = []
        try:
            for i, r in enumerate(requests):
                sink = (lambda i: lambda ev: loop.call_soon_threadsafe(self.events.put_nowait, (i, ev)))(i)
                self.handles.append(engine.submit(r, sink))
        except (EngineFull, EngineStopped):
            self.cancel()
            raise

    def cancel(self) -> None:
        for h in self.handles:
            if h.finish is None:
                h.cancel()

    async def stream(self, http: HTTPRequest) -> AsyncIterator[tuple[int, PromptLogprobs | Token | Finish]]:
        """Events until every choice finished; stops, cancelling them all, once the client goes away
        (watched alongside the events, so a steady stream of tokens cannot hide it)."""
        left = len(self.handles)
        gone = asyncio.ensure_future(_client_gone(http))
        event = None
        try:
            while left:
                event = asyncio.ensure_future(self.events.get())
                await asyncio.wait((event, gone), return_when=asyncio.FIRST_COMPLETED)
                if not event.done():
                    return
                i, ev = event.result()
                if isinstance(ev, Finish):
                    left -= 1
                yield i, ev
        finally:
            for task in (gone, event):
                if task is not None:
                    task.cancel()  # no-op once done
            self.cancel()  # no-op for finished choices

    async def collect(self, http: HTTPRequest) -> _Collected | None:
        """Every choice's events (non-streaming); None if the client went away; a failed generation
        raises a 500."""
        tokens: dict[int, list[Token]] = {}
        prompts: dict[int, PromptLogprobs] = {}
        finishes: dict[int, Finish] = {}
        async for i, ev in self.stream(http):
            if isinstance(ev, Token):
                tokens.setdefault(i, []).append(ev)
            elif isinstance(ev, PromptLogprobs):
                prompts[i] = ev
            else:
                finishes[i] = ev
        if len(finishes) < len(self.handles):
            return None
        failed = [f for f in finishes.values() if f.reason == "error"]
        if failed:
            raise APIError(500, failed[0].error or "generation failed", "server_error")
        return _Collected(tokens, prompts, finishes)


class _Collected(NamedTuple):
    """The events of a non-streamed request, by choice."""

    tokens: dict[int, list[Token]]
    prompts: dict[int, PromptLogprobs]
    """The prompt's scores of the choices that asked for them (`Request.prompt_logprobs`)."""
    finishes: dict[int, Finish]


async def _client_gone(http: HTTPRequest) -> None:
    """Returns once the client has disconnected."""
    while not await http.is_disconnected():
        await asyncio.sleep(POLL_S)


async def _sse_events(choices: _Choices, http: HTTPRequest, start: Callable[[int], dict | None],
                      token: Callable[[int, PromptLogprobs | Token], dict | None],
                      finish: Callable[[int, Finish], dict],
                      usage: Callable[[list[Finish]], dict] | None) -> AsyncIterator[str]:
    """The server-sent events of a streamed request: `start(i)` before choice i's first event, a
    chunk per token and per prompt score (`token` may skip one by returning None) and per finish, then
    the usage chunk (when asked) and `[DONE]`. Leaving early (the client went away) cancels the unfinished choices."""
    finishes: dict[int, Finish] = {}
    opened: set[int] = set()
    try:
        async for i, ev in choices.stream(http):
            out = []
            if i not in opened:
                opened.add(i)
                out.append(start(i))
            if isinstance(ev, Finish):
                finishes[i] = ev
                failed = ev.reason == "error"
                out.append(APIError(500, ev.error or "generation failed", "server_error").body() if failed
                           else finish(i, ev))
            else:
                out.append(token(i, ev))
            for data in out:
                if data is not None:
                    yield _sse(data)
        if len(finishes) == len(choices.handles):
            if usage is not None:
                yield _sse(usage(list(finishes.values())))
            yield _sse("[DONE]")
    finally:
        choices.cancel()  # no-op for finished choices


def _usage(prompt_tokens: int, finishes: Sequence[Finish]) -> dict:
    completion = sum(f.completion_tokens for f in finishes)
    weight = sum(max(f.completion_tokens, 1) for f in finishes)
    depth = sum(f.mean_decode_depth * max(f.completion_tokens, 1) for f in finishes) / weight
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "mean_decode_depth": round(depth, 4)}


def _envelope(rid: str, name: str, kind: str, created: int) -> dict:
    """The fields every OpenAI response body and stream chunk starts with (`created`: the request's
    time, the same in every chunk of a stream)."""
    return {"id": rid, "object": kind, "created": created, "model": name}


def _spelling(tok: Tokenizer, token_id: int) -> tuple[str, list[int] | None]:
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


class _Offsets:
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

    def push(self, token_id: int) -> int:
        """The offset of `token_id`, the sequence's next token."""
        offset = self._next
        self.ids.append(token_id)
        done = self.tok.decode(self.ids[self._prefix:self._read])
        window = self.tok.decode(self.ids[self._prefix:])
        new = window[len(done):] if window.startswith(done) else ""
        if new and not new.endswith("\ufffd"):  # whole characters: the next window starts after them
            self._done += len(new)
            self._prefix, self._read = self._read, len(self.ids)
            self._next = self._done
        else:  # an incomplete character at the end (one U+FFFD): the next token still belongs to it
            self._next = max(offset, self._done + len(new) - new.endswith("\ufffd"))
        return offset


_Scored = tuple[int, float | None, list[tuple[int, float]] | None]
"""A token in a completion's logprobs: its id, its log-probability (None: the first prompt token), the top
alternatives (token id, log-probability)."""


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def create_app(engine: Engine, model_name: str, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` as model `model_name`; the engine thread runs with the app."""
    tok = engine.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="looplm", summary="OpenAI-compatible looped-LM server", lifespan=lifespan)
    registry = CollectorRegistry()
    registry.register(_EngineCollector(engine))
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_, err: APIError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, err: RequestValidationError):
        message, param = _validation_message(err)
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return APIError(err.status_code, str(err.detail), kind).response()

    if api_key is not None:
        app.add_middleware(_RequireKey, key=api_key)

    def check_model(name: str | None) -> None:
        if name not in (None, model_name):
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", param="model", code="model_not_found")

    def start(requests: list[Request]) -> _Choices:
        try:
            return _Choices(engine, requests)
        except ValueError as err:
            raise APIError(400, str(err)) from None
        except EngineFull as err:
            raise APIError(429, str(err), "rate_limit_exceeded", code="queue_full") from None
        except EngineStopped as err:
            raise APIError(503, str(err), "server_error", code="shutting_down") from None

    def choice_requests(body, prompts_ids: list[list[int]], max_tokens: int, stop, logprobs, *,
                        prompt_logprobs: int | None = None) -> list[Request]:
        seed = body.seed if body.seed is not None else secrets.randbits(31)
        return [Request(ids, body.sampling(max_tokens, stop, seed + k), body.depth_rule(engine.config.depth),
                        logprobs=logprobs, prompt_logprobs=prompt_logprobs)
                for ids in prompts_ids for k in range(body.n)]

    def encode(prompt: str | list[int]) -> list[int]:
        return tok.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)

    @app.get("/health")
    async def health():
        return {"status": "ok", "running_sequences": engine.running, "waiting": engine.waiting}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "looplm", "max_model_len": engine.max_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        check_model(body.model)
        try:
            stop = body.stop_strings()
        except ValueError as err:
            raise APIError(400, str(err), param="stop") from None
        prompts = body.prompts()
        ids = [encode(p) for p in prompts]
        # echo with logprobs scores the prompt too (OpenAI's legacy API); max_tokens 0 (echo only) needs
        # the engine's scoring pass even without logprobs: it is what such a request runs
        score = body.echo and (body.logprobs is not None or body.max_tokens == 0)
        requests = choice_requests(body, ids, body.max_tokens, stop, body.logprobs,
                                   prompt_logprobs=(body.logprobs or 0) if score else None)
        choices = start(requests)
        rid, name, created = f"cmpl-{uuid.uuid4().hex}", body.model or model_name, int(time.time())
        prefix = [(tok.decode(i) if isinstance(p, list) else p) if body.echo else "" for p, i in zip(prompts, ids)]
        n_prompt = sum(len(i) for i in ids)
        echo_logprobs = body.echo and body.logprobs is not None

        def top_entry(alternatives: list[tuple[int, float]] | None) -> dict[str, float] | None:
            top: dict[str, float] = {}
            for i, lp in alternatives or []:  # most likely first: of two tokens spelled alike, it stays
                top.setdefault(_spelling(tok, i)[0], lp)
            return top or None

        def lp_block(entries: Sequence[_Scored], offsets: _Offsets) -> dict:
            """OpenAI's logprobs of (token id, its log-prob, the top alternatives), the next tokens of `offsets`."""
            out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for token_id, lp, top in entries:
                out["tokens"].append(_spelling(tok, token_id)[0])
                out["token_logprobs"].append(lp)
                out["top_logprobs"].append(top_entry(top))
                out["text_offset"].append(offsets.push(token_id))
            return out

        def generated(tokens: list[Token], offsets: _Offsets) -> dict:
            return lp_block([(t.token_id, t.logprob, t.top_logprobs) for t in tokens], offsets)

        def scored_prompt(prompt_ids: list[int], scores: PromptLogprobs) -> dict:
            """The echoed prompt's logprobs: the first token's are null (nothing precedes it); offsets into
            the prompt's text, which the returned text starts with."""
            tops = scores.top_logprobs or [None] * len(scores.logprobs)
            return lp_block([(prompt_ids[0], None, None), *zip(prompt_ids[1:], scores.logprobs, tops)], _Offsets(tok))

        def chunk(index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
            return {**_envelope(rid, name, "text_completion", created),
                    "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

        def no_tokens() -> dict | None:
            return generated([], _Offsets(tok)) if body.logprobs is not None else None

        if body.stream:
            offsets: dict[int, _Offsets] = {}

            def start_choice(i: int) -> dict | None:
                head = prefix[i // body.n]
                # the completion's text follows the echoed prompt, and is decoded after the prompt's ids
                offsets[i] = _Offsets(tok, len(head), ids[i // body.n])
                # an echo with logprobs is sent with the prompt's scores (the choice's first event)
                return chunk(i, head, None, no_tokens()) if head and not echo_logprobs else None

            def token_chunk(i: int, ev: PromptLogprobs | Token) -> dict | None:
                if isinstance(ev, PromptLogprobs):
                    if not echo_logprobs:
                        return None
                    return chunk(i, prefix[i // body.n], None, scored_prompt(ids[i // body.n], ev))
                if not (ev.text or body.logprobs is not None):
                    return None
                return chunk(i, ev.text, None, generated([ev], offsets[i]) if body.logprobs is not None else None)

            def usage_chunk(finishes: list[Finish]) -> dict:
                return {**_envelope(rid, name, "text_completion", created), "choices": [],
                        "usage": _usage(n_prompt, finishes)}

            events = _sse_events(choices, http, start_choice, token_chunk,
                                 lambda i, ev: chunk(i, ev.tail, ev.reason, no_tokens()),
                                 usage_chunk if body.include_usage() else None)
            return StreamingResponse(events, media_type="text/event-stream")

        collected = await choices.collect(http)
        if collected is None:
            return Response(status_code=499)  # the client went away
        out = []
        for i, finish in sorted(collected.finishes.items()):
            head = prefix[i // body.n]
            logprobs = None
            if body.logprobs is not None:
                logprobs = generated(collected.tokens.get(i, []), _Offsets(tok, len(head), ids[i // body.n]))
                if echo_logprobs:  # the prompt's tokens first, then the completion's
                    prompt = scored_prompt(ids[i // body.n], collected.prompts[i])
                    logprobs = {key: prompt[key] + logprobs[key] for key in prompt}
            out.append({"index": i, "text": head + finish.text, "logprobs": logprobs, "finish_reason": finish.reason})
        return {**_envelope(rid, name, "text_completion", created),
                "choices": out, "usage": _usage(n_prompt, list(collected.finishes.values()))}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HTTPRequest):
        check_model(body.model)
        try:
            stop, logprobs = body.stop_strings(), body.logprob_count()
        except ValueError as err:
            raise APIError(400, str(err)) from None
        ids = tok.encode_prompt(body.render())
        choices = start(choice_requests(body, [ids], body.budget(len(ids), engine.max_len), stop, logprobs))
        rid, name, created = f"chatcmpl-{uuid.uuid4().hex}", body.model or model_name, int(time.time())

        def lp_content(tokens: list[Token]) -> dict | None:
            if logprobs is None:
                return None

            def entry(token_id: int, lp: float) -> dict:
                spelled, raw = _spelling(tok, token_id)
                return {"token": spelled, "logprob": lp, "bytes": raw}

            return {"content": [{**entry(t.token_id, t.logprob),
                                 "top_logprobs": [entry(i, lp) for i, lp in (t.top_logprobs or [])]} for t in tokens]}

        def chunk(index: int, delta: dict, finish: str | None, tokens: list[Token]) -> dict:
            return {**_envelope(rid, name, "chat.completion.chunk", created),
                    "choices": [{"index": index, "delta": delta, "logprobs": lp_content(tokens),
                                 "finish_reason": finish}]}

        if body.stream:
            def usage_chunk(finishes: list[Finish]) -> dict:
                return {**_envelope(rid, name, "chat.completion.chunk", created),
                        "choices": [], "usage": _usage(len(ids), finishes)}

            events = _sse_events(
                choices, http, lambda i: chunk(i, {"role": "assistant", "content": ""}, None, []),
                lambda i, ev: chunk(i, {"content": ev.text}, None, [ev]) if ev.text or logprobs is not None else None,
                lambda i, ev: chunk(i, {"content": ev.tail} if ev.tail else {}, ev.reason, []),
                usage_chunk if body.include_usage() else None)
            return StreamingResponse(events, media_type="text/event-stream")

        collected = await choices.collect(http)
        if collected is None:
            return Response(status_code=499)  # the client went away
        tokens, _, finishes = collected
        out = [{"index": i, "message": {"role": "assistant", "content": finishes[i].text},
                "logprobs": lp_content(tokens.get(i, [])), "finish_reason": finishes[i].reason}
               for i in sorted(finishes)]
        return {**_envelope(rid, name, "chat.completion", created),
                "choices": out, "usage": _usage(len(ids), list(finishes.values()))}

    return app
