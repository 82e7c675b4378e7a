"""An OpenAI-compatible HTTP API over the continuous-batching `Engine` (FastAPI; design §15).

Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming with server-sent events or
not), GET /v1/models, GET /health, GET /metrics (Prometheus). Errors use OpenAI's body
`{"error": {"message", "type", "param", "code"}}`: 400 for a request that cannot run (checked before
it is queued, including one with more choices than the queue holds), 401 for a wrong API key, 404
for an unknown model, 429 when the queue is full, 503 while the server shuts down. The engine runs on
its own thread; each HTTP request waits on an asyncio queue its events are posted to, and watches
its client meanwhile: a client that disconnects (streaming or not) cancels its requests, and their
slots are freed at the engine's next step.

Layout. This module holds the app: `create_app` puts a `ServerState` (engine, model name, metrics)
on `app.state`, which each endpoint receives through the `ServerDep` dependency, and includes two
routers of module-level endpoints, `ops` (/health, /metrics) and `v1` (/v1/...); a /v1/ request
without the API key is refused (401) by an ASGI middleware, before its body is read and whatever its
path (a router dependency would run after the body's parsing, and on known paths only).
An endpoint checks its body, builds its engine requests (`choice_requests`), submits them
(`events.Choices`) and answers with `_respond`: streamed (`events.sse`) or whole (`events.collect`),
its bodies made by a reply of `serve.replies`. Errors are raised as exceptions (`errors.APIError`,
the engine's `EngineFull` and `EngineStopped`, FastAPI's validation errors) and turned into OpenAI's
bodies by the app's exception handlers (`errors.HANDLERS`).
"""

from __future__ import annotations

import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from looplm.data import Tokenizer
from looplm.serve.engine import Engine, Request
from looplm.serve.errors import HANDLERS, APIError, bad_request
from looplm.serve.events import Choices, check_choice_count, collect, sse
from looplm.serve.protocol import ChatRequest, CompletionRequest
from looplm.serve.replies import ChatReply, CompletionReply, Envelope


@dataclass(frozen=True)
class ServerState:
    """What the endpoints share, kept on `app.state.server`."""

    engine: Engine
    model_name: str
    """The model id clients name (a request naming another is a 404)."""
    created: int
    """When the app was made: the model's `created` in /v1/models."""
    metrics: CollectorRegistry
    """What /metrics reports (`_EngineCollector`)."""

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer


async def _server_state(http: HTTPRequest) -> ServerState:  # async: FastAPI runs a `def` one in a thread
    return http.app.state.server


ServerDep = Annotated[ServerState, Depends(_server_state)]
"""An endpoint's parameter annotated `ServerDep` receives its app's `ServerState`."""


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
                refusal = APIError(
                    401,
                    "invalid or missing API key (Authorization: Bearer ...)",
                    "authentication_error",
                    code="invalid_api_key",
                ).response()
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
            "speculative_acceptance_rate": "Draft tokens accepted / proposed since the start (0 before any)",
            "cache_bytes_in_use": "KV-cache bytes holding live tokens",
            "cache_bytes_capacity": "KV-cache bytes preallocated for all slots",
        }
        for name, doc in gauges.items():
            yield GaugeMetricFamily(f"looplm_{name}", doc, value=s[name])
        for name, doc in (
            ("generated_tokens", "Tokens generated"),
            ("prompt_tokens", "Prompt tokens prefilled"),
            ("speculative_drafted", "Draft tokens proposed by speculative rounds"),
            ("speculative_accepted", "Draft tokens the verifier accepted"),
            ("prefill_seconds", "Seconds the engine spent prefilling prompts (with their first token)"),
            ("decode_seconds", "Seconds the engine spent in decode steps"),
        ):
            yield CounterMetricFamily(f"looplm_{name}", doc, value=s[f"{name}_total"])
        done = CounterMetricFamily("looplm_requests_finished", "Finished sequences by reason", labels=["reason"])
        for reason, count in sorted(s["finished_total"].items()):
            done.add_metric([reason], count)
        yield done


@asynccontextmanager
async def _lifespan(app: FastAPI):
    """The engine thread runs while the app does."""
    engine = app.state.server.engine
    engine.start()
    try:
        yield
    finally:
        engine.shutdown()


ops = APIRouter()
"""The operator's endpoints (no API key needed)."""
v1 = APIRouter(prefix="/v1")
"""OpenAI's endpoints."""


def create_app(engine: Engine, model_name: str, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` as model `model_name`; the engine thread runs with the app."""
    app = FastAPI(
        title="looplm", summary="OpenAI-compatible looped-LM server", lifespan=_lifespan, exception_handlers=HANDLERS
    )
    metrics = CollectorRegistry()
    metrics.register(_EngineCollector(engine))
    app.state.server = ServerState(engine, model_name, int(time.time()), metrics)
    app.include_router(ops)
    app.include_router(v1)
    if api_key is not None:
        app.add_middleware(_RequireKey, key=api_key)
    return app


@ops.get("/health")
async def health(state: ServerDep):
    return {"status": "ok", "running_sequences": state.engine.running, "waiting": state.engine.waiting}


@ops.get("/metrics")
async def metrics(state: ServerDep):
    return Response(generate_latest(state.metrics), media_type=CONTENT_TYPE_LATEST)


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "looplm",
        "max_model_len": state.engine.max_len,
    }


@v1.get("/models")
async def models(state: ServerDep):
    return {"object": "list", "data": [_model_card(state)]}


@v1.get("/models/{model_id:path}")
async def model(model_id: str, state: ServerDep):
    _check_model(state, model_id)
    return _model_card(state)


@v1.post("/completions")
async def completions(body: CompletionRequest, http: HTTPRequest, state: ServerDep):
    _check_model(state, body.model)
    with bad_request(param="stop"):
        stop = body.stop_strings()
    prompts = body.prompts()
    with bad_request():  # before tokenizing, which a refused request should not cost
        check_choice_count(state.engine, len(prompts) * body.n)
    ids = [_encode(state.tokenizer, p) for p in prompts]
    # echo with logprobs scores the prompt too (OpenAI's legacy API); max_tokens 0 (echo only) needs
    # the engine's scoring pass even without logprobs: it is what such a request runs
    score = body.echo and (body.logprobs is not None or body.max_tokens == 0)
    requests = choice_requests(
        body,
        ids,
        body.max_tokens,
        stop,
        body.logprobs,
        depth=state.engine.config.depth,
        prompt_logprobs=(body.logprobs or 0) if score else None,
    )
    choices = _submit(state, requests)
    reply = CompletionReply(state.tokenizer, body, ids, _envelope("cmpl", body, state))
    return await _respond(choices, http, reply, body.stream)


@v1.post("/chat/completions")
async def chat(body: ChatRequest, http: HTTPRequest, state: ServerDep):
    _check_model(state, body.model)
    with bad_request():
        stop, logprobs = body.stop_strings(), body.logprob_count()
        check_choice_count(state.engine, body.n)
    ids = state.tokenizer.encode_prompt(body.render())
    choices = _submit(
        state,
        choice_requests(
            body, [ids], body.budget(len(ids), state.engine.max_len), stop, logprobs, depth=state.engine.config.depth
        ),
    )
    reply = ChatReply(state.tokenizer, body, len(ids), logprobs, _envelope("chatcmpl", body, state))
    return await _respond(choices, http, reply, body.stream)


def _check_model(state: ServerState, name: str | None) -> None:
    if name not in (None, state.model_name):
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {state.model_name!r}",
            "not_found_error",
            param="model",
            code="model_not_found",
        )


def _encode(tok: Tokenizer, prompt: str | list[int]) -> list[int]:
    return tok.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)


def choice_requests(
    body: CompletionRequest | ChatRequest,
    prompts_ids: list[list[int]],
    max_tokens: int,
    stop: tuple[str, ...],
    logprobs: int | None,
    *,
    depth: int,
    prompt_logprobs: int | None = None,
) -> list[Request]:
    """The engine requests of an HTTP request: `body.n` choices per prompt, choice k seeded `seed + k`
    (a random seed when the body sets none), at the body's depth or else `depth` (the server's)."""
    seed = body.seed if body.seed is not None else secrets.randbits(31)
    return [
        Request(
            ids,
            body.sampling(max_tokens, stop, seed + k),
            body.depth_rule(depth),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            **body.speculation(),
        )
        for ids in prompts_ids
        for k in range(body.n)
    ]


def _submit(state: ServerState, requests: list[Request]) -> Choices:
    """Queues every choice or none: one that cannot run is a 400 (a full queue and a stopped engine
    raise `EngineFull` and `EngineStopped`, which the handlers answer 429 and 503)."""
    with bad_request():
        return Choices(state.engine, requests)


def _envelope(kind: str, body: CompletionRequest | ChatRequest, state: ServerState) -> Envelope:
    """The reply's id (`cmpl-...`, `chatcmpl-...`), model and time (read once: every chunk has it)."""
    return Envelope(f"{kind}-{uuid.uuid4().hex}", body.model or state.model_name, int(time.time()))


async def _respond(
    choices: Choices, http: HTTPRequest, reply: CompletionReply | ChatReply, stream: bool
) -> Response | dict:
    """The answer to a submitted request: server-sent events as its events arrive, or one body once
    every choice has finished (a 499, with no body, if the client left before)."""
    if stream:
        return StreamingResponse(sse(choices, http, reply), media_type="text/event-stream")
    got = await collect(choices, http)
    if got is None:
        return Response(status_code=499)  # the client went away
    return reply.whole(got)
