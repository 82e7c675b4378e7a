"""Pre-norm Llama blocks: RMSNorm, RoPE, grouped-query attention, SwiGLU (design §1)."""

from __future__ import annotations

import math
import warnings
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from looplm.config import VALUE_GATE_CHANNELS, ModelConfig
from looplm.model.kv import KVSlot

AttentionKernel = Literal["sdpa", "flex"]
"""How document masks are applied: a boolean mask through SDPA (any device; on CUDA it leaves the
flash kernel for the math/efficient one), or a FlexAttention block mask (skips whole blocks that
cross documents; compiled on CUDA)."""

FLEX_MIN_HEAD_DIM = 16
"""The smallest head size torch's fused FlexAttention kernel (CUDA, inductor) lowers: below it the
compile fails with "embedding dimension ... must be at least 16" (seen on an H200, torch 2.11)."""

# FlexAttention is only fast compiled; inside an already compiled block dynamo inlines this.
_compiled_flex_attention = None


class FlexMask(NamedTuple):
    """A FlexAttention block mask and the kernel options to run it with (`flex_kernel_options`)."""

    block_mask: BlockMask
    kernel_options: dict | None = None


def flex_kernel_options(extra: dict | None = None) -> dict:
    """torch's FlexAttention `kernel_options` for looplm's causal document masks: `extra` (tile sizes
    such as fwd_BLOCK_M / bwd_BLOCK_N1 for long sequences). Used on CUDA only.

    ROWS_GUARANTEED_SAFE is not set: the kernel's running row maximum starts at -inf in the first key
    block scheduled for a query block, so the option needs every row to attend to a key in *that*
    block, not merely to some key. In packed rows a document that starts inside a query block sees
    nothing of the block its neighbours start from: on an H200 (torch 2.11) the option gave NaN
    gradients and a NaN loss at the first training step. (BLOCKS_ARE_CONTIGUOUS does not hold either:
    a query block that starts inside a document has partial blocks at the document's start and at the
    diagonal with full blocks between them.)"""
    return dict(extra or {})


def _flex(q, k, v, mask: FlexMask, enable_gqa: bool) -> torch.Tensor:
    global _compiled_flex_attention
    block_mask, options = mask
    if torch.compiler.is_compiling():  # inside a compiled block: traced into its graph
        return flex_attention(
            q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, kernel_options=options if q.is_cuda else None
        )
    if q.device.type == "cpu":  # eager flex (exact, unfused) keeps CPU tests free of inductor builds
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, kernel_options=options)


class RMSNorm(nn.Module):
    """y = x * (mean(x^2) + eps)^-1/2 * g; `gain=False` gives the parameter-free norm (Huginn exit norm)."""

    def __init__(self, dim: int, eps: float = 1e-6, gain: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if gain else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.type_as(x)


def rope_tables(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [B, 1, L, head_dim/2] in fp32 for integer positions [B, L]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim))
    angles = positions.to(torch.float64)[..., None] * inv_freq  # fp64 so long positions keep their phase
    return angles.cos().float()[:, None], angles.sin().float()[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (half-split layout) of x [B, H, L, hd] in fp32 (design §1)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


def per_head_norm(x: torch.Tensor) -> torch.Tensor:
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + torch.finfo(torch.float32).eps)).type_as(x)


def _trunc_normal_(w: torch.Tensor, std: float) -> None:
    nn.init.trunc_normal_(w, std=std, a=-3 * std, b=3 * std)


def attention_inputs(
    x: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    heads,
    *,
    head_dim: int,
    qk_norm: bool,
    q_bias: torch.Tensor | None = None,
    k_bias: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    value_rows: torch.Tensor | None = None,
    offsets: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries, keys and values an attention layer attends with, from its input x [..., d] and the
    projections q, k, v [..., H*hd] of x: the order of operations of looplm's attention, shared by
    `Attention` and the vLLM plugin's attention (`looplm.vllm_plugin.model`), so a switch is written once.

    1. value embeddings (design §14, Parcae): v += 2 sigmoid(x[..., :32] gate^T) * value_rows, per kv
       head (`gate` [H_kv, 32], `value_rows` [..., H_kv*hd] = E_v[tokens]; both or neither);
    2. DEQ-QKV offsets (dQ, dK, dV) added (design §2);
    3. the q/k bias added (design §14, Huginn);
    4. `heads(t, n)` splits t into n heads (the caller's layout: [B, H, L, hd], or vLLM's [T, H, hd]);
    5. RoPE on q and k with `rope` = (cos, sin) broadcast to that layout;
    6. the gain-free per-head RMSNorm of q and k (`qk_norm`, Parcae), after RoPE.
    Returns (q, k, v) split into heads."""
    if gate is not None:
        g = 2 * torch.sigmoid(F.linear(x[..., : gate.shape[1]], gate))  # [..., H_kv]
        v = v + (g[..., None] * value_rows.view(*g.shape, head_dim)).flatten(-2).to(v.dtype)
    if offsets is not None:
        dq, dk, dv = offsets
        q, k, v = q + dq, k + dk, v + dv
    if q_bias is not None:
        q, k = q + q_bias.to(q.dtype), k + k_bias.to(k.dtype)
    q, k, v = heads(q, q.shape[-1] // head_dim), heads(k, k.shape[-1] // head_dim), heads(v, v.shape[-1] // head_dim)
    cos, sin = rope
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if qk_norm:  # gain-free RMSNorm per head after RoPE (Parcae), eps = fp32 machine eps
        q, k = per_head_norm(q), per_head_norm(k)
    return q, k, v


def ffn_hidden(act: str, a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The FFN's hidden activation from its input maps: SwiGLU silu(w1 x) * (w3 x) (a = w1 x, b = w3 x),
    or ReLU^2 relu(w1 x)^2 (design §14, Parcae; b unused). Shared with the vLLM plugin's FFN."""
    return F.silu(a) * b if act == "swiglu" else F.relu(a).square()


def build_block(block: nn.Module, cfg: ModelConfig, attn: nn.Module, ffn: nn.Module) -> None:
    """Give `block` its attention `attn`, its FFN `ffn` and the norms of `cfg.block_norm` (design §14):
    the attributes `block_forward` reads. attn_norm and ffn_norm (every block), attn_out_norm and
    ffn_out_norm (sandwich and branch; else None), norm_sum (sandwich: the second norm normalises the
    residual sum). Registered in this order (the parameters' order: optimizer states follow it)."""
    block.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    block.attn = attn
    block.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
    block.ffn = ffn
    block.norm_sum = cfg.block_norm == "sandwich"
    second = cfg.block_norm != "pre"
    block.attn_out_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if second else None
    block.ffn_out_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if second else None


def sublayer_residual(x: torch.Tensor, y: torch.Tensor, norm: nn.Module | None, norm_sum: bool) -> torch.Tensor:
    """x + y, with the sublayer's second norm on the sum (sandwich, `norm_sum`) or on y (branch)."""
    if norm is None:
        return x + y
    return norm(x + y) if norm_sum else x + norm(y)


def block_forward(block: nn.Module, x: torch.Tensor, attend) -> torch.Tensor:
    """A block's residual stream around its attention (design §1, §14), shared by `Block` and the
    vLLM plugin's block: h = x (+) attend(attn_norm(x)), out = h (+) ffn(ffn_norm(h)), where (+) is
    `sublayer_residual` with the block's second norms (`build_block`). `attend(a)` is the
    attention sublayer's output for its normalised input a (the caller's attention and its cache)."""
    h = sublayer_residual(x, attend(block.attn_norm(x)), block.attn_out_norm, block.norm_sum)
    return sublayer_residual(h, block.ffn(block.ffn_norm(h)), block.ffn_out_norm, block.norm_sum)


class Attention(nn.Module):
    """Causal grouped-query attention through `F.scaled_dot_product_attention`.

    `offsets` are additive terms for Q, K and V (DEQ-QKV injection, design §2); `mask` is a
    boolean [B, 1, L, S] (True = attend), a FlexAttention `FlexMask` or `BlockMask` (from `document_mask`), or
    None for plain causal attention.
    """

    def __init__(self, cfg: ModelConfig, value_embed: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qk_norm = cfg.qk_norm
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        # design §14: a learned q/k bias added before RoPE (Huginn's qk_bias), zero at init
        self.q_bias = nn.Parameter(torch.zeros(cfg.n_heads * cfg.head_dim)) if cfg.qk_bias else None
        self.k_bias = nn.Parameter(torch.zeros(cfg.n_kv_heads * cfg.head_dim)) if cfg.qk_bias else None
        # design §14: value embeddings (Parcae): v += 2 sigmoid(gate(x[..., :32])) * E_v[token] per kv head
        self.ve_gate = nn.Linear(VALUE_GATE_CHANNELS, cfg.n_kv_heads, bias=False) if value_embed else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | FlexMask | BlockMask | None,
        *,
        offsets: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        kv: KVSlot | None = None,
        value_embed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend from x [B, n, d] to itself, or through the slot `kv` (`looplm.model.kv`): the
        chunk's K (after RoPE) and V go to `kv.update`, and attention reads what it returns (a
        cache's earlier tokens and this chunk), under `mask` [B or 1, 1, n, S], which must then be
        given. `offsets` are DEQ-QKV's additive (dQ, dK, dV). `value_embed` [B, n, H_kv*hd] is
        this chunk's value-embedding rows E_v[tokens] (required iff the layer has a gate)."""
        B, L, _ = x.shape
        if (self.ve_gate is None) != (value_embed is None):
            raise ValueError(
                "this attention layer has a value embedding: pass value_embed=E_v[tokens] (the model's "
                "Context carries them; see LoopedLM.value_rows)"
                if value_embed is None
                else "value_embed given to an attention layer without a value-embedding gate"
            )
        q, k, v = attention_inputs(
            x,
            self.wq(x),
            self.wk(x),
            self.wv(x),
            rope,
            lambda t, n: t.view(B, L, n, self.head_dim).transpose(1, 2),
            head_dim=self.head_dim,
            qk_norm=self.qk_norm,
            q_bias=self.q_bias,
            k_bias=self.k_bias,
            gate=None if self.ve_gate is None else self.ve_gate.weight,
            value_rows=value_embed,
            offsets=offsets,
        )
        k_all, v_all = (k, v) if kv is None else kv.update(k, v)
        gqa = self.n_heads != self.n_kv_heads
        if isinstance(mask, BlockMask):
            mask = FlexMask(mask)
        if isinstance(mask, FlexMask):
            if k_all.shape[2] != L:
                raise ValueError("FlexAttention block masks serve the parallel forward; caches use boolean masks")
            y = _flex(q, k_all, v_all, mask, gqa)
        elif mask is None:
            if k_all.shape[2] != L:
                raise ValueError("attention over a cached prefix needs an explicit mask")
            y = F.scaled_dot_product_attention(q, k_all, v_all, is_causal=True, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(B, L, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(ffn_hidden("swiglu", self.w1(x), self.w3(x)))


class ReLU2(nn.Module):
    """out = w2(relu(w1 x)^2) (design §14, Parcae's ReLU^2 MLP; its factor 1/2 is folded into w2)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(ffn_hidden("relu2", self.w1(x)))


class Block(nn.Module):
    """h = x + Attn(RMSNorm(x)); out = h + SwiGLU(RMSNorm(h)) (design §1).

    `cfg.block_norm` places a second norm on each sublayer (design §14): "sandwich" normalises
    the residual sum, h = n2(x + Attn(n1 x)), out = n4(h + FFN(n3 h)) (Huginn); "branch"
    normalises the sublayer output, h = x + n2(Attn(n1 x)), out = h + n4(FFN(n3 h)) (Ouro)."""

    def __init__(self, cfg: ModelConfig, value_embed: bool = False):
        super().__init__()
        build_block(self, cfg, Attention(cfg, value_embed), ReLU2(cfg) if cfg.ffn_act == "relu2" else SwiGLU(cfg))

    @property
    def has_value_embed(self) -> bool:
        return self.attn.ve_gate is not None

    def forward(self, x, rope, mask, *, offsets=None, kv: KVSlot | None = None, value_embed=None) -> torch.Tensor:
        """`offsets`, `kv` and `value_embed` go to the attention (see `Attention.forward`)."""
        return block_forward(
            self, x, lambda a: self.attn(a, rope, mask, offsets=offsets, kv=kv, value_embed=value_embed)
        )

    def reset_parameters(self, std: float = 0.02) -> None:
        ffn = [getattr(self.ffn, name) for name in ("w1", "w2", "w3") if hasattr(self.ffn, name)]  # w3: swiglu only
        for lin in (self.attn.wq, self.attn.wk, self.attn.wv, self.attn.wo, *ffn):
            _trunc_normal_(lin.weight, std)
        if self.attn.ve_gate is not None:
            nn.init.zeros_(self.attn.ve_gate.weight)  # gate 2 sigmoid(0) = 1


def causal_document_mask(doc_ids: torch.Tensor | None) -> torch.Tensor | None:
    """Boolean [B, 1, L, L] mask: causal and within one document segment; None if no segments."""
    if doc_ids is None:
        return None
    L = doc_ids.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same_doc & causal)[:, None]


def document_block_mask(doc_ids: torch.Tensor) -> BlockMask:
    """The mask of `causal_document_mask` as a FlexAttention block mask, built once per batch and
    reused by every layer visit of every recurrence."""
    B, L = doc_ids.shape

    def causal_same_document(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return create_block_mask(causal_same_document, B, None, L, L, device=doc_ids.device)


def document_mask(doc_ids: torch.Tensor | None, kernel: AttentionKernel = "sdpa", flex_options: dict | None = None):
    """The attention mask of packed rows for `kernel`: None (plain causal) without segments; for flex a
    `FlexMask` with `flex_kernel_options(flex_options)`."""
    if doc_ids is None:
        return None
    if kernel == "flex":
        return FlexMask(document_block_mask(doc_ids), flex_kernel_options(flex_options))
    if kernel != "sdpa":
        raise ValueError(f"unknown attention kernel {kernel!r}; choose sdpa or flex")
    return causal_document_mask(doc_ids)


def init_embedding_(w: torch.Tensor) -> None:
    """design §1: truncated normal with std 1/sqrt(d), cut at +-3 sigma."""
    _trunc_normal_(w, 1.0 / math.sqrt(w.shape[1]))
