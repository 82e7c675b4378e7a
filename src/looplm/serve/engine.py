"""Continuous batching on the terminal (or full) KV cache with per-row, per-token depth (design §15).

One engine owns the model and a `SlotPool` of `max_batch` cache slots. Between decode steps it
prefills waiting requests into free slots (each prompt alone, so its cache equals what
`looplm generate` builds for it); every decode step feeds one token per running row, each row at
its own position, depth rule (`DepthRule`: depth, adaptive exit) and sampling settings (`extend`
with per-row lengths and depths); a finished or cancelled row frees its slot at once. Greedy
outputs therefore equal `looplm.infer.generate` on each prompt alone (with speculation:
with the full cache; on the terminal cache a row's tokens come from its verify chunks' windows).

The engine is a library class: `submit` a `Request`, read its events from the returned handle (or
give a `sink` callback), and either drive it with `step()` or run it on its own thread (`start()`).
`looplm.serve.api` puts it behind an OpenAI-compatible HTTP server.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from looplm.data import Tokenizer
from looplm.errors import UserError
from looplm.infer.decode import SamplingConfig, TextStream, choose, token_vocab
from looplm.infer.depth_rule import DepthRule, check_depth
from looplm.infer.prefill import Prefill, check_arm_cache
from looplm.infer.speculative import Speculation
from looplm.infer.step import DecodeStep, StepRows
from looplm.model.exits import DepthPlan
from looplm.serve.slots import SlotPool
from looplm.serve.speculation import check_room, speculative_round

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    """The engine's capacity and defaults."""

    max_batch: int = 8
    """Cache slots: sequences decoded together."""
    max_seq_len: int | None = None
    """Positions per slot (prompt + generated tokens); default and cap: the model's context."""
    depth: int = 5
    """Recurrences per token when a request gives no depth."""
    max_depth: int | None = None
    """Deepest request accepted; default: the model's max_depth (terminal) or `depth` (full: the
    cache keeps one bank per layer visit up to it)."""
    cache: Literal["terminal", "full"] = "terminal"
    """terminal: one KV bank per physical layer; full: one bank per layer visit."""
    max_queue: int = 64
    """Requests waiting for a slot; more are refused (`EngineFull`, HTTP 429)."""
    compile: bool = False
    """Decode through the compiled static step (`looplm.infer.step.DecodeStep`, one graph per batch
    bucket 1, 2, 4, ... max_batch) and prefill each prompt as one compiled chunk padded to a length
    bucket 32, 64, ... max_seq_len (the student prefill arm stays eager); otherwise eager steps in
    which rows that stopped leave the recurrence (a step costs the sum of its rows' depths)."""
    speculate: int = 0
    """Self-speculative decoding: draft this many tokens per row at `draft_depth`, then verify them in
    one chunk at the rows' depth (`looplm.serve.speculation`); 0 = off. A request may turn it off
    or change k and the draft depth. Whether a row speculates depends on its own request alone (k > 0,
    no exit_tau, its depth above the draft depth, room in its slot); rows of one plan speculate
    together, the others are carried or ride along (`Engine._plan`)."""
    draft_depth: int = 2
    """Recurrences per draft token (below the depth) with `speculate`."""
    key_range: bool = False
    """With `compile`: a step attends over the positions its longest row has filled (rounded up to 16),
    not the whole slot (`DecodeStep(keys=...)`: one graph per batch bucket with a dynamic key length).
    Faster steps while rows are short of the context (1.33x at 96 of 256 keys, batch 12, on a CPU), for
    a longer warm-up (dynamic graphs compile slower: on a 2-core CPU minutes per batch bucket)."""

    def check(self, max_depth: int | None = None, max_seq_len: int | None = None, *, prefix: str = "") -> None:
        """Raise UserError with a one-line reason for a setting out of range; against the model's
        `max_depth` and context `max_seq_len` when they are given (`Engine` gives them). `prefix` "--"
        names the settings as `looplm serve`'s options, which checks them before the model loads."""

        def name(key: str) -> str:
            return prefix + (key.replace("_", "-") if prefix else key)

        for key in ("max_batch", "max_queue", "depth"):
            if getattr(self, key) < 1:
                raise UserError(f"{name(key)} must be >= 1, got {getattr(self, key)}")
        if self.max_depth is not None and self.max_depth < self.depth:
            raise UserError(f"{name('max_depth')} ({self.max_depth}) must be >= {name('depth')} ({self.depth})")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise UserError(f"{name('max_seq_len')} must be >= 2, got {self.max_seq_len}")
        if self.speculate < 0:
            raise UserError(f"{name('speculate')} must be >= 0 (0 = off), got {self.speculate}")
        if self.key_range and not self.compile:
            raise UserError(f"{name('key_range')} is for compiled steps: add {name('compile')}")
        if self.speculate:
            check_depth(name("draft_depth"), self.draft_depth, self.depth - 1, f"below {name('depth')} {self.depth}")
            slot = self.max_seq_len or max_seq_len
            if slot is not None:
                check_room(name("speculate"), self.speculate, slot)
        if max_depth is not None:
            for key in ("depth", "max_depth"):
                if getattr(self, key) is not None:
                    check_depth(name(key), getattr(self, key), max_depth, "the model's max_depth")
        if max_seq_len is not None and self.max_seq_len is not None and self.max_seq_len > max_seq_len:
            raise UserError(
                f"{name('max_seq_len')} must be in 2..{max_seq_len} (the model's context), got {self.max_seq_len}"
            )


@dataclass
class Request:
    """One sequence to generate (an OpenAI choice)."""

    prompt_ids: list[int]
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(max_new_tokens=16))
    """How its tokens are chosen and when it stops (default: greedy, 16 new tokens, as OpenAI's
    max_tokens); `max_new_tokens` may be 0 with `prompt_logprobs`: the prompt is only scored."""
    rule: DepthRule | None = None
    """Its recurrences (decode and prefill depth, exit rule); default: the engine's depth."""
    logprobs: int | None = None
    """Return each chosen token's log-probability and the `logprobs` most likely alternatives."""
    prompt_logprobs: int | None = None
    """Also score the prompt (a `PromptLogprobs` event before the first token): each prompt token's
    log-probability after the tokens before it, and the `prompt_logprobs` most likely tokens there.
    With it, `sampling.max_new_tokens` may be 0: the prompt is only scored."""
    example_id: int = 0
    """Seeds the initial recurrent state by (example id, position), as `generate` does (row 0 alone)."""
    speculate: int | None = None
    """Draft tokens per verify chunk (0 = no speculation); default: the engine's `speculate`."""
    draft_depth: int | None = None
    """Recurrences per draft token; default: the engine's `draft_depth`."""


@dataclass
class PromptLogprobs:
    """A prompt's scores from its prefill pass (the logits that also choose the first token), emitted
    before any `Token` of a request with `prompt_logprobs`. Entry j is about prompt token j + 1 (the
    first token has no context to be scored in)."""

    logprobs: list[float]
    """log p(prompt[j + 1] | prompt[:j + 1]) at the request's prefill depth."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """The `prompt_logprobs` most likely (token id, log-probability) at each of those positions, most
    likely first; None when `prompt_logprobs` is 0."""


@dataclass
class Token:
    """One generated token. `text` is the new text it releases (empty while it may still turn into
    a stop string or an incomplete character)."""

    token_id: int
    text: str
    depth: int
    """Recurrences that produced this token's logits (the prefill depth for the first token)."""
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class Finish:
    """The end of a request: `tail` is text not yet released by a `Token` event."""

    reason: Literal["stop", "length", "cancelled", "error"]
    text: str
    tail: str
    prompt_tokens: int
    completion_tokens: int
    mean_decode_depth: float
    error: str | None = None


Event = PromptLogprobs | Token | Finish


class ContextOverflow(ValueError):
    """A request needs more positions than a slot holds (its prompt, or its prompt and max_tokens)."""


class EngineFull(RuntimeError):
    """The waiting queue is full (back-pressure: retry later)."""


class EngineStopped(RuntimeError):
    """The engine has been shut down; it takes no requests until `start()` again."""


class RequestHandle:
    """A submitted request: cancel it, or read its events when no sink was given."""

    def __init__(self, request: Request, rule: DepthRule, sink: Callable[[Event], None] | None):
        self.request, self.rule = request, rule
        self._events: queue.Queue | None = None if sink is not None else queue.Queue()
        self._sink = sink if sink is not None else self._events.put
        self._cancelled = threading.Event()
        self.finish: Finish | None = None
        self.sink_error: str | None = None

    def cancel(self) -> None:
        """Stop generating; the slot is freed at the engine's next step (the tokens its current step
        already decided, a speculative round's window, may still arrive)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, event: Event) -> None:
        if isinstance(event, Finish):
            self.finish = event
        try:
            self._sink(event)
        except Exception as err:  # noqa: BLE001 - a broken consumer ends its own request, not the engine
            if self.sink_error is None:
                log.exception("a request's event sink raised; the request is dropped")
                self.sink_error = f"event sink: {type(err).__name__}: {err}"
            self._cancelled.set()  # the engine finishes it as an error at its next step

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Events until (and including) the `Finish` (handles without a sink)."""
        if self._events is None:
            raise RuntimeError("this request's events go to its sink")
        while True:
            event = self._events.get(timeout=timeout)
            yield event
            if isinstance(event, Finish):
                return


@dataclass
class _Row:
    """A running sequence in slot i (its index in `Engine._rows`)."""

    handle: RequestHandle
    generator: torch.Generator | None
    stream: TextStream
    next_token: int = -1
    depths: list[int] = field(default_factory=list)  # recurrences of each decode step

    @property
    def rule(self) -> DepthRule:
        return self.handle.rule


class Engine:
    """Continuous batching over a `SlotPool` (see the module docstring)."""

    def __init__(
        self,
        model,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        *,
        prefill: Prefill | None = None,
        compile_options: dict | None = None,
    ):
        """`compile_options` go to `torch.compile` for a compiled engine's steps (`DecodeStep`), e.g. another backend."""
        self.model, self.tokenizer = model.eval(), tokenizer
        self.config = config = config or EngineConfig()
        self.prefill = prefill or Prefill()
        param = next(model.parameters())
        self.device = param.device
        config.check(model.cfg.max_depth, model.cfg.max_seq_len)
        check_arm_cache(self.prefill.arm, config.cache)
        self.max_depth = config.max_depth or (model.cfg.max_depth if config.cache == "terminal" else config.depth)
        max_len = config.max_seq_len or model.cfg.max_seq_len
        self.pool = SlotPool(
            model.cfg,
            config.max_batch,
            max_len,
            mode=config.cache,
            depth=self.max_depth,
            device=self.device,
            dtype=param.dtype,
        )
        # the static step: the compiled engine's every step, and the speculative rounds (a request may
        # speculate on an engine that does not by default)
        # logits cover the tokenizer's ids (a release may pad the model's embedding past them)
        self.vocab = token_vocab(model, tokenizer)
        self._step = DecodeStep(
            model, self.pool.cache, compile=config.compile, compile_options=compile_options, vocab=self.vocab
        )
        # compiled: prompts prefill as one chunk of a bucketed length through a step of their own (its
        # cache: the claimed slot's row); the student arm runs eagerly
        compiled_prefill = config.compile and self.prefill.arm != "student"
        self._prefill_step = (
            DecodeStep(model, compile=True, compile_options=compile_options, static_keys=True, vocab=self.vocab)
            if compiled_prefill
            else None
        )
        self._rows: list[_Row] = []
        self._pending: deque[RequestHandle] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        # counters for /metrics
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.finished: dict[str, int] = {}
        self.decoded_tokens = 0  # tokens decode steps emitted, and their recurrences summed
        self.decode_depth_sum = 0
        self.drafted_tokens = 0  # speculative rounds: drafts proposed and accepted
        self.accepted_tokens = 0
        self.prefill_seconds = 0.0  # the engine's busy time: prompts (with their first token), decode steps
        self.decode_seconds = 0.0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps, for the rate
        self._stats_lock = threading.Lock()  # `stats()` runs on the server's thread

    # -- admission -------------------------------------------------------------------------------
    @property
    def max_len(self) -> int:
        return self.pool.max_len

    @property
    def running(self) -> int:
        """Sequences in the running batch."""
        return len(self._rows)

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._pending)

    def rule(self, request: Request) -> DepthRule:
        """The request's depth rule, the engine's depth when it gives none."""
        return request.rule if request.rule is not None else DepthRule(self.config.depth)

    def speculation(self, request: Request) -> tuple[int, int]:
        """(draft tokens k, draft depth) of a request, defaults filled in; k = 0: no speculation. A
        request that sets neither decodes plainly where its depth is not above the engine's draft
        depth (it asked for no speculation; the engine's default does not fit it)."""
        k = self.config.speculate if request.speculate is None else request.speculate
        draft_depth = self.config.draft_depth if request.draft_depth is None else request.draft_depth
        if request.speculate is None and request.draft_depth is None and draft_depth >= self.rule(request).depth:
            return 0, draft_depth
        return k, draft_depth

    def check(self, request: Request) -> DepthRule:
        """The request's depth rule; ValueError (a UserError) with a one-line reason if it cannot run."""
        sampling = request.sampling
        if sampling.max_new_tokens == 0 and request.prompt_logprobs is not None:
            sampling = replace(sampling, max_new_tokens=1)  # only scored: the other settings are still checked
        sampling.validate()
        rule = self.rule(request).check(
            self.max_depth, cache=self.config.cache, what="the server's max_depth, looplm serve --max-depth"
        )
        max_tokens = request.sampling.max_new_tokens
        k, draft_depth = self.speculation(request)
        if k < 0:
            raise UserError(f"speculate must be >= 0 (0 = off), got {k}")
        if k:
            Speculation(k, draft_depth).check(rule.depth)
            check_room("speculate", k, self.max_len)
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < self.vocab for t in request.prompt_ids):  # ids the model and the tokenizer know
            raise ValueError(f"prompt token ids must be in 0..{self.vocab - 1}")
        if len(request.prompt_ids) > self.max_len:
            raise ContextOverflow(
                f"the prompt has {len(request.prompt_ids)} tokens, more than the context of {self.max_len}"
            )
        need = len(request.prompt_ids) + max(max_tokens, 1) - 1  # the last new token is never fed
        if need > self.max_len:
            raise ContextOverflow(
                f"the prompt has {len(request.prompt_ids)} tokens; with max_tokens {max_tokens} "
                f"it needs {need} positions, more than the context of {self.max_len}"
            )
        if request.logprobs is not None and not 0 <= request.logprobs <= 20:
            raise ValueError(f"logprobs must be in 0..20, got {request.logprobs}")
        if request.prompt_logprobs is not None and not 0 <= request.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in 0..20, got {request.prompt_logprobs}")
        return rule

    def submit(self, request: Request, sink: Callable[[Event], None] | None = None) -> RequestHandle:
        """Queue a request (ValueError if it cannot run, EngineFull if the queue is full,
        EngineStopped after `shutdown()`)."""
        handle = RequestHandle(request, self.check(request), sink)
        with self._wake:
            if self._stopping:
                raise EngineStopped("the engine has been shut down; start() it again to submit requests")
            if len(self._pending) >= self.config.max_queue:
                raise EngineFull(
                    f"{len(self._pending)} requests are already waiting (max_queue "
                    f"{self.config.max_queue}); retry later"
                )
            self._pending.append(handle)
            self._wake.notify()
        return handle

    # -- the loop --------------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit waiting requests into free slots, then one decode step. False when idle."""
        self._drop_cancelled()
        t0 = time.perf_counter()
        admitted = self._admit()
        t1 = time.perf_counter()
        decoding = bool(self._rows)
        if decoding:
            self._decode()
        t2 = time.perf_counter()
        with self._stats_lock:
            self.prefill_seconds += t1 - t0 if admitted else 0.0
            self.decode_seconds += t2 - t1 if decoding else 0.0
        return decoding or admitted

    def run_until_done(self, handles: Sequence[RequestHandle]) -> list[Finish]:
        """Drive the engine on this thread until `handles` finish (library use without a thread)."""
        if self._thread is not None:
            raise RuntimeError("the engine runs on its own thread; read the handles' events instead")
        while any(h.finish is None for h in handles):
            if not self.step() and any(h.finish is None for h in handles):
                raise RuntimeError("the engine is idle but requests are unfinished")
        return [h.finish for h in handles]

    def generate(self, requests: Sequence[Request]) -> list[Finish]:
        """Submit `requests` together and run them to the end (library convenience)."""
        handles = [self.submit(r, sink=lambda e: None) for r in requests]
        return self.run_until_done(handles)

    def start(self) -> "Engine":
        """Run the loop on a daemon thread until `shutdown()`."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="looplm-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for row in list(self._rows):
            self._finish(0, "cancelled")
        while self._pending:
            self._finish_unstarted(self._pending.popleft(), "cancelled")

    def _loop(self) -> None:
        while not self._stopping:
            try:
                busy = self.step()
            except Exception as err:  # noqa: BLE001 - the engine must outlive any one batch
                log.exception("decode step failed; failing the running requests")
                while self._rows:
                    self._finish(0, "error", error=f"{type(err).__name__}: {err}")
                busy = False
            if not busy:
                with self._wake:
                    if not self._pending and not self._stopping:
                        self._wake.wait(0.1)

    def _drop_cancelled(self) -> None:
        i = 0
        while i < len(self._rows):
            handle = self._rows[i].handle
            if handle.cancelled:  # the last row moves into slot i: look at i again
                self._finish(i, "error" if handle.sink_error else "cancelled", error=handle.sink_error)
            else:
                i += 1
        with self._wake:
            cancelled = [h for h in self._pending if h.cancelled]
            for h in cancelled:
                self._pending.remove(h)
        for h in cancelled:
            self._finish_unstarted(h, "error" if h.sink_error else "cancelled", h.sink_error)

    def _finish_unstarted(self, handle: RequestHandle, reason: str, error: str | None = None) -> None:
        """End a request that never became a row (cancelled in the queue, its prefill failed, the
        engine stopped): counted as every finished request is, with its prompt's size."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
        handle.emit(Finish(reason, "", "", len(handle.request.prompt_ids), 0, 0.0, error=error))

    def _admit(self) -> bool:
        admitted = False
        while self.pool.free:
            with self._wake:
                if not self._pending:
                    break
                handle = self._pending.popleft()
            admitted = True
            try:
                self._prefill(handle)
            except Exception as err:  # noqa: BLE001 - one bad prompt must not stop the server
                log.exception("prefill failed")
                message = f"{type(err).__name__}: {err}"
                mine = [i for i, row in enumerate(self._rows) if row.handle is handle]
                if mine:
                    self._finish(mine[0], "error", error=message)
                    continue
                if len(self._rows) < self.pool.running:  # the slot was claimed but the row not added
                    self.pool.release(self.pool.running - 1)
                self._finish_unstarted(handle, "error", message)
        return admitted

    def _prefill(self, handle: RequestHandle) -> None:
        req, rule, sampling = handle.request, handle.rule, handle.request.sampling
        slot, view = self.pool.claim()
        tokens = torch.tensor([req.prompt_ids], dtype=torch.long, device=self.device)
        ids = torch.tensor([req.example_id], device=self.device)
        if self._prefill_step is not None:
            logits = self._compiled_prefill(view, req.prompt_ids, ids, self.prefill.teacher_depth(rule.prefill))
        else:
            logits = self.prefill(self.model, tokens, view, rule.prefill, example_ids=ids)[0, :, : self.vocab]
        self.pool.set_length(slot, len(req.prompt_ids))
        gen = torch.Generator(device=self.device).manual_seed(sampling.seed) if sampling.temperature > 0 else None
        row = _Row(handle, gen, TextStream(self.tokenizer, sampling.stop, context=req.prompt_ids))
        self._rows.append(row)
        self.prompt_tokens += len(req.prompt_ids)
        if req.prompt_logprobs is not None:
            handle.emit(_score_prompt(logits[:-1], tokens[0, 1:], req.prompt_logprobs))
        if sampling.max_new_tokens == 0:  # only scored
            self._finish(slot, "error" if handle.sink_error else "length", error=handle.sink_error)
            return
        self._accept(slot, logits[-1], self.prefill.teacher_depth(rule.prefill))

    @torch.no_grad()
    def _decode(self) -> None:
        """One decode step of every running row. A row's kind of step depends on its own request and
        length only (`_plan`), so its tokens do not depend on what else runs: the rows that speculate
        with one plan run a speculative round together, the others a plain step together. A plain
        row at a round's depth, without adaptive exit and with room for its chunk, takes its plain
        step inside that round: the verify chunk's first position is exactly a one-token step.
        Otherwise each kind is a sub-step over every running row in which the other rows ride along:
        they write only at or past their length (which their own next step overwrites before
        anything reads it), and nothing of theirs is chosen or counted."""
        lengths = self.pool.lengths
        plans = [self._plan(row, lengths[i]) for i, row in enumerate(self._rows)]
        rounds = list(dict.fromkeys(p for p in plans if p is not None))
        speculating: dict = {p: set() for p in rounds}  # plan -> its rows, and the plain rows it carries
        carried: dict = {p: set() for p in rounds}
        plain: set[int] = set()
        for i, (row, plan) in enumerate(zip(self._rows, plans)):
            if plan is not None:
                speculating[plan].add(id(row))
                continue
            home = next(
                (
                    p
                    for p in rounds
                    if p[0] == row.rule.depth and row.rule.exit_tau is None and lengths[i] + p[1] + 1 <= self.max_len
                ),
                None,
            )
            (carried[home] if home is not None else plain).add(id(row))
        for plan in rounds:  # rows finish (and move) in each sub-step: find the members again
            self._speculate(
                plan, [id(r) in speculating[plan] for r in self._rows], [id(r) in carried[plan] for r in self._rows]
            )
        if plain:
            self._plain([id(r) in plain for r in self._rows])

    def _plan(self, row: _Row, length: int) -> tuple[int, int, int] | None:
        """(depth, k, draft depth) of a row that speculates in this step, None for a plain step: its
        request speculates (`speculation`) at a fixed depth above the draft depth, and its slot has
        room for the verify chunk of k + 1 tokens."""
        k, draft_depth = self.speculation(row.handle.request)
        depth = row.rule.depth
        if not k or row.rule.exit_tau is not None or length + k + 1 > self.max_len:  # k > 0: r_d < depth (`check`)
            return None
        return depth, k, draft_depth

    def _plain(self, members: list[bool]) -> None:
        """One plain step (one token per row at its depth rule) of the `members` rows; the others ride
        along at their length and the lowest member depth."""
        rows = self._rows
        slots = [i for i, m in enumerate(members) if m]
        low = min(rows[i].rule.depth for i in slots)
        depths = [r.rule.depth if m else low for r, m in zip(rows, members)]
        taus = [r.rule.exit_tau if m else None for r, m in zip(rows, members)]
        step = self._compiled_step if self.config.compile else self._eager_step
        logits, used_t = step([r.next_token for r in rows], depths, taus, [r.handle.request.example_id for r in rows])
        for i in slots:
            self.pool.set_length(i, self.pool.lengths[i] + 1)
        used = used_t.tolist()
        for i in slots:
            rows[i].depths.append(used[i])
        greedy = logits.argmax(-1).tolist()  # one host sync for every greedy row
        # rows finish (and move) while we go: walk from the end so the rows not yet seen stay put
        emitted = [
            i
            for i in reversed(slots)
            if self._accept(i, logits[i], used[i], None if rows[i].generator is not None else greedy[i])
        ]
        self._count(len(emitted), sum(used[i] for i in emitted))

    def _speculate(self, plan: tuple[int, int, int], members: list[bool], carried: list[bool]) -> None:
        """One speculative round (`looplm.serve.speculation`) of the `members` rows, which share `plan`.
        The `carried` rows (plain, at the plan's depth) take one token from the verify chunk's first
        position, their plain step. The others ride along. Rows that do not speculate are drafted
        greedily (their generators untouched) and written at their length, or, riding along short
        of room for the chunk, in their slot's last k + 1 positions, whose entries are put back after
        the round."""
        rows, dev = self._rows, self.device
        n = len(rows)
        depth, k, draft_depth = plan
        B = self._bucket(n) if self.config.compile else n
        extra = B - n
        write_at, saved = list(self.pool.lengths), []
        for i, m in enumerate(members):
            if not m and not carried[i] and write_at[i] + k + 1 > self.max_len:
                start = self.max_len - k - 1
                saved.append((i, start, self.pool.save(i, start, write_at[i])))
                write_at[i] = start

        def padded(values: list) -> torch.Tensor:
            return torch.tensor(values + [0] * extra, dtype=torch.long, device=dev)

        step_rows = StepRows(
            padded([r.next_token for r in rows]),
            padded(write_at),
            torch.zeros(B, dtype=torch.long, device=dev),
            padded([r.handle.request.example_id for r in rows]),
        )
        result = speculative_round(
            self._step,
            step_rows,
            n,
            depth=depth,
            draft_depth=draft_depth,
            k=k,
            sampling=[r.handle.request.sampling for r in rows],
            generators=[r.generator for r in rows],
            keys=self._keys(k + 1),
            members=members,
        )
        for i, start, entries in saved:
            self.pool.restore(i, start, entries)
        decided = sum(len(t) for t in result.tokens)
        for slot, t in enumerate(result.tokens):  # the last token stays unfed: it opens the next round
            self.pool.set_length(slot, self.pool.lengths[slot] + len(t) + carried[slot])
        emitted = 0  # a row that finishes inside its window (max_tokens, EOS, a stop) emits no more of it
        for i in range(n - 1, -1, -1):  # rows finish (and move) while we go: from the end
            row = rows[i]
            if carried[i]:  # its plain step: chosen as a plain step chooses
                row.depths.append(depth)
                emitted += self._accept(i, result.logits[i, 0], depth)
                continue
            for j, tok in enumerate(result.tokens[i]):
                row.depths.append(depth)
                emitted += self._accept(i, result.logits[i, j], depth, tok)
                if i >= len(rows) or rows[i] is not row:  # finished: its slot is free (or another row's)
                    break
        # acceptance counts the verifier's decisions, emitted or not; tokens, what the rows emitted
        members_n = sum(members)
        self._count(emitted, depth * emitted, drafted=result.drafted, accepted=decided - members_n)

    def _eager_step(self, tokens: list[int], depths: list[int], taus: list, example_ids: list[int]):
        """One step through the model's cached forward on the running rows' view, cut at the longest
        row: rows that stopped leave the recurrence (a step costs the sum of its rows' depths)."""
        dev = self.device
        kw: dict = {}
        if any(t is not None for t in taus):
            kw["exit_tau"] = torch.tensor([t or 0.0 for t in taus], device=dev)
            kw["min_depth"] = torch.tensor([r.rule.min_depth for r in self._rows], device=dev)
        depth = depths[0] if len(set(depths)) == 1 and not kw else torch.tensor(depths, device=dev)
        out = self.model(
            torch.tensor(tokens, device=dev)[:, None],
            DepthPlan(depth, **kw),
            cache=self.pool.decode_view(),
            init="seeded",
            example_ids=torch.tensor(example_ids, device=dev),
        )
        return out.logits[:, -1, : self.vocab], out.depths[:, 0]

    def _count(self, tokens: int, depth_sum: int, *, drafted: int = 0, accepted: int = 0) -> None:
        """A decode step's counters for /metrics: tokens it produced, their recurrences, its drafts."""
        now = time.monotonic()
        with self._stats_lock:
            self.decoded_tokens += tokens
            self.decode_depth_sum += depth_sum
            self.drafted_tokens += drafted
            self.accepted_tokens += accepted
            self._recent.append((now, tokens))
            while now - self._recent[0][0] > 60.0:
                self._recent.popleft()

    def _bucket(self, n: int) -> int:
        """The batch bucket (`buckets`) a compiled step over n running rows runs at."""
        return min(1 << (n - 1).bit_length(), self.pool.max_batch)

    def buckets(self) -> list[int]:
        """The batch sizes a compiled engine's steps run at: 1, 2, 4, ... and max_batch."""
        sizes, b = [], 1
        while b < self.pool.max_batch:
            sizes.append(b)
            b *= 2
        return [*sizes, self.pool.max_batch]

    @torch.no_grad()
    def warm_up(self) -> float:
        """Compile the decode step for every batch bucket now (at the engine's depth, every row
        recurring; with `speculate` also the draft depth and the verify chunk) and the prefill for
        every prompt bucket (at the engine's depth), so no request at the engine's defaults waits for
        it; returns the seconds it took (0 when not compiled). The steps write into free slots,
        which a prefill overwrites."""
        if not self.config.compile:
            return 0.0
        if self._rows:
            raise RuntimeError("warm up the engine before it takes requests")
        t0, k = time.perf_counter(), self.config.speculate
        # with key_range any length will do: the graphs' key length is dynamic
        keys = self._step.key_range(k + 1) if self.config.key_range else None
        for B in self.buckets():

            def rows(n: int = 0) -> StepRows:
                # four distinct tensors, as a real step passes: one tensor in two places is a different
                # graph to Dynamo (its guards check aliasing), which the first real step would compile
                tokens = torch.zeros((B, n) if n else B, dtype=torch.long, device=self.device)
                return StepRows(tokens, *(torch.zeros(B, dtype=torch.long, device=self.device) for _ in range(3)))

            self._step(rows(), self.config.depth, keys=keys)
            if k and self.config.draft_depth < self.config.depth:
                self._step(rows(), self.config.draft_depth, fill=False, keys=keys)
                self._step(rows(k + 1), self.config.depth, keys=keys)
        if self._prefill_step is not None:  # every prompt bucket at the engine's prefill depth, in slot 0
            view = self.pool.cache.view(slice(0, 1))
            ids = torch.zeros(1, dtype=torch.long, device=self.device)
            depth = self.prefill.teacher_depth(self.config.depth)
            for n in self.prefill_buckets():
                self._compiled_prefill(view, [0] * n, ids, depth)
        return time.perf_counter() - t0

    def prefill_buckets(self) -> list[int]:
        """The prompt lengths a compiled engine's prefill chunks run at: 32, 64, 128, ... and max_len."""
        sizes, n = [], 32
        while n < self.max_len:
            sizes.append(n)
            n *= 2
        return [*sizes, self.max_len]

    def _compiled_prefill(self, view, prompt_ids: list[int], example_ids: torch.Tensor, depth: int) -> torch.Tensor:
        """The prompt's fp32 logits [n, V] from one compiled chunk on the claimed slot's row `view`: the
        prompt padded on the right to its bucket (`prefill_buckets`), the padding written after the
        prompt's positions, where the row's next tokens overwrite it before any token reads it (a
        token writes its own position's K/V before it attends; the causal mask keeps the prompt from
        the padding). The chunk attends over its bucket's positions only (a static graph per bucket)."""
        n = len(prompt_ids)
        size = next(b for b in self.prefill_buckets() if b >= n)
        tokens = torch.full((1, size), self.tokenizer.pad_id, dtype=torch.long, device=self.device)
        tokens[0, :n] = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        self._prefill_step.reset(view)
        # the chunk reads positions [0, size) only: a fresh slot holds nothing past them
        logits, _ = self._prefill_step(StepRows(tokens, zero, zero.clone(), example_ids), depth, keys=size)
        return logits[0, :n]

    def _compiled_step(
        self, tokens: list[int], depths: list[int], taus: list, example_ids: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One static decode step over the running rows padded to a bucket of 1, 2, 4, ... max_batch
        rows (a padding row sits in a free slot at position 0, which a later prefill overwrites, and
        runs the deepest row's depth, so a uniform batch needs no exit masks)."""
        n, dev, deepest = len(depths), self.device, max(depths)
        B = self._bucket(n)
        extra = B - n

        def padded(values: list, fill, dtype) -> torch.Tensor:
            return torch.tensor(values + [fill] * extra, dtype=dtype, device=dev)

        kw: dict = {}
        if any(t is not None for t in taus):  # adaptive exit: a row's tau 0 never exits
            floors = [r.rule.min_depth for r in self._rows]
            kw = {
                "exit_tau": padded([t or 0.0 for t in taus], 0.0, torch.float32),
                "min_depth": padded(floors, 1, torch.long),
                "lowest": min(f if t is not None else d for f, t, d in zip(floors, taus, depths)),
            }
        elif len(set(depths)) > 1:
            kw = {"lowest": min(depths)}
        rows = StepRows(
            padded(tokens, 0, torch.long),
            padded(self.pool.lengths, 0, torch.long),
            torch.zeros(B, dtype=torch.long, device=dev),
            padded(example_ids, 0, torch.long),
            depth=padded(depths, deepest, torch.long) if kw else None,
            **kw,
        )
        logits, used = self._step(rows, deepest, keys=self._keys(1))
        return logits[:n], used[:n]

    def _keys(self, n: int) -> int | None:
        """With `key_range`, the key range of a compiled step that writes n tokens per running row: the
        positions the longest row will have filled (rounded up, `DecodeStep.key_range`); else None
        (the whole slot)."""
        if not self.config.key_range:
            return None
        return self._step.key_range(max(self.pool.lengths) + n)

    def _accept(self, slot: int, logits: torch.Tensor, depth: int, token: int | None = None) -> bool:
        """Choose slot's next token from its last logits [V] (or take the greedy `token`); emit it;
        finish the row if it is done. Returns whether a token was emitted (an EOS ends the row
        unemitted, and counts as no decoded token)."""
        row = self._rows[slot]
        req = row.handle.request
        tok = token if token is not None else int(choose(logits[None], req.sampling, row.generator)[0])
        if tok == self.tokenizer.eos_id:
            self._finish(slot, "stop")
            return False
        piece, stopped = row.stream.push(tok)
        self.generated_tokens += 1
        event = Token(tok, piece, depth)
        if req.logprobs is not None:
            lp = logits.float().log_softmax(-1)
            event.logprob = float(lp[tok])
            if req.logprobs:
                top = lp.topk(min(req.logprobs, lp.numel()))
                event.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist()))
        row.handle.emit(event)
        if stopped:
            self._finish(slot, "stop")
        elif len(row.stream.ids) >= req.sampling.max_new_tokens:
            self._finish(slot, "length")
        else:
            row.next_token = tok
        return True

    def _finish(self, slot: int, reason: str, error: str | None = None) -> None:
        row = self._rows[slot]
        req = row.handle.request
        moved = self.pool.release(slot)
        last = self._rows.pop()
        if moved is not None:
            self._rows[slot] = last
        self.finished[reason] = self.finished.get(reason, 0) + 1
        depth = sum(row.depths) / len(row.depths) if row.depths else float(row.rule.depth)
        tail = row.stream.finish()
        row.handle.emit(Finish(reason, row.stream.text, tail, len(req.prompt_ids), len(row.stream.ids), depth, error))

    # -- observability ----------------------------------------------------------------------------
    def stats(self, window_s: float = 10.0) -> dict:
        """Numbers for /metrics: queue, running rows, throughput over the last `window_s`, the mean
        recurrences per decoded token since the start (0 before the first decode step), and the
        seconds spent prefilling prompts (with their first token) and in decode steps."""
        now = time.monotonic()
        with self._stats_lock:
            recent = [r for r in self._recent if now - r[0] <= window_s]
            decoded, depth_sum = self.decoded_tokens, self.decode_depth_sum
            drafted, accepted = self.drafted_tokens, self.accepted_tokens
            prefill_s, decode_s = self.prefill_seconds, self.decode_seconds
        tokens = sum(n for _, n in recent)
        span = max(now - recent[0][0], 1e-9) if len(recent) > 1 else window_s
        return {
            "queue_length": self.waiting,
            "running_sequences": self.running,
            "max_batch": self.pool.max_batch,
            "generated_tokens_total": self.generated_tokens,
            "prompt_tokens_total": self.prompt_tokens,
            "tokens_per_second": tokens / span if tokens else 0.0,
            "mean_decode_depth": depth_sum / decoded if decoded else 0.0,
            "speculative_drafted_total": drafted,
            "speculative_accepted_total": accepted,
            "speculative_acceptance_rate": accepted / drafted if drafted else 0.0,
            "prefill_seconds_total": prefill_s,
            "decode_seconds_total": decode_s,
            "cache_bytes_in_use": self.pool.bytes_in_use,
            "cache_bytes_capacity": self.pool.nbytes,
            "finished_total": dict(self.finished),
        }

    def describe(self) -> str:
        c = self.config
        return (
            f"{c.cache} cache, {c.max_batch} slots x {self.max_len} positions "
            f"({self.pool.nbytes / 2**20:.1f} MiB), depth {c.depth} (requests up to {self.max_depth}), "
            f"queue {c.max_queue}"
            + (f", speculating {c.speculate} drafts at depth {c.draft_depth}" if c.speculate else "")
        )


def _score_prompt(logits: torch.Tensor, next_ids: torch.Tensor, k: int) -> PromptLogprobs:
    """The scores of `next_ids` [n] under the logits [n, V] of the positions before them."""
    lp = logits.float().log_softmax(-1)
    scores = PromptLogprobs(lp.gather(-1, next_ids[:, None])[:, 0].tolist())
    if k:
        top = lp.topk(min(k, lp.shape[-1]), dim=-1)
        scores.top_logprobs = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    return scores
