"""The looped model as a vLLM model, with terminal KV sharing (design §7, §15).

vLLM hands the model a flat batch of tokens (prompt chunks and decode tokens of many sequences)
with their positions; the KV memory, the slot of every token and the batching belong to vLLM.
Each *physical* attention layer (prelude, core, coda) owns one vLLM `Attention`, so vLLM's KV cache
has one bank per physical layer. A core layer's attention runs at every recurrence: each visit
writes the token's K/V into the token's slot (overwriting the previous recurrence's) and attends to
the cached prefix and the chunk, so past tokens keep their last recurrence's K/V and a token reads
its own current K/V: exactly looplm's terminal cache (`looplm.infer.extend`).

Per-token depth (`prefill_steps` for prompt tokens, `num_steps` for decoded ones, adaptive exit of
decoded tokens with `exit_tau`): which tokens are the prompt's comes from a model-runner hook
(`looplm.vllm_plugin.token_roles`); the loop runs to the deepest token, a token that stopped keeps
its frozen state and passes its last K/V again (`TerminalKV`), so its slot keeps its terminal K/V.

What runs between the attention calls is looplm's own code: the block's norms and residual stream
(`block_forward`), the attention's order of operations (`attention_inputs`), the FFN activation, the
injection schemes, the exit gate, norms, RoPE and the seeded initial state are imported from
`looplm.model`; only the projections are vLLM's tensor-parallel layers.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.utils import maybe_prefix
from vllm.sequence import IntermediateTensors

from looplm.config import VALUE_GATE_CHANNELS, ModelConfig
from looplm.errors import UserError
from looplm.hf.configuration import CONFIG_KEYS, check_tokenizer_vocab_size
from looplm.infer.depth_rule import DepthRule, check_exit_gate
from looplm.model.blocks import RMSNorm, attention_inputs, block_forward, build_block, ffn_hidden, rope_tables
from looplm.model.exits import relative_change
from looplm.model.exit_gate import ExitGate, exit_distribution, select_depth, threshold_exit
from looplm.model.injection import build_injection
from looplm.model.state import initial_state
from looplm.vllm_plugin import token_roles

STACKS = ("prelude", "core", "coda")
MERGED_PIECES = {"q": "attn.wq", "k": "attn.wk", "v": "attn.wv", 0: "ffn.w1", 1: "ffn.w3"}
"""The looplm tensor behind each shard of a merged vLLM parameter (qkv, w13), named in load errors."""
# Every ModelConfig switch this module implements. A field added to ModelConfig later is refused at load
# (unless it has its default value) until it is implemented here, so a model never serves differently.
IMPLEMENTED = frozenset(
    {
        "vocab_size",
        "d_model",
        "n_heads",
        "n_kv_heads",
        "ffn_dim",
        "n_prelude",
        "n_core",
        "n_coda",
        "max_seq_len",
        "injection",
        "rope_base",
        "norm_eps",
        "ortho_eps",
        "max_depth",
        "block_norm",
        "qk_bias",
        "embed_scale",
        "tie_embeddings",
        "exit_norm",
        "post_loop_norm",
        "head_norm",
        "state_init",
        "state_std",
        "exit_gate",
        "ffn_act",
        "qk_norm",
        "value_embeds",
        "coda_proj",
    }
)


class Refused(ValueError):
    """A setting the vLLM plugin does not serve (the message names it and says why)."""


def model_config(hf_config) -> ModelConfig:
    """looplm's ModelConfig of the (exported) transformers config vLLM loaded."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: getattr(hf_config, k) for k in names if hasattr(hf_config, k)})
    cfg.validate()
    return cfg


def check_servable(hf_config, *, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> ModelConfig:
    """The ModelConfig to serve, or `Refused` naming the first setting this plugin does not implement."""
    cfg = model_config(hf_config)
    default = ModelConfig()
    for f in dataclasses.fields(ModelConfig):
        if f.name not in IMPLEMENTED and getattr(cfg, f.name) != getattr(default, f.name):
            raise Refused(
                f"model switch {f.name}={getattr(cfg, f.name)!r} is not implemented by the looplm vLLM "
                "plugin; serve this model with `looplm serve`"
            )
    if getattr(hf_config, "cache_kind", "terminal") != "terminal":
        raise Refused(
            f"cache_kind={hf_config.cache_kind!r}: the vLLM plugin serves the terminal cache only "
            "(one KV bank per physical layer); export with --cache terminal or override "
            '--hf-overrides \'{"cache_kind": "terminal"}\''
        )
    pre, tau = getattr(hf_config, "prefill_steps", None), getattr(hf_config, "exit_tau", None)
    gate = getattr(hf_config, "exit_gate_threshold", None)
    try:  # looplm's one depth rule, its settings named by their config keys
        check_exit_gate(gate, tau, CONFIG_KEYS["exit_gate"])
        rule = DepthRule(getattr(hf_config, "num_steps", 5), pre, tau, getattr(hf_config, "min_depth", 1), gate)
        rule.check(cfg.max_depth, has_gate=cfg.exit_gate, what="the config's max_depth", spelling=CONFIG_KEYS)
        # --hf-overrides reach the config past its own checks: a 0 here masked every logit (NaN log-probs)
        check_tokenizer_vocab_size(getattr(hf_config, "tokenizer_vocab_size", None), cfg.vocab_size)
    except UserError as err:
        raise Refused(str(err)) from None
    if gate is not None and rule.prefill != rule.depth:
        raise Refused(
            "exit_gate_threshold (the exit gate's threshold exit) runs one fixed depth per forward (looplm's "
            "DepthPlan), and a vLLM forward mixes prompt and decoded tokens: it takes no prefill_steps "
            "different from num_steps"
        )
    if pipeline_parallel != 1:
        raise Refused(
            "pipeline parallelism is not supported by the looplm vLLM plugin (the shared core runs "
            "every recurrence on one stage); use tensor parallelism"
        )
    if cfg.n_kv_heads % tensor_parallel:
        raise Refused(f"tensor parallel size {tensor_parallel} must divide n_kv_heads={cfg.n_kv_heads}")
    return cfg


def _shard_loader(dim: int, parts: int, rank: int):
    """A weight loader that copies this rank's slice (1/parts along `dim`) of a full tensor."""

    def load(param: torch.Tensor, loaded: torch.Tensor) -> None:
        size = loaded.shape[dim] // parts
        param.data.copy_(loaded.narrow(dim, rank * size, size))

    return load


def _sharded(shape: tuple[int, ...], dim: int, tp: int, rank: int) -> nn.Parameter:
    shape = tuple(s // tp if i == dim else s for i, s in enumerate(shape))
    param = nn.Parameter(torch.zeros(shape), requires_grad=False)
    param.weight_loader = _shard_loader(dim, tp, rank)
    return param


class TerminalKV:
    """A core layer's terminal K/V under per-token depth (design §15): each recurrence's attention passes
    its tokens' new K/V through `__call__`, which keeps them for the tokens still recurring (`active` [T])
    and substitutes, for a token that stopped, the K/V it passed at its last recurrence. vLLM's attention
    writes every token's K/V into its slot at every call, so a stopped token's slot is rewritten with the
    values it already holds: its last recurrence's K/V stay its terminal K/V, for later tokens and for the
    tokens of its own chunk that still recur (what looplm's masked writes, `slot(keep=active)`, keep).
    No host sync, no change to vLLM's slot mapping; any attention backend."""

    def __init__(self):
        self.active: torch.Tensor | None = None  # None: every token recurs (the first recurrence)
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.active is not None and self.kv is not None:
            keep = self.active[:, None]
            k, v = torch.where(keep, k, self.kv[0]), torch.where(keep, v, self.kv[1])
        self.kv = (k, v)
        return k, v


class LoopedAttention(nn.Module):
    """looplm's attention (`looplm.model.blocks.Attention`: q/k bias, RoPE, per-head qk norm, value
    embeddings, DEQ-QKV offsets) over vLLM's paged KV cache, sharded by heads across tensor-parallel ranks."""

    def __init__(self, cfg: ModelConfig, value_embed: bool, prefix: str, cache_config, quant_config):
        super().__init__()
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        self.head_dim = hd = cfg.head_dim
        self.n_heads, self.n_kv_heads = cfg.n_heads // tp, cfg.n_kv_heads // tp
        self.q_size, self.kv_size = self.n_heads * hd, self.n_kv_heads * hd
        self.rank, self.tp = rank, tp
        self.qk_norm = cfg.qk_norm
        self.qkv = QKVParallelLinear(
            cfg.d_model, hd, cfg.n_heads, cfg.n_kv_heads, bias=False, quant_config=quant_config, prefix=f"{prefix}.qkv"
        )
        self.wo = RowParallelLinear(
            cfg.n_heads * hd, cfg.d_model, bias=False, quant_config=quant_config, prefix=f"{prefix}.wo"
        )
        self.q_bias = _sharded((cfg.n_heads * hd,), 0, tp, rank) if cfg.qk_bias else None
        self.k_bias = _sharded((cfg.n_kv_heads * hd,), 0, tp, rank) if cfg.qk_bias else None
        # value embeddings (design §14): gate rows and table columns split by kv head like K/V
        self.ve_gate = _sharded((cfg.n_kv_heads, VALUE_GATE_CHANNELS), 0, tp, rank) if value_embed else None
        self.ve_table = _sharded((cfg.vocab_size, cfg.n_kv_heads * hd), 1, tp, rank) if value_embed else None
        self.attn = Attention(
            self.n_heads,
            hd,
            hd**-0.5,
            num_kv_heads=self.n_kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
        )

    def local(self, full: torch.Tensor, per_rank: int) -> torch.Tensor:
        """This rank's columns of a tensor computed at full width (the DEQ-QKV offsets)."""
        return full if self.tp == 1 else full.narrow(-1, self.rank * per_rank, per_rank)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        tokens: torch.Tensor,
        offsets: tuple | None,
        terminal: TerminalKV | None = None,
    ) -> torch.Tensor:
        """The attention sublayer's output for x [T, d]: looplm's order of operations (`attention_inputs`),
        then vLLM's attention over its paged cache. `terminal` (per-token depth) substitutes a stopped
        token's last K/V for its new ones (see `TerminalKV`)."""
        T = x.shape[0]
        qkv, _ = self.qkv(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if offsets is not None:  # DEQ-QKV: this rank's columns of the full-width offsets
            offsets = tuple(self.local(o, n) for o, n in zip(offsets, (self.q_size, self.kv_size, self.kv_size)))
        rows = F.embedding(tokens, self.ve_table) if self.ve_gate is not None else None
        q, k, v = attention_inputs(
            x,
            q,
            k,
            v,
            rope,
            lambda t, n: t.view(T, n, self.head_dim),
            head_dim=self.head_dim,
            qk_norm=self.qk_norm,
            q_bias=self.q_bias,
            k_bias=self.k_bias,
            gate=self.ve_gate,
            value_rows=rows,
            offsets=offsets,
        )
        k, v = k.reshape(T, self.kv_size), v.reshape(T, self.kv_size)
        if terminal is not None:
            k, v = terminal(k, v)
        y = self.attn(q.reshape(T, self.q_size), k, v)
        out, _ = self.wo(y)
        return out


class LoopedFFN(nn.Module):
    """SwiGLU w2(silu(w1 x) * w3 x) with w1/w3 merged into one column-parallel map, or ReLU^2 w2(relu(w1 x)^2)."""

    def __init__(self, cfg: ModelConfig, prefix: str, quant_config):
        super().__init__()
        self.swiglu = cfg.ffn_act == "swiglu"
        if self.swiglu:
            self.w13 = MergedColumnParallelLinear(
                cfg.d_model, [cfg.ffn_dim] * 2, bias=False, quant_config=quant_config, prefix=f"{prefix}.w13"
            )
        else:
            self.w1 = ColumnParallelLinear(
                cfg.d_model, cfg.ffn_dim, bias=False, quant_config=quant_config, prefix=f"{prefix}.w1"
            )
        self.w2 = RowParallelLinear(
            cfg.ffn_dim, cfg.d_model, bias=False, quant_config=quant_config, prefix=f"{prefix}.w2"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            h, _ = self.w13(x)
            h = ffn_hidden("swiglu", *h.chunk(2, dim=-1))
        else:
            h, _ = self.w1(x)
            h = ffn_hidden("relu2", h)
        out, _ = self.w2(h)
        return out


class LoopedBlock(nn.Module):
    """`looplm.model.blocks.Block` over `LoopedAttention`: the same norms and residual stream
    (`build_block`, `block_forward`)."""

    def __init__(self, cfg: ModelConfig, value_embed: bool, prefix: str, cache_config, quant_config):
        super().__init__()
        build_block(
            self,
            cfg,
            LoopedAttention(cfg, value_embed, f"{prefix}.attn", cache_config, quant_config),
            LoopedFFN(cfg, f"{prefix}.ffn", quant_config),
        )

    def forward(self, x, rope, tokens, offsets=None, terminal=None):
        return block_forward(self, x, lambda a: self.attn(a, rope, tokens, offsets, terminal))


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "intermediate_tensors": 0, "inputs_embeds": 0})
class LoopedLMForVLLM(nn.Module):
    """prelude -> (injection -> core) x num_steps -> coda -> logits over vLLM's flattened batch.

    Depth: `num_steps` of the exported config (`--hf-overrides '{"num_steps": N}'`). The initial state
    is the one `looplm generate` gives a prompt run alone: the seeded state of example 0 at each
    token's position (or the prelude output for state_init="input"). With `exit_gate_threshold` q
    (Ouro's threshold exit) every recurrence runs and writes its K/V, and each token's coda reads the
    state of the first recurrence whose cumulative exit probability reaches q (design §14).

    Per-token depth (`per_token_loop`): with `prefill_steps` P != num_steps D, or `exit_tau` (and
    `min_depth`), prompt tokens run P recurrences (default D) and decoded tokens D, stopping earlier by
    adaptive exit; prompt and decoded tokens are told apart by the runner hook's roles buffer."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        hf = vllm_config.model_config.hf_config
        par = vllm_config.parallel_config
        cfg = check_servable(hf, tensor_parallel=par.tensor_parallel_size, pipeline_parallel=par.pipeline_parallel_size)
        self.cfg, self.depth = cfg, int(getattr(hf, "num_steps", 5))
        self.exit_threshold = getattr(hf, "exit_gate_threshold", None)
        pre = getattr(hf, "prefill_steps", None)
        self.prefill_depth = self.depth if pre is None else int(pre)
        self.exit_tau = getattr(hf, "exit_tau", None)
        self.min_depth = int(getattr(hf, "min_depth", 1))
        self.per_token = self.prefill_depth != self.depth or self.exit_tau is not None
        # eager forwards of the per-token loop: how many, their recurrences, how many mixed prompt and decoded tokens
        self.loop_stats = {"forwards": 0, "recurrences": 0, "mixed": 0}
        if self.per_token:  # which tokens are the prompt's: the model-runner hook fills this buffer
            token_roles.install(vllm_config)
            self.register_buffer(
                token_roles.ROLES_ATTRIBUTE,
                torch.zeros(vllm_config.scheduler_config.max_num_batched_tokens, dtype=torch.int8),
                persistent=False,
            )
        cache_config, quant_config = vllm_config.cache_config, vllm_config.quant_config
        self.embed = VocabParallelEmbedding(
            cfg.vocab_size, cfg.d_model, quant_config=quant_config, prefix=maybe_prefix(prefix, "embed")
        )
        # one list of physical blocks: vLLM names each attention by a single layer index
        counts = {"prelude": cfg.n_prelude, "core": cfg.n_core, "coda": cfg.n_coda}
        self.first = {"prelude": 0, "core": cfg.n_prelude, "coda": cfg.n_prelude + cfg.n_core}
        self.layers = nn.ModuleList(
            LoopedBlock(
                cfg,
                cfg.has_value_embed(i),
                maybe_prefix(prefix, f"layers.{self.first[stack] + i}"),
                cache_config,
                quant_config,
            )
            for stack in STACKS
            for i in range(counts[stack])
        )
        self.injection = build_injection(cfg)  # looplm's module, replicated on every rank
        self.coda_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False) if cfg.coda_proj else None
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.head_norm else nn.Identity()
        self.exit_gate = ExitGate(cfg.d_model) if cfg.exit_gate else None
        self.head = ParallelLMHead(
            cfg.vocab_size, cfg.d_model, quant_config=quant_config, prefix=maybe_prefix(prefix, "head")
        )
        if cfg.tie_embeddings:
            self.head = self.head.tie_weights(self.embed)
        self.logits_processor = LogitsProcessor(cfg.vocab_size)
        # rows of a padded embedding past the tokenizer's ids (`looplm export` records how many it has)
        n_tok = getattr(hf, "tokenizer_vocab_size", None)
        self.tokenizer_vocab_size = int(n_tok) if n_tok is not None and n_tok < cfg.vocab_size else None

    def stack(self, name: str) -> list[LoopedBlock]:
        n = {"prelude": self.cfg.n_prelude, "core": self.cfg.n_core, "coda": self.cfg.n_coda}[name]
        return list(self.layers[self.first[name] : self.first[name] + n])

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        return x if self.cfg.embed_scale == 1.0 else x * self.cfg.embed_scale

    def initial_state(self, e: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """s^0 [T, d] of `looplm generate` for a prompt alone: example id 0, seed 0 (design §2, §14)."""
        if self.cfg.state_init == "input":
            return e
        s = initial_state(
            "seeded",
            (1, e.shape[0], e.shape[1]),
            device=e.device,
            dtype=e.dtype,
            example_ids=torch.zeros(1, dtype=torch.long, device=e.device),
            positions=positions[None],
            std=self.cfg.state_std or None,
            truncate=self.cfg.state_init == "trunc-normal",
        )
        return s[0]

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if input_ids is None:
            raise Refused(
                "the looplm vLLM plugin takes token ids, not prompt embeddings (its initial state and "
                "value embeddings read the tokens)"
            )
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = rope_tables(positions[None], self.cfg.head_dim, self.cfg.rope_base)
        rope = (cos[0, 0][:, None], sin[0, 0][:, None])  # [T, 1, hd/2]: broadcast over heads
        for block in self.stack("prelude"):
            x = block(x, rope, input_ids)
        injected, offsets = self.injection.prepare(x), self.injection.qkv_offsets(x)
        s = self.initial_state(x, positions)
        visited = []
        if self.per_token:
            s = self.per_token_loop(s, injected, offsets, rope, input_ids)
        else:
            for _ in range(self.depth):  # design §7: each core attention rewrites the token's slot every recurrence
                s = self.recurrence(s, injected, offsets, rope, input_ids)
                if self.exit_threshold is not None:
                    visited.append(s)
        if visited:  # Ouro's threshold exit: the coda reads each token's exit recurrence
            pdf = exit_distribution([self.exit_gate(v)[None] for v in visited])
            s = select_depth(torch.stack(visited, 1)[None], threshold_exit(pdf, self.exit_threshold))[0]
        z = self.norm(s) if self.cfg.post_loop_norm else s
        z = self.coda_proj(z) if self.coda_proj is not None else z
        for block in self.stack("coda"):
            z = block(z, rope, input_ids)
        return self.norm(z)

    def recurrence(self, s, injected, offsets, rope, input_ids, terminals=None):
        """One recurrence F (design §2): inject, the core blocks, the exit map."""
        s = self.injection(s, injected)
        for j, block in enumerate(self.stack("core")):
            s = block(s, rope, input_ids, offsets[j] if offsets else None, None if terminals is None else terminals[j])
        return self.injection.exit(s)

    def per_token_loop(self, s, injected, offsets, rope, input_ids):
        """The recurrences under per-token depth (looplm's `LoopedLM.with_exits`, design §13, §15): a prompt
        token (the runner hook's roles buffer) runs `prefill_depth` recurrences, a decoded token `num_steps`,
        or fewer with `exit_tau` once r >= min_depth and |s^r - s^(r-1)| / |s^(r-1)| < exit_tau. The loop runs
        to the deepest; a token that stopped keeps its frozen state and its last K/V (`TerminalKV`).

        Eager, the loop ends when every token stopped: the step's depth from the hook's host-side summary
        (prompt tokens and/or decoded ones), and with exit_tau a host sync after each recurrence from
        min_depth on. Compiled (vLLM's torch.compile, CUDA graphs) it always runs max(prefill_depth,
        num_steps) recurrences, with masks and no host sync: the extra recurrences change no token (a
        stopped token's state and K/V are rewritten with themselves), so compiled equals eager."""
        T = s.shape[0]
        prompt = getattr(self, token_roles.ROLES_ATTRIBUTE)[:T].bool()
        P, D, tau = self.prefill_depth, self.depth, self.exit_tau
        eager = not torch.compiler.is_compiling()
        R = max(P, D)
        has_prompt, has_decoded = True, True
        if eager:
            has_prompt, has_decoded = getattr(self, token_roles.KINDS_ATTRIBUTE, (True, True))
            R = max(P if has_prompt else 0, D if has_decoded else 0) or R
        terminals = [TerminalKV() for _ in range(self.cfg.n_core)]
        active = None  # every token recurs
        r = 0
        for r in range(R):
            prev = s
            s = self.recurrence(s, injected, offsets, rope, input_ids, terminals)
            if active is not None:
                s = torch.where(active[:, None], s, prev)  # a stopped token's state stays frozen
            stop, step = None, r + 1
            if step >= P:
                stop = prompt
            if step >= D:
                stop = ~prompt if stop is None else stop | ~prompt
            if tau is not None and step >= self.min_depth and step < D:  # adaptive exit: decoded tokens only
                change = relative_change(s, prev)
                exits = (change < tau) & ~prompt
                stop = exits if stop is None else stop | exits
            if stop is not None:
                active = ~stop if active is None else active & ~stop
                for t in terminals:
                    t.active = active
                if eager and tau is not None and step < R and not bool(active.any()):
                    break
        if eager:
            self.loop_stats["forwards"] += 1
            self.loop_stats["recurrences"] += r + 1
            self.loop_stats["mixed"] += has_prompt and has_decoded
        return s

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The head's logits, -inf past the tokenizer's ids: vLLM samples and normalises over the
        width it was given (the model's vocab_size), so the padded rows are masked, not cut."""
        logits = self.logits_processor(self.head, hidden_states)
        if logits is not None and self.tokenizer_vocab_size is not None:
            logits[..., self.tokenizer_vocab_size :] = float("-inf")
        return logits

    # -- weights ---------------------------------------------------------------------------------
    def target(self, name: str) -> tuple[str, object]:
        """(parameter name, shard id or None) of looplm tensor `name` ('model.' prefix stripped)."""
        m = re.fullmatch(r"(prelude|core|coda)\.(\d+)\.(.+)", name)
        if m:
            g = self.first[m[1]] + int(m[2])
            rest = m[3]
            for old, new, shard in (
                ("attn.wq.", "attn.qkv.", "q"),
                ("attn.wk.", "attn.qkv.", "k"),
                ("attn.wv.", "attn.qkv.", "v"),
                ("ffn.w3.", "ffn.w13.", 1),
            ):
                if rest.startswith(old):
                    return f"layers.{g}.{new}{rest[len(old) :]}", shard
            if rest.startswith("ffn.w1.") and self.cfg.ffn_act == "swiglu":
                return f"layers.{g}.ffn.w13.{rest[len('ffn.w1.') :]}", 0
            if rest == "attn.ve_gate.weight":
                return f"layers.{g}.attn.ve_gate", None
            return f"layers.{g}.{rest}", None
        m = re.fullmatch(r"value_embeds\.(prelude|core|coda)\.(\d+)\.weight", name)
        if m:
            return f"layers.{self.first[m[1]] + int(m[2])}.attn.ve_table", None
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load looplm's tensors (`model.*` of an exported folder). Both layouts load: separate
        `attn.wq/wk/wv` and `ffn.w1/w3`, or fused `attn.wqkv` (rows q, k, v) and `ffn.w13` (rows w1, w3)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        pieces: dict[str, set] = {}  # a merged parameter's shards loaded so far (qkv: q, k, v; w13: 0, 1)
        cfg = self.cfg
        q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        for name, w in weights:
            name = name.removeprefix("model.")
            if name.endswith("attn.wqkv.weight"):  # fused projections: split into their shards
                parts = zip((".wq.", ".wk.", ".wv."), w.split([q_rows, kv_rows, kv_rows]))
            elif name.endswith("ffn.w13.weight"):
                parts = zip((".w1.", ".w3."), w.chunk(2))
            else:
                parts = [(None, w)]
            for piece, tensor in parts:
                full = name if piece is None else name.replace(".wqkv." if "wqkv" in name else ".w13.", piece)
                pname, shard = self.target(full)
                if pname not in params:
                    raise ValueError(
                        f"unexpected tensor {name!r} in the checkpoint (the looplm vLLM plugin has no "
                        f"place for it; is the folder from `looplm export` of this looplm version?)"
                    )
                param = params[pname]
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor) if shard is None else loader(param, tensor, shard)
                loaded.add(pname)
                if shard is not None:
                    pieces.setdefault(pname, set()).add(shard)
        # a merged parameter is loaded only when every piece was: vLLM's own check skips linear layers
        lacking = sorted(
            f"{pname} ({', '.join(MERGED_PIECES[shard] for shard in sorted(want - got, key=str))})"
            for pname, got in pieces.items()
            if (want := ({"q", "k", "v"} if ".qkv." in pname else {0, 1})) - got
        )
        missing = sorted(set(params) - loaded) + lacking
        if missing:
            raise ValueError(f"the checkpoint lacks tensors for {missing}")
        return loaded
