"""The one-token decode step with static shapes: no host sync inside it, compilable (design §16).

`DecodeStep` runs one new token per row over a preallocated cache (terminal or full) whose rows
sit at their own positions. Its only inputs are tensors: the tokens [B] (or a chunk [B, n] per row:
self-speculation's verify chunk), where each row writes
(`write_at` [B]) and its first real position (`first` [B], left padding), per-row depths and
exit settings. Attention always reads the whole bank [0, max_len) under a mask built from those
tensors, so every step has the same shapes and `torch.compile` traces it once per batch size.

The step is compiled in pieces: the prelude (and the initial state), one recurrence, `unroll`
recurrences in one graph (rows at one fixed depth: R = q * unroll + rest runs q calls of it and
one of a graph of `rest` recurrences; fewer calls, each with its per-call wrapper and guards), and
the coda with the head. A step at a fixed depth of at most `whole` recurrences (a draft, a shallow
server's step or prefill) is one graph of all of it. A chunk may resume from its drafts' states
(`resume`, self-speculation on the full cache, design §16). Per-row depth and adaptive exit are
masks: a stopped row keeps its frozen state, its core writes are masked (the cache keeps its exit
recurrence's K/V as terminal K/V, exactly as `LoopedLM.with_exits` does) and it costs what its
deepest sibling costs. With `stop_early` (default on a CPU, where a host sync costs nothing) the
loop ends once every row has stopped. Results equal the model's cached forward (`extend`) to
float rounding (tested).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from looplm.infer.cache import KVCache
from looplm.infer.depth_rule import DepthRule
from looplm.infer.row_kernels import row_kernels_backend
from looplm.model.blocks import rope_tables
from looplm.model.exits import relative_change
from looplm.model.kv import KVBank
from looplm.model.looped import Context
from looplm.model.state import StateStart

__all__ = ["DecodeStep", "StepRows"]


@dataclass
class StepRows:
    """The per-row inputs of one decode step (tensors [B] on the model's device)."""

    tokens: torch.Tensor
    """The token each row feeds."""
    write_at: torch.Tensor
    """Where each row's token goes in the cache (its number of cached positions, padding included)."""
    first: torch.Tensor
    """Each row's first real position (left padding before it is never read); its RoPE position is
    write_at - first."""
    example_ids: torch.Tensor
    """Seeds each row's initial state (with the position)."""
    depth: torch.Tensor | None = None
    """Recurrences per row (at most the step's `loop_depth`); None: every row runs `loop_depth`."""
    exit_tau: torch.Tensor | None = None
    """Adaptive exit per row (0 = never), or None for no adaptive exit."""
    min_depth: torch.Tensor | None = None
    """Fewest recurrences per row under adaptive exit."""
    lowest: int = 1
    """A lower bound of the recurrences any row uses, known to the caller (spares the full cache
    filling visits no row can leave unreached)."""

    @classmethod
    def under(cls, rule: DepthRule, tokens, write_at, first, example_ids) -> StepRows:
        """A decode step's rows under `rule`: every row at its decode depth, with its adaptive exit
        (`exit_tau`, `min_depth`) when it has one (an exit gate is not a step's: the model's forward runs it)."""
        if rule.exit_tau is None:
            return cls(tokens, write_at, first, example_ids)
        B, device = tokens.shape[0], tokens.device
        return cls(
            tokens,
            write_at,
            first,
            example_ids,
            depth=torch.full((B,), rule.depth, dtype=torch.long, device=device),
            exit_tau=torch.full((B,), rule.exit_tau, dtype=torch.float32, device=device),
            min_depth=torch.full((B,), rule.min_depth, dtype=torch.long, device=device),
            lowest=rule.min_depth,
        )

    @property
    def exits(self) -> bool:
        """Rows may stop before the loop's last recurrence."""
        return self.depth is not None or self.exit_tau is not None


class _Slots:
    """The cache slots of the prelude and coda layers inside a traced step."""

    def __init__(self, banks: dict, write_at: torch.Tensor):
        self.banks, self.write_at = banks, write_at

    def slot(self, stack: str, layer: int, recurrence: int = 0, keep=None):
        k, v = self.banks[stack][layer]
        return KVBank.of(k, v).slot(self.write_at)


def _cut(t, m: int):
    """The part of a step's shared tensor (or list of them) for the chunk's tokens from m on: the
    token axis is the second to last of the mask and RoPE tables [B, 1, n, .], the second of the
    rest [B, n, .]; a fresh contiguous copy (a compiled piece sees the strides a one-token step has)."""
    if t is None:
        return None
    if isinstance(t, (list, tuple)):
        return type(t)(_cut(x, m) for x in t)
    return (t[:, :, m:] if t.ndim == 4 else t[:, m:]).clone(memory_format=torch.contiguous_format)


def _tensors(tree):
    """Every tensor in nested lists, tuples and dicts."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def step_compile_options(device: torch.device, given: dict | None = None) -> dict:
    """`torch.compile`'s keyword arguments for a compiled step on `device`, with `given` merged in.
    Defaults: on CUDA, CUDA graphs (`mode="reduce-overhead"`); on a CPU, inductor's C++ wrapper (the
    options `cpp_wrapper`, `size_asserts`). torch.compile takes a mode or inductor options, not both, so:
    a given mode replaces the defaults; given inductor options are merged key by key into the
    default's, and on CUDA carry the default mode as its option (`triton.cudagraphs`, what
    `reduce-overhead` sets)."""
    given = dict(given or {})
    cuda = device.type == "cuda"
    if given.get("mode") is not None:
        return given
    given.pop("mode", None)
    inductor = {"triton.cudagraphs": True} if cuda else {"cpp_wrapper": True, "size_asserts": False}
    if "options" in given:
        return {**given, "options": {**inductor, **(given["options"] or {})}}
    return {**({"mode": "reduce-overhead"} if cuda else {"options": inductor}), **given}


class DecodeStep:
    """One-token decode steps on the first rows of `cache` (see the module docstring).

    `compile=True` compiles the pieces with `torch.compile` (inductor; on CUDA with
    `mode="reduce-overhead"`, i.e. CUDA graphs: design §16; measured on an H200); the first step of each
    batch size pays the compilation. `stop_early` (default: on a CPU) ends the recurrence loop when every row stopped.
    `compile_options` go to `torch.compile` (e.g. another backend), merged with the defaults as
    `step_compile_options` says. `unroll` U: a fixed-depth loop
    runs U recurrences per call of one graph, and its R mod U last ones in one call of a shorter
    graph (compiled when first needed; per-row depth and exit run one recurrence per call). 4 by
    default: at batch 1 and R = 32 on a CPU a step took 1.2-1.4x less time than with one recurrence
    per call, a draft step at depth 3 1.25x less, for a cold compile 10-30 s longer (8: a little
    faster again, about twice the compile). `whole` W: a step at a fixed depth of at most W
    recurrences (a draft; a server at depth 5, its steps and prefill chunks; not a resumed chunk)
    runs prelude, recurrences and coda as one graph (one per such depth): at depth 5 on a CPU a
    one-token step took 1.2-1.4x less time than in windows (batch 1-12), the cold compile about the
    same; 0 turns it off. `row_kernels` (default: compiled on a CPU) compiles the pieces
    through `looplm.infer.row_kernels.row_kernels_backend`: one-row linears and few-query attention
    written out as loops inductor generates, instead of calls to the BLAS and the SDPA kernel.
    `static_keys`: compiled, each `keys` is a static graph of its own instead of one graph with a
    dynamic key length, for callers whose key length is a static shape already (a prefill chunk of
    a bucketed length that reads exactly its bucket). `vocab`: the logits cover token ids [0, vocab)
    only (a tokenizer smaller than the model's padded embedding, whose other rows no token reaches);
    None: every row."""

    PIECES = ("begin", "recur", "recur_many", "recur_exits", "end", "shallow", "greedy_drafts")
    """The parts a step calls, each `_<name>` run as written or compiled as `<name>`."""

    def __init__(
        self,
        model,
        cache: KVCache | None = None,
        *,
        compile: bool = False,
        stop_early: bool | None = None,
        seed: int = 0,
        compile_options: dict | None = None,
        unroll: int = 4,
        whole: int = 8,
        row_kernels: bool | None = None,
        static_keys: bool = False,
        vocab: int | None = None,
    ):
        self.model, self.seed, self.compiled, self.graphs = model, seed, compile, False
        self.static_keys, self.vocab = static_keys, vocab
        self.device = device = next(model.parameters()).device
        if row_kernels and not compile:
            raise ValueError("row_kernels are for compiled steps (eagerly the written-out products are slower)")
        self.row_kernels = compile and (device.type == "cpu" if row_kernels is None else row_kernels)
        self.stop_early = device.type == "cpu" if stop_early is None else stop_early
        self._steps = [torch.tensor(r + 1, device=device) for r in range(model.cfg.max_depth)]
        if cache is not None:
            self.reset(cache)
        if unroll < 1 or whole < 0:
            raise ValueError(f"unroll must be >= 1 and whole >= 0, got {unroll} and {whole}")
        self.unroll, self.whole = unroll, whole
        for piece in self.PIECES:  # each piece runs as written, or compiled (below)
            setattr(self, piece, getattr(self, f"_{piece}"))
        if compile:
            # CUDA: CUDA graphs; a CPU: inductor's C++ wrapper, which calls the kernels without Python per
            # op (a layer visit at batch 1 is tens of small ops: the Python wrapper was a third of a step)
            options = step_compile_options(device, compile_options)
            # CUDA graphs (design §16): the cache banks are static inputs (written in place: cudagraph
            # trees replay a graph that mutates an input only when its address is fixed), a step is one
            # generation of the graph tree, and what a step returns is copied out of the graphs' pool
            self.graphs = options.get("mode") in ("reduce-overhead", "max-autotune") or bool(
                (options.get("options") or {}).get("triton.cudagraphs")  # the same, spelled as inductor options
            )
            if self.row_kernels:  # the captured graphs are rewritten, then go to the backend asked for
                if "mode" in options:
                    raise ValueError("row_kernels rewrite graphs for a backend: give compile options, not a mode")
                options["backend"] = row_kernels_backend(
                    options.pop("backend", "inductor"), options.pop("options", None)
                )
            # one graph per batch size and piece; the engine buckets its batch sizes
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            for piece in self.PIECES:
                setattr(self, piece, torch.compile(getattr(self, f"_{piece}"), dynamic=False, **options))

    def reset(self, cache: KVCache) -> None:
        """Step on `cache` from now on (compiled graphs are kept: they depend on shapes only)."""
        self.cache, self._banks = cache, {}
        self.keys = torch.arange(cache.max_len, device=self.device)

    def banks(self, B: int, keys: int | None = None) -> dict:
        """The bank tensors of rows [0, B) and positions [0, keys) (default: the whole cache): prelude,
        coda, and per recurrence each core layer's (K, V, fallback K, fallback V), and the key
        positions; views, so the step writes into the cache. A compiled step (without CUDA graphs) marks
        the key length of these views dynamic: one graph per batch size serves every `keys`, and
        `keys=None` (the whole cache, no views) a static graph of its own."""
        S = self.cache.max_len
        K = S if keys is None else keys
        if not 0 < K <= S:
            raise ValueError(f"keys must be in [1, {S}] (the cache's length), got {K}")
        if (B, keys) not in self._banks:
            cache, views = self.cache, {}

            def cut(bank: KVBank) -> tuple[torch.Tensor, torch.Tensor]:
                if B == bank.k.shape[0] and keys is None:
                    return bank.k, bank.v
                # one view per bank (the terminal cache's every recurrence reads the same banks; the
                # cache holds bank.k, so its id is not reused while these views live)
                if id(bank.k) not in views:
                    views[id(bank.k)] = (bank.k[:B, :, :K], bank.v[:B, :, :K])
                return views[id(bank.k)]

            core = []
            # the recurrences that read banks of their own: the terminal cache's first (all read it), a
            # full cache's visits and the first past them (the rest read as it does)
            distinct = min(cache.depth + 1 if cache.mode == "full" else 1, self.model.cfg.max_depth)
            for r in range(distinct):
                layers = []
                for j in range(cache.cfg.n_core):
                    bank = cache.core_read(r, j)
                    # full cache: a stopped row's visit-r entry is its visit r - 1 entry (design §7, §16)
                    back = cache.core[r - 1][j] if cache.mode == "full" and 0 < r < cache.depth else bank
                    layers.append((*cut(bank), *cut(back)))
                core.append(layers)
            core_kv = [[layer[:2] for layer in visit] for visit in core]
            rest = self.model.cfg.max_depth - distinct
            banks = {
                "prelude": [cut(b) for b in cache.prelude],
                "coda": [cut(b) for b in cache.coda],
                "core": core + core[-1:] * rest,
                "core_kv": core_kv + core_kv[-1:] * rest,
                "keys": self.keys[:K],
            }
            if self.graphs:
                for t in _tensors(banks):
                    torch._dynamo.mark_static_address(t)
            elif self.compiled and keys is not None and not self.static_keys:
                for t in _tensors(banks):
                    torch._dynamo.maybe_mark_dynamic(t, t.ndim - 2 if t.ndim == 4 else 0)
            self._banks[(B, keys)] = banks
        return self._banks[(B, keys)]

    def key_range(self, needed: int) -> int | None:
        """The `keys` of a step whose rows all end at or before position `needed`: `needed` rounded up
        to 16 and capped at the cache; None (the whole cache) under CUDA graphs, which would record a
        graph per length."""
        if self.graphs:
            return None
        return min(self.cache.max_len, -(-needed // 16) * 16)

    @torch.no_grad()
    def __call__(
        self,
        rows: StepRows,
        loop_depth: int,
        *,
        fill: bool = True,
        endpoint: bool = False,
        resume: tuple[torch.Tensor, int] | None = None,
        keys: int | None = None,
    ):
        """Feed `rows.tokens` [B] (or a chunk [B, n] per row, at one depth); returns (fp32 logits
        [B, V] (or [B, n, V]), recurrences used [B]). The cache's entries from `write_at` on are
        written; the caller moves its lengths on. `fill=False` leaves a
        full cache's visits past a row's depth unwritten (a draft that the verifier rewrites).
        `endpoint=True` also returns the state that entered the coda, [B, d] (or [B, n, d]): RL's
        rollout-state reuse saves it (design §10).

        `resume=(states, r0)` (a chunk on the full cache): the chunk's first m tokens already ran
        recurrences 1..r0 as one-token steps at these positions (self-speculation's drafts), so
        `states` [B, m, d] are their states after recurrence r0 and their visits 0..r0-1 are in the
        cache; the chunk's other tokens first run recurrences 1..r0 on their own (reading those
        visits), then the whole chunk recurs from r0 + 1 to `loop_depth` (design §16).

        `keys=K` attends over cache positions [0, K) only, which costs less than the whole cache; every
        row must end inside it (write_at + n <= K: the caller knows its rows' lengths, the step does
        not check them, which would sync). Compiled, every K runs one graph per batch size (its key
        length is dynamic); with CUDA graphs each K would be a graph (`key_range` gives None there)."""
        B = rows.tokens.shape[0]
        banks = self.banks(B, keys)
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        exits = rows.exits
        chunk = rows.tokens.ndim == 2  # [B, n]: n tokens per row (a verify chunk), no exits
        if chunk and exits:
            raise ValueError("a chunk of several tokens per row runs one fixed depth (no per-row depth or exit)")
        tokens = rows.tokens if chunk else rows.tokens[:, None]
        depth = rows.depth if rows.depth is not None else self._steps[loop_depth - 1].expand(B)
        used = depth.clone()
        terminal = self.cache.mode == "terminal"
        if not exits and resume is None and loop_depth <= self.whole and (terminal or loop_depth <= self.cache.depth):
            cores, repeat = self._visits(banks, 0, loop_depth)  # a shallow step (a draft, a prefill): one graph
            logits, s = self.shallow(tokens, rows.write_at, rows.first, rows.example_ids, banks, cores, repeat)
            return self._finish(rows, logits, used, s, loop_depth, fill=fill, endpoint=endpoint)
        s, *shared = self.begin(tokens, rows.write_at, rows.first, rows.example_ids, banks)
        start = 0
        if resume is not None:
            s, start = self._resume(s, shared, rows, banks, *resume, loop_depth)
        active = torch.ones(B, dtype=torch.bool, device=s.device)
        if exits:
            for r in range(start, loop_depth):
                s, active, used = self.recur_exits(
                    self._steps[r],
                    s,
                    active,
                    used,
                    depth,
                    rows.exit_tau,
                    rows.min_depth,
                    rows.write_at,
                    shared,
                    banks["core"][r],
                )
                if self.stop_early and not bool(active.any()):
                    break
        else:  # every row recurs: no masks, the fewest inputs (each is a guard to check per call)
            s = self._fixed(s, rows.write_at, shared, banks, start, loop_depth)
        logits = self.end(s, rows.write_at, shared, banks)
        return self._finish(rows, logits, used, s, loop_depth, fill=fill, endpoint=endpoint)

    @torch.no_grad()
    def drafts(self, rows: StepRows, loop_depth: int, k: int, *, endpoint: bool = False, keys: int | None = None):
        """k greedy tokens after `rows.tokens` [B] (self-speculation's drafts, design §16): one-token
        steps at `loop_depth` from `write_at`, each feeding the argmax of the last, as k calls of the
        step with `fill=False` (a full cache's visits past `loop_depth` are left for the verifier to
        write). Returns the drafted tokens [B, k] and, with `endpoint`, the states that entered the coda
        [B, k, d] (of the tokens fed: rows.tokens, then the first k - 1 drafts). A shallow depth (at
        most `whole`, inside a full cache's visits) runs the k steps as one graph; any other runs them
        one call at a time. No host sync in either."""
        B, fixed = rows.tokens.shape[0], not rows.exits
        terminal = self.cache.mode == "terminal"
        if fixed and loop_depth <= self.whole and (terminal or loop_depth <= self.cache.depth):
            banks = self.banks(B, keys)
            if self.graphs:
                torch.compiler.cudagraph_mark_step_begin()
            cores, repeat = self._visits(banks, 0, loop_depth)
            tokens, states = self.greedy_drafts(
                rows.tokens[:, None], rows.write_at, rows.first, rows.example_ids, banks, cores, repeat, k
            )
            out = (tokens, states) if endpoint else (tokens,)
            return tuple(t.clone() for t in out) if self.graphs else out
        tok, tokens, states = rows.tokens, [], []
        for i in range(k):
            at = replace(rows, tokens=tok, write_at=rows.write_at + i)
            logits, _, *z = self(at, loop_depth, fill=False, endpoint=endpoint, keys=keys)
            tok = logits.argmax(-1)
            tokens.append(tok)
            states += z
        return (torch.stack(tokens, 1), torch.stack(states, 1)) if endpoint else (torch.stack(tokens, 1),)

    def _finish(self, rows: StepRows, logits, used, s, loop_depth: int, *, fill: bool, endpoint: bool):
        """What a step returns, from its coda's logits and final state; a full cache's visits past a
        row's depth take its terminal K/V (with `fill`)."""
        B, chunk, exits = rows.tokens.shape[0], rows.tokens.ndim == 2, rows.exits
        logits = (logits if chunk else logits[:, -1])[..., : self.vocab]
        z = s if chunk else s[:, -1]
        if fill and self.cache.mode == "full" and (exits or loop_depth < self.cache.depth):
            # visits a row did not reach take its terminal K/V (`FullCache.keep_terminal`)
            view = self.cache.view(slice(0, B), length=rows.write_at)
            if chunk:
                view.keep_terminal(rows.tokens.shape[1], loop_depth)
            else:
                view.keep_terminal(1, loop_depth, used[:, None], lowest=max(rows.lowest, 1) if exits else loop_depth)
        out = (logits, used, z) if endpoint else (logits, used)
        return tuple(t.clone() for t in out) if self.graphs else out

    def _resume(self, s, shared, rows: StepRows, banks: dict, states: torch.Tensor, r0: int, loop_depth: int):
        """(the chunk's states after recurrence r0, r0): `states` for its first m tokens; the others
        (usually one: the last draft, never fed) run recurrences 1..r0 now, through the same pieces
        as a one-token step (their context is the chunk's, cut to their positions)."""
        if rows.tokens.ndim != 2 or self.cache.mode != "full":
            raise ValueError("resume continues a chunk on the full cache (whose visits 1..r0 the drafts wrote)")
        m, n = states.shape[1], rows.tokens.shape[1]
        if not (1 <= r0 < loop_depth and r0 <= self.cache.depth and m <= n):
            raise ValueError(
                f"resume from recurrence {r0} with {m} states: needs 1 <= r0 < {loop_depth}, "
                f"r0 <= the cache depth {self.cache.depth} and at most {n} states"
            )
        if m < n:
            tail = [_cut(t, m) for t in shared]
            at = rows.write_at + m
            rest = _cut(s, m)
            rest = self._fixed(rest, at, tail, banks, 0, r0)
            states = torch.cat([states, rest], 1)
        return states.to(s.dtype), r0

    def _fixed(self, s, write_at, shared, banks: dict, start: int, stop: int):
        """Recurrences start..stop-1 (0-based) of every row in windows of `unroll` (one call of the
        unrolled piece each) and one shorter window for the rest (a graph of its own length; a window
        of one is the single recurrence). A full cache's windows stay inside its visits (past them
        every recurrence shares the last bank, and runs alone)."""
        r = start
        while r < stop:
            w = self._window(r, stop)
            if w > 1:
                s = self.recur_many(s, write_at, shared, *self._visits(banks, r, w))
            else:
                s = self.recur(s, write_at, shared, banks["core_kv"][r])
            r += w
        return s

    def _window(self, r: int, stop: int) -> int:
        """How many recurrences from r (0-based, before `stop`) one call runs: at most `unroll`, and
        on a full cache none past its visits (there every recurrence shares the last bank, alone)."""
        w = min(self.unroll, stop - r)
        return w if self.cache.mode == "terminal" else max(1, min(w, self.cache.depth - r))

    def _visits(self, banks: dict, r: int, w: int) -> tuple[list, int]:
        """(banks of each visit, repeats per visit) for recurrences r..r+w-1: the terminal cache's one
        bank, passed once and run w times; a full cache's w visits, once each."""
        visits = banks["core_kv"]
        return (visits[r : r + 1], w) if self.cache.mode == "terminal" else (visits[r : r + w], 1)

    # -- the pieces (traced by torch.compile; tensors in, tensors out) -------------------------
    def _mask_and_rope(self, write_at, first, n: int, keys: torch.Tensor):
        at = write_at[:, None] + torch.arange(n, device=write_at.device)  # [B, n] where each token goes
        positions = at - first[:, None]
        keys = keys[None, None, :]
        mask = ((keys >= first[:, None, None]) & (keys <= at[:, :, None]))[:, None]  # [B, 1, n, S], causal
        cos, sin = rope_tables(positions, self.model.cfg.head_dim, self.model.cfg.rope_base)
        return positions, mask, cos, sin

    def _begin(self, tokens, write_at, first, example_ids, banks):
        m = self.model
        positions, mask, cos, sin = self._mask_and_rope(write_at, first, tokens.shape[1], banks["keys"])
        e = m.run_prelude(tokens, (cos, sin), mask, _Slots(banks, write_at))
        ctx = m.context(e, (cos, sin), mask, tokens)
        s = m.start_state(e, ctx, StateStart("seeded", example_ids=example_ids, seed=self.seed), positions)
        return s, mask, cos, sin, ctx.injected, ctx.qkv_offsets, ctx.core_values, ctx.coda_values

    def _recur(self, s, write_at, shared, core):
        mask, cos, sin, injected, offsets, core_values, _ = shared
        ctx = Context((cos, sin), mask, injected, offsets, core_values)
        return self.model.recurrence(s, ctx, slots=[KVBank.of(k, v).slot(write_at) for k, v in core])

    def _recur_many(self, s, write_at, shared, cores, repeat: int):
        """`repeat` recurrences on each visit's banks of `cores` in turn (len(cores) * repeat in all)."""
        for core in cores:
            for _ in range(repeat):
                s = self._recur(s, write_at, shared, core)
        return s

    def _shallow(self, tokens, write_at, first, example_ids, banks, cores, repeat: int):
        """A whole step at a fixed depth of at most `whole` recurrences, in one graph: (coda logits,
        the state entering the coda)."""
        s, *shared = self._begin(tokens, write_at, first, example_ids, banks)
        s = self._recur_many(s, write_at, shared, cores, repeat)
        return self._end(s, write_at, shared, banks), s

    def _greedy_drafts(self, tokens, write_at, first, example_ids, banks, cores, repeat: int, k: int):
        """k shallow steps in one graph, each fed the argmax of the last one's logits (over `vocab`):
        (the tokens [B, k], the states entering the coda [B, k, d])."""
        drafted, states = [], []
        for i in range(k):
            logits, s = self._shallow(tokens, write_at + i, first, example_ids, banks, cores, repeat)
            tokens = logits[:, -1, : self.vocab].argmax(-1, keepdim=True)
            drafted.append(tokens)
            states.append(s[:, -1])
        return torch.cat(drafted, 1), torch.stack(states, 1)

    def _recur_exits(self, step, s, active, used, depth, tau, floor, write_at, shared, core):
        mask, cos, sin, injected, offsets, core_values, _ = shared
        ctx = Context((cos, sin), mask, injected, offsets, core_values)
        keep = active[:, None]  # a stopped row's writes are masked: its entry keeps its terminal K/V
        slots = [KVBank.of(k, v).slot(write_at, keep, KVBank.of(fk, fv)) for k, v, fk, fv in core]
        new = self.model.recurrence(s, ctx, slots=slots)
        new = torch.where(active[:, None, None], new, s)  # a stopped row's state stays frozen
        stop = active & (step >= depth)
        if tau is not None:  # design §13: relative state change below exit_tau, after min_depth
            change = relative_change(new, s)[:, 0]
            stop = stop | (active & (change < tau) & (step >= floor))
        used = torch.where(stop, step, used)
        return new, active & ~stop, used

    def _end(self, s, write_at, shared, banks):
        mask, cos, sin, injected, offsets, core_values, coda_values = shared
        ctx = Context((cos, sin), mask, injected, offsets, core_values, coda_values)
        return self.model.run_coda(s, (cos, sin), mask, ctx, _Slots(banks, write_at))
