"""The looped language model: prelude -> (injection -> core) x R -> coda -> logits (design §1-3).

Single-device and training-free: the depth, the backprop window and the initial state are
arguments of `forward`; parallelism and mixed precision wrap the model from outside.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from looplm.config import ModelConfig, check_depth
from looplm.model.blocks import AttentionKernel, Block, RMSNorm, document_mask, init_embedding_, rope_tables
from looplm.model.cross_entropy import linear_cross_entropy
from looplm.model.exit_gate import ExitGate, exit_distribution, select_depth, threshold_exit
from looplm.model.exits import DepthPlan, Exits
from looplm.model.injection import build_injection
from looplm.model.kv import KVRecord, LayerCache, RowsView
from looplm.model.state import StateInit, StateStart, initial_state


@dataclass
class LoopOutput:
    logits: torch.Tensor | None
    """[B, L, V] fp32 next-token logits (None when `compute_logits=False`)."""
    endpoint: torch.Tensor
    """z^R: the state that entered the coda, [B, L, d]."""
    states: list[torch.Tensor] | None = None
    """Per-recurrence states s^1..s^R (after the exit norm), when `return_states=True`."""
    depths: torch.Tensor | None = None
    """Recurrences each token used, [B, L] (per-row depths, adaptive exit or the exit gate's choice);
    None for the parallel forward at a plain integer depth, where every token used all of them."""
    ce_sum: torch.Tensor | None = None
    """fp32 sum of next-token cross-entropy over the supervised `targets` (when given; then no logits)."""


def value_kw(rows: list | None, i: int) -> dict:
    """`value_embed=rows[i]` for block i when it has value-embedding rows, else no keyword (so blocks
    and stand-ins without value embeddings are called exactly as before)."""
    return {} if rows is None or rows[i] is None else {"value_embed": rows[i]}


@dataclass
class Context:
    """Per-forward quantities every recurrence shares (computed once)."""

    rope: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor | None
    injected: torch.Tensor  # q: the injection's prepared input
    qkv_offsets: list | None  # DEQ-QKV per-core-layer offsets
    core_values: list | None = None  # value embeddings E_v[tokens] per core layer (None: the layer has none)
    coda_values: list | None = None  # the same per coda block

    def select(self, rows: torch.Tensor) -> Context:
        """The context of batch rows `rows` [b] (a boolean mask shared by every row stays shared)."""
        B = self.injected.shape[0]

        def pick(t):
            return t[rows] if t is not None and t.shape[0] == B else t

        def each(layers):
            return None if layers is None else [None if v is None else pick(v) for v in layers]

        offsets = None if self.qkv_offsets is None else [tuple(pick(o) for o in layer) for layer in self.qkv_offsets]
        return Context(
            (pick(self.rope[0]), pick(self.rope[1])),
            pick(self.mask),
            pick(self.injected),
            offsets,
            each(self.core_values),
            each(self.coda_values),
        )


class ScaledEmbedding(nn.Embedding):
    """Token embedding times `scale` (design §14: Huginn multiplies by sqrt(d)); scale 1 is a plain lookup."""

    def __init__(self, vocab_size: int, d_model: int, scale: float = 1.0):
        super().__init__(vocab_size, d_model)
        self.scale = scale

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = super().forward(tokens)
        return x if self.scale == 1.0 else x * self.scale


class TiedHead(nn.Module):
    """The output map of tied embeddings: logits = x E^T with the embedding matrix E. It holds no
    weight of its own (the state dict has only `embed.weight`, so a tied checkpoint stays tied)."""

    def __init__(self, embed: nn.Embedding):
        super().__init__()
        object.__setattr__(self, "_embed", embed)  # a reference, not a submodule

    @property
    def weight(self) -> torch.Tensor:
        return self._embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._embed.weight)


class LoopedLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = ScaledEmbedding(cfg.vocab_size, cfg.d_model, cfg.embed_scale)
        self.prelude = nn.ModuleList(Block(cfg, cfg.has_value_embed(i)) for i in range(cfg.n_prelude))
        self.injection = build_injection(cfg)
        self.core = nn.ModuleList(Block(cfg, cfg.has_value_embed(i)) for i in range(cfg.n_core))
        self.coda = nn.ModuleList(Block(cfg, cfg.has_value_embed(i)) for i in range(cfg.n_coda))
        # design §14: value-embedding tables E_v [V, H_kv*hd] of the blocks that have a gate (Parcae)
        self.value_embeds = None
        if cfg.value_embeds != "none":
            kv_dim = cfg.n_kv_heads * cfg.head_dim
            self.value_embeds = nn.ModuleDict(
                {
                    stack: nn.ModuleDict(
                        {str(i): nn.Embedding(cfg.vocab_size, kv_dim) for i in range(n) if cfg.has_value_embed(i)}
                    )
                    for stack, n in (("prelude", cfg.n_prelude), ("core", cfg.n_core), ("coda", cfg.n_coda))
                }
            )
        self.coda_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False) if cfg.coda_proj else None
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.head_norm else nn.Identity()
        self.head = TiedHead(self.embed) if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.exit_gate = ExitGate(cfg.d_model) if cfg.exit_gate else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_embedding_(self.embed.weight)
        for block in (*self.prelude, *self.core, *self.coda):
            block.reset_parameters()
        if not self.cfg.tie_embeddings:
            nn.init.trunc_normal_(self.head.weight, std=0.02, a=-0.06, b=0.06)
        self.injection.reset_parameters()
        if self.value_embeds is not None:
            for tables in self.value_embeds.values():
                for table in tables.values():
                    init_embedding_(table.weight)
        if self.coda_proj is not None:
            with torch.no_grad():
                self.coda_proj.weight.copy_(torch.eye(self.cfg.d_model))
        if self.exit_gate is not None:
            self.exit_gate.reset_parameters()

    # -- pieces, public so that caches, students and diagnostics can reuse them -----------------
    def check_inputs(self, tokens: torch.Tensor, depth: int) -> None:
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tuple(tokens.shape)}")
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds the context max_seq_len={self.cfg.max_seq_len}"
            )
        check_depth("depth", depth, self.cfg.max_depth)

    def value_rows(self, stack: str, tokens: torch.Tensor | None) -> list | None:
        """Value embeddings of `stack` ("prelude", "core" or "coda") for `tokens` [B, L]: per block,
        E_v[tokens] [B, L, H_kv*hd] or None (no table); None for a model without value embeddings.
        Computed once per forward and handed to the blocks (`Context.core_values`/`coda_values`)."""
        if self.value_embeds is None:
            return None
        if tokens is None:
            raise ValueError("this model has value embeddings (cfg.value_embeds): its forward needs the token ids")
        tables = self.value_embeds[stack]
        return [tables[str(i)](tokens) if str(i) in tables else None for i in range(len(getattr(self, stack)))]

    def run_prelude(self, tokens, rope, mask, cache: LayerCache | None = None) -> torch.Tensor:
        x = self.embed(tokens)
        rows = self.value_rows("prelude", tokens)
        for i, block in enumerate(self.prelude):
            kw = value_kw(rows, i)
            if cache is not None:
                kw["kv"] = cache.slot("prelude", i)
            x = block(x, rope, mask, **kw)
        return x

    def recurrence(self, s: torch.Tensor, ctx: Context, *, slots: list | None = None, return_kv: bool = False):
        """One recurrence F: inject, the core blocks in turn, then the exit map (design §2).

        `slots` gives core layer j the K/V slot `slots[j]` of this visit (`looplm.model.kv`; a cache's
        bank, with `ctx.mask` covering its earlier tokens); `return_kv` also returns each core layer's
        (K, V) of this recurrence (diagnostics, design §11)."""
        if return_kv:
            slots = [KVRecord(slot) for slot in (slots or [None] * len(self.core))]
        s = self.injection(s, ctx.injected)
        for i, block in enumerate(self.core):
            # block(x, rope, mask, **keywords a feature needs): the prelude, every core visit and the coda
            # call a block with one signature, so a compiled block keeps one graph for all of them
            kw = value_kw(ctx.core_values, i)
            if ctx.qkv_offsets:
                kw["offsets"] = ctx.qkv_offsets[i]
            if slots:
                kw["kv"] = slots[i]
            s = block(s, ctx.rope, ctx.mask, **kw)
        s = self.injection.exit(s)
        return (s, [slot.kv for slot in slots]) if return_kv else s

    def coda_input(self, z: torch.Tensor) -> torch.Tensor:
        """What the coda reads from the endpoint z^R: z itself, or the head's final norm of it once
        (`cfg.post_loop_norm`, Huginn's ln_f, design §14), then the map C (`cfg.coda_proj`, Parcae)."""
        z = self.norm(z) if self.cfg.post_loop_norm else z
        return self.coda_proj(z) if self.coda_proj is not None else z

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the coda output h: the head after its final norm (if `cfg.head_norm`)."""
        return self.head(self.norm(h)).float()

    def run_coda(
        self,
        z: torch.Tensor,
        rope,
        mask,
        ctx: Context | None = None,
        cache: LayerCache | None = None,
        compute_logits: bool = True,
    ) -> torch.Tensor | None:
        """Logits of the endpoint z; `ctx` (the forward's Context) carries the coda's value embeddings
        and is required for a model that has them. With a `cache` the coda writes its K/V there (and
        `compute_logits=False` skips only the head)."""
        h = self.coda_output(z, rope, mask, ctx, cache)
        return self.logits(h) if compute_logits else None

    def coda_output(
        self, z: torch.Tensor, rope, mask, ctx: Context | None = None, cache: LayerCache | None = None
    ) -> torch.Tensor:
        """h: the coda's output for the endpoint z, what `logits` maps to the vocabulary."""
        values = self.coda_values(ctx)
        z = self.coda_input(z)
        for i, block in enumerate(self.coda):
            kw = value_kw(values, i)
            if cache is not None:
                kw["kv"] = cache.slot("coda", i)
            z = block(z, rope, mask, **kw)
        return z

    def cross_entropy_sum(self, h: torch.Tensor, targets: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
        """fp32 sum of CE(logits(h), targets) over targets != -100 (F.cross_entropy's ignore index),
        computed `chunk_rows` rows at a time: the [N, V] fp32 logits of `logits(h)` are never held."""
        return linear_cross_entropy(self.norm(h), self.head.weight, targets, chunk_rows=chunk_rows)

    def coda_values(self, ctx: Context | None) -> list | None:
        """The coda's value embeddings from `ctx`; ValueError when the model has them and ctx lacks them."""
        if self.value_embeds is None:
            return None
        if ctx is None or ctx.coda_values is None:
            raise ValueError(
                "this model has value embeddings: run_coda needs the forward's Context "
                "(ctx=..., built by LoopedLM.context with the tokens)"
            )
        return ctx.coda_values

    def initial_state(
        self,
        e: torch.Tensor,
        init: StateInit = "gaussian",
        *,
        positions: torch.Tensor | None = None,
        example_ids: torch.Tensor | None = None,
        seed: int = 0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """s^0 for the prelude output e [B, L, d] (design §2, §14): e itself when `cfg.state_init` is
        "input", else the noise `init` (gaussian / seeded / zero) with std `cfg.state_std` (0 =
        1/sqrt(d)), truncated at +-3 std for "trunc-normal". Noise carries no gradient."""
        if self.cfg.state_init == "input":
            return e
        return initial_state(
            init,
            tuple(e.shape),
            device=e.device,
            dtype=e.dtype,
            example_ids=example_ids,
            positions=positions,
            seed=seed,
            generator=generator,
            std=self.cfg.state_std or None,
            truncate=self.cfg.state_init == "trunc-normal",
        )

    def context(self, e: torch.Tensor, rope, mask, tokens: torch.Tensor | None = None) -> Context:
        """The recurrences' shared quantities for prelude output e; `tokens` [B, L] (required for a model
        with value embeddings) give the core's and coda's value-embedding rows."""
        return Context(
            rope,
            mask,
            self.injection.prepare(e),
            self.injection.qkv_offsets(e),
            self.value_rows("core", tokens),
            self.value_rows("coda", tokens),
        )

    # -- the forward: parallel (no cache) or cached --------------------------------------------
    def forward(
        self,
        tokens: torch.Tensor,
        depth: int | DepthPlan,
        *,
        cache: LayerCache | None = None,
        pad: torch.Tensor | None = None,
        bptt_window: int | None = None,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        init: StateInit = "gaussian",
        state0: torch.Tensor | None = None,
        initial=None,
        example_ids: torch.Tensor | None = None,
        seed: int = 0,
        generator: torch.Generator | None = None,
        return_states: bool = False,
        keep_states: int | None = None,
        compute_logits: bool = True,
        attention: AttentionKernel = "sdpa",
        flex_options: dict | None = None,
        targets: torch.Tensor | None = None,
        ce_chunk_rows: int = 4096,
    ) -> LoopOutput:
        """Run the model at `depth` recurrences (an int, or a `DepthPlan`: per-row depths, adaptive
        exit, the exit gate).

        tokens [B, L]; `doc_ids` [B, L] confine attention to document segments; `positions` [B, L]
        are the RoPE positions (default 0..L-1). `bptt_window` b: only the last min(R, b)
        recurrences record autograd (design §3; None = full BPTT); the injected input keeps its
        gradient in each of them. `state0` overrides `init` (used by trainers that draw the noise
        for a global batch themselves); `initial(e, rope, mask[, values=...])` computes s^0 from the
        prelude output (the distilled prefill's student, design §9). `attention` picks how document
        masks are applied ('flex': one FlexAttention block mask per forward, the fast path on CUDA);
        `flex_options` are its CUDA kernel options (`blocks.flex_kernel_options`). `targets` [B, L]
        (ignored where -100): return their summed cross-entropy as `ce_sum` instead of logits, computed
        `ce_chunk_rows` rows at a time (`cross_entropy_sum`; without a cache). `keep_states` k: with
        `return_states`, only the last k states are kept (each is [B, L, d]; evaluation needs two).

        With a `cache` (`looplm.infer.cache`, design §7) the tokens are a chunk after the cache's
        tokens: every layer visit writes its K/V through the cache's slot and attends to the cached
        prefix; positions and masks come from the cache (`pad` [B] counts left padding per row), and
        the cache grows by the chunk. The parallel forward is the case without a cache.
        """
        plan = depth if isinstance(depth, DepthPlan) else None
        R = plan.largest if plan is not None else depth
        self.check_inputs(tokens, R)
        if plan is not None:
            plan.check(self.cfg.max_depth, has_gate=self.exit_gate is not None, cache=getattr(cache, "mode", None))
        start = StateStart(init, state0, initial, example_ids, seed, generator)
        if pad is not None and cache is None:  # it was ignored: the real tokens attended to the padding
            raise ValueError("pad (left padding) is for a cached forward; the parallel forward takes doc_ids/positions")
        if cache is not None:
            if doc_ids is not None or positions is not None:
                raise ValueError("a cached forward takes its positions and mask from the cache (no doc_ids/positions)")
            positions, mask = cache.chunk(tokens.shape[1], pad, tokens.device)
            rope = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_base)
            e = self.run_prelude(tokens, rope, mask, cache)
            ctx = self.context(e, rope, mask, tokens)
            s = self.start_state(e, ctx, start, positions)
        else:
            ctx, s = self.begin(
                tokens, start, doc_ids=doc_ids, positions=positions, attention=attention, flex_options=flex_options
            )
        s, states, used = self.iterate(
            s,
            ctx,
            plan or DepthPlan(R),
            cache=cache,
            bptt_window=bptt_window,
            return_states=return_states,
            keep_states=keep_states,
        )
        if targets is not None:
            if cache is not None:
                raise ValueError("targets (the summed cross-entropy) are for training, without a cache")
            ce = self.cross_entropy_sum(self.coda_output(s, ctx.rope, ctx.mask, ctx), targets, ce_chunk_rows)
            return LoopOutput(logits=None, endpoint=s, states=states, depths=used, ce_sum=ce)
        logits = None
        if compute_logits or cache is not None:  # a cache needs the coda's K/V
            logits = self.run_coda(s, ctx.rope, ctx.mask, ctx, cache, compute_logits)
        if cache is not None:
            cache.advance(tokens.shape[1])
        return LoopOutput(logits=logits, endpoint=s, states=states, depths=used)

    def iterate(
        self,
        s: torch.Tensor,
        ctx: Context,
        plan: DepthPlan,
        *,
        cache: LayerCache | None = None,
        bptt_window: int | None = None,
        return_states: bool = False,
        keep_states: int | None = None,
    ):
        """The recurrences of `forward` from s^0: (endpoint, per-recurrence states or None, depths [B, L]
        or None when every token ran `plan.depth`). A fixed depth runs `fixed_depth`; tokens that may
        stop early (`plan.freezes`) run `with_exits`; the exit gate picks each token's state after.
        `keep_states` k: of the returned states only the last k are kept."""
        n = s.shape[1]
        if plan.freezes:
            if bptt_window is not None and torch.is_grad_enabled():
                raise ValueError("bptt_window truncates a fixed depth's backprop; per-row depths and exits take none")
            s, states, used = self.with_exits(
                s, ctx, plan, cache=cache, return_states=return_states, keep_states=keep_states
            )
            if cache is not None:
                cache.keep_terminal(n, plan.largest, used)
            return s, states, used
        R = plan.largest
        visited = [] if plan.exit_gate is not None or return_states else None
        keep = None if plan.exit_gate is not None else keep_states  # the gate needs every state
        s = self.fixed_depth(s, ctx, R, cache=cache, bptt_window=bptt_window, visited=visited, keep_states=keep)
        if cache is not None:
            cache.keep_terminal(n, R)
        used = None if cache is None else torch.full(s.shape[:2], R, dtype=torch.long, device=s.device)
        if plan.exit_gate is not None:  # the gate's exit: each token's state at its exit recurrence enters the coda
            index = threshold_exit(exit_distribution([self.exit_gate(v) for v in visited]), plan.exit_gate)
            s, used = select_depth(torch.stack(visited, 2), index), index + 1
            if keep_states is not None:  # the gate read every state; the caller keeps the last k
                visited = visited[-keep_states:]
        return s, (visited if return_states else None), used

    def fixed_depth(
        self,
        s: torch.Tensor,
        ctx: Context,
        R: int,
        *,
        cache: LayerCache | None = None,
        bptt_window: int | None = None,
        visited: list | None = None,
        keep_states: int | None = None,
    ) -> torch.Tensor:
        """R recurrences of every token; only the last min(R, b) record autograd (design §3: the first
        R - b run without it, their output a constant). `visited` collects each recurrence's state
        (the last `keep_states` of them, when given)."""
        n_grad = R if bptt_window is None else min(R, bptt_window)
        grad = torch.is_grad_enabled()
        for r in range(R):
            slots = None if cache is None else [cache.slot("core", j, r) for j in range(len(self.core))]
            with torch.set_grad_enabled(grad and r >= R - n_grad):
                s = self.recurrence(s, ctx, slots=slots)
            if visited is not None:
                visited.append(s)
                if keep_states is not None and len(visited) > keep_states:
                    del visited[0]
        return s

    def with_exits(
        self,
        s: torch.Tensor,
        ctx: Context,
        plan: DepthPlan,
        *,
        cache: LayerCache | None = None,
        return_states: bool = False,
        keep_states: int | None = None,
    ):
        """Recurrences where tokens stop at their row's depth or by adaptive exit (design §13): a stopped
        token's state is frozen and, with a cache, its writes are masked (`slot(keep=...)`), so the
        K/V of its last recurrence stay its terminal K/V for everyone who reads them. In a one-token
        step without autograd the stopped rows leave the batch (`RowsView`): the rest recur alone, so
        a step costs the sum of its rows' depths. Returns (endpoint, states or None, used [B, n])."""
        B, n = s.shape[:2]
        exits = Exits(plan, B, n, s.device)
        compact = n == 1 and not torch.is_grad_enabled()
        states = [] if return_states else None
        view: RowsView | None = None
        for r in range(plan.largest):
            prev = s
            rows = exits.compact() if compact else None
            if rows is not None:
                if view is None or not torch.equal(view.rows, rows):
                    view, sub = RowsView(rows), ctx.select(rows)
                slots = None if cache is None else [view.slot(cache.slot("core", j, r)) for j in range(len(self.core))]
                s = s.clone()
                s[rows] = self.recurrence(s[rows], sub, slots=slots)
            else:
                keep = None if compact else exits.active  # compacting: every row here still recurs
                slots = None if cache is None else [cache.slot("core", j, r, keep) for j in range(len(self.core))]
                s = self.recurrence(s, ctx, slots=slots)
            s = exits.after(r, s, prev)
            if states is not None:
                states.append(s)
                if keep_states is not None and len(states) > keep_states:
                    del states[0]
            if exits.done:
                break
        return s, states, exits.used

    def begin(
        self,
        tokens: torch.Tensor,
        start: StateStart = StateStart(),
        *,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        attention: AttentionKernel = "sdpa",
        flex_options: dict | None = None,
    ) -> tuple[Context, torch.Tensor]:
        """(context, s^0) of the parallel `forward`: the prelude runs once, then the recurrence can
        start (also used by diagnostics that iterate the recurrence themselves)."""
        B, L = tokens.shape
        if positions is None:
            positions = torch.arange(L, device=tokens.device).expand(B, L)
        rope = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_base)
        mask = document_mask(doc_ids, attention, flex_options)
        e = self.run_prelude(tokens, rope, mask)
        ctx = self.context(e, rope, mask, tokens)
        return ctx, self.start_state(e, ctx, start, positions)

    def start_state(
        self, e: torch.Tensor, ctx: Context, start: StateStart = StateStart(), positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """s^0 for prelude output e at `positions` (`StateStart` says which)."""
        if start.initial is not None:
            # a student of a value-embedding teacher reads the core's value embeddings too
            return (
                start.initial(e, ctx.rope, ctx.mask)
                if ctx.core_values is None
                else start.initial(e, ctx.rope, ctx.mask, values=ctx.core_values)
            )
        state0 = start.state0
        if state0 is None:
            s = self.initial_state(
                e,
                start.init,
                positions=positions,
                example_ids=start.example_ids,
                seed=start.seed,
                generator=start.generator,
            )
            if self.cfg.state_init == "input":
                return s  # s0 = e keeps its gradient (the embedding learns)
            state0 = s
        return state0.detach().to(e.dtype)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
