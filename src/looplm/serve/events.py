"""An HTTP request's engine requests (its choices) and the events they send back, for both ways of
answering: `collect` gathers every choice's events for one response body, `sse` writes them as
server-sent events while they arrive. Both read `Choices.stream`, which watches the client meanwhile:
a client that disconnects cancels the unfinished choices, and their slots are freed at the engine's
next step. The engine runs on its own thread and posts each event to the request's asyncio queue
through the loop's `Mailbox`, which wakes the loop once for all the events a step sends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request as HTTPRequest

from looplm.serve.engine import (
    Engine,
    EngineFull,
    EngineStopped,
    Event,
    Finish,
    PromptLogprobs,
    Request,
    RequestHandle,
    Token,
)
from looplm.serve.errors import APIError, internal

log = logging.getLogger(__name__)

POLL_S = 0.25
"""How often a request checks whether its client is still connected (whether or not tokens arrive)."""


class Mailbox:
    """Events from the engine's thread to asyncio queues of one event loop. The first event posted
    since the last delivery schedules a delivery (`call_soon_threadsafe`: a write to the loop's
    wake-up socket); those posted before it runs join it. So the events a decode step sends to its
    running requests wake the loop once, not once each. (With `batches` reading without a task per
    wait, it took the compiled server to 1.2x its tokens/s under the load test: BENCHMARKS.md.)"""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, object]] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "Mailbox":
        """The loop's mailbox (one per loop)."""
        box = _MAILBOXES.get(loop)
        if box is None:
            box = _MAILBOXES[loop] = cls(loop)
        return box

    def post(self, queue: asyncio.Queue, item: object) -> None:
        """Put `item` on `queue` (from any thread), in the order posted. Raises RuntimeError once the
        loop is closed."""
        with self._lock:
            self._items.append((queue, item))
            first = len(self._items) == 1
        if first:
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


_MAILBOXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_choice_count(engine: Engine, count: int) -> None:
    """ValueError when a request's `count` choices (prompts x n) outnumber what the engine queues: it
    would get a 429 however often it is retried. The API checks this before it tokenizes the prompts."""
    if count > engine.config.max_queue:
        raise ValueError(
            f"this request has {count} choices (prompts x n); the server queues at most "
            f"max_queue {engine.config.max_queue}"
        )


class Choices:
    """The engine requests of one HTTP request and the asyncio queue their events arrive on."""

    def __init__(self, engine: Engine, requests: Sequence[Request]):
        """Submits `requests`, all or none: ValueError for one that cannot run (or more than the queue
        holds), checked before any is queued; `EngineFull` or `EngineStopped` cancels those queued."""
        box = Mailbox.of(asyncio.get_running_loop())
        self.events: asyncio.Queue = asyncio.Queue()
        check_choice_count(engine, len(requests))
        for r in requests:
            engine.check(r)  # every choice is checked before any is queued
        self.handles: list[RequestHandle] = []
        try:
            for i, r in enumerate(requests):
                sink = (lambda i: lambda ev: box.post(self.events, (i, ev)))(i)
                self.handles.append(engine.submit(r, sink))
        except (EngineFull, EngineStopped):
            self.cancel()
            raise

    def cancel(self) -> None:
        for h in self.handles:
            if h.finish is None:
                h.cancel()

    async def stream(self, http: HTTPRequest) -> AsyncIterator[tuple[int, Event]]:
        """Events until every choice finished, one at a time (see `batches`)."""
        async for batch in self.batches(http):
            for item in batch:
                yield item

    async def batches(self, http: HTTPRequest) -> AsyncIterator[list[tuple[int, Event]]]:
        """Events until every choice finished, in arrival order, as lists: each holds every event that
        had arrived when the previous list was taken (one while the reader keeps up; more when the
        engine runs ahead, e.g. under load, so a reader pays its per-wake-up costs once for them).
        Stops, cancelling every choice, once the client goes away (watched alongside the events, so a
        steady stream of tokens cannot hide it)."""
        left = len(self.handles)
        gone = asyncio.ensure_future(self._watch(http))
        try:
            while left:
                batch = [await self.events.get()]
                while not self.events.empty():
                    batch.append(self.events.get_nowait())
                if gone.done():
                    return
                left -= sum(isinstance(ev, Finish) for _, ev in batch)
                yield batch
        finally:
            gone.cancel()  # no-op once done
            self.cancel()  # no-op for finished choices

    async def _watch(self, http: HTTPRequest) -> None:
        """Once the client has gone (or watching it failed), wakes `batches`, which then sees this task
        done, with an empty event."""
        try:
            await _client_gone(http)
        finally:
            self.events.put_nowait(_GONE)


_GONE = (-1, None)
"""What `Choices._watch` puts on the queue: not an event of any choice."""


async def _client_gone(http: HTTPRequest) -> None:
    """Returns once the client has disconnected."""
    while not await http.is_disconnected():
        await asyncio.sleep(POLL_S)


@dataclass
class Collected:
    """The events of a non-streamed request, by choice."""

    tokens: dict[int, list[Token]] = field(default_factory=dict)
    prompts: dict[int, PromptLogprobs] = field(default_factory=dict)
    """The prompt's scores of the choices that asked for them (`Request.prompt_logprobs`)."""
    finishes: dict[int, Finish] = field(default_factory=dict)

    def add(self, i: int, ev: Event) -> None:
        if isinstance(ev, Token):
            self.tokens.setdefault(i, []).append(ev)
        elif isinstance(ev, PromptLogprobs):
            self.prompts[i] = ev
        else:
            self.finishes[i] = ev


async def collect(choices: Choices, http: HTTPRequest) -> Collected | None:
    """Every choice's events (non-streaming); None if the client went away; a failed generation
    raises a 500."""
    got = Collected()
    async for i, ev in choices.stream(http):
        got.add(i, ev)
    if len(got.finishes) < len(choices.handles):
        return None
    failed = [f for f in got.finishes.values() if f.reason == "error"]
    if failed:
        raise APIError(500, failed[0].error or "generation failed", "server_error")
    return got


class Chunks(Protocol):
    """The chunks of a streamed reply: `start(i)` before choice i's first event, one per run of tokens
    that arrived together and per prompt score (None: none for it) and per finish, then `usage`
    (None: not asked for)."""

    def start(self, i: int) -> dict | None: ...

    def event(self, i: int, ev: PromptLogprobs | Sequence[Token]) -> dict | None: ...

    def finish(self, i: int, ev: Finish) -> dict: ...

    def usage(self, finishes: list[Finish]) -> dict | None: ...


async def sse(choices: Choices, http: HTTPRequest, chunks: Chunks) -> AsyncIterator[str]:
    """The server-sent events of a streamed request: its `chunks` as they arrive (a failed choice's
    finish as an error body), then the usage chunk (when asked) and `[DONE]`. Leaving early (the
    client went away) cancels the unfinished choices."""
    finishes: dict[int, Finish] = {}
    opened: set[int] = set()
    try:
        async for batch in choices.batches(http):
            out = []
            for i, ev in _runs(batch):
                if i not in opened:
                    opened.add(i)
                    out.append(chunks.start(i))
                if isinstance(ev, Finish):
                    finishes[i] = ev
                    failed = ev.reason == "error"
                    out.append(
                        APIError(500, ev.error or "generation failed", "server_error").body()
                        if failed
                        else chunks.finish(i, ev)
                    )
                else:
                    out.append(chunks.event(i, ev))
            text = "".join(_sse(data) for data in out if data is not None)
            if text:
                yield text
        if len(finishes) == len(choices.handles):
            usage = chunks.usage(list(finishes.values()))
            if usage is not None:
                yield _sse(usage)
            yield _sse("[DONE]")
    except Exception as err:  # a bug past the 200: the stream ends with an error body, not silently
        log.error("streaming failed", exc_info=err)
        yield _sse(internal(err).body())
    finally:
        choices.cancel()  # no-op for finished choices


def _runs(batch: list[tuple[int, Event]]) -> list[tuple[int, Event | list[Token]]]:
    """The batch's events in order, each run of consecutive tokens of one choice as one list."""
    out: list = []
    for i, ev in batch:
        if isinstance(ev, Token):
            if out and out[-1][0] == i and isinstance(out[-1][1], list):
                out[-1][1].append(ev)
            else:
                out.append((i, [ev]))
        else:
            out.append((i, ev))
    return out


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
