"""The plain looped model of the benchmarks: the baseline looplm's training step and decode step are
measured against (`train_throughput.py`, `gpu_train.py`, `decode_speed.py`).

Written from scratch with no looplm code: token embedding, `n_prelude` blocks, `n_core` core blocks
iterated R times with the prelude output injected each recurrence, `n_coda` blocks, an RMSNorm and a
head. Each block is pre-norm attention (Q/K/V/O projections, RoPE, `F.scaled_dot_product_attention`)
and a SwiGLU MLP. Two ways to run it:

- `forward(tokens, state0, depth)`: training, the whole sequence under a causal mask, fp32 logits;
- `decoding(batch, max_len)`, then `step(tokens, at, depth)`: one token per row into a preallocated
  K/V bank per physical layer (terminal KV sharing) under a length mask, static shapes, in three
  pieces (`begin`, `recur`, `end`; a shallow step in one) that `compiled()` compiles as looplm's
  `DecodeStep` does on a CPU.

It knows none of looplm's generality (document masks, depth plans, caches, value embeddings, exits).
The options below keep each benchmark's baseline the computation it measured, op for op:

- `injection`: "additive" (s = s + e) or "linear" (s = decay * s + W e, decay a learned vector);
- `fused`: one QKV matmul and one gate/up matmul instead of separate Q, K, V and gate, up projections;
- `norm`: "module" (`nn.RMSNorm`), "written" (x * rsqrt(mean(x^2) + eps) * w, in the stream's dtype) or
  "fp32" (`F.rms_norm` of the stream in fp32, then * w);
- `rope_fp32`: rotate Q and K in fp32 (and cast back) instead of in their own dtype;
- `repeat_kv`: grouped-query attention by repeating the K/V heads instead of SDPA's `enable_gqa`;
- `max_len`: the training forward reads RoPE tables precomputed for `max_len` positions instead of
  computing them in each forward.

`init_weights` draws every matrix from N(0, std^2) (the embedding optionally with its own std); without
it the weights keep torch's default initialisation (decode speed does not depend on them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

EPS = 1e-6


class WrittenRMSNorm(nn.Module):
    """RMSNorm written out in the stream's dtype."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight


class Fp32RMSNorm(nn.Module):
    """`F.rms_norm` of the stream in fp32, cast back, then the gain."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.rms_norm(x.float(), (x.shape[-1],), eps=EPS).type_as(x) * self.weight


def make_norm(kind: str, d: int) -> nn.Module:
    if kind == "module":
        return nn.RMSNorm(d, eps=EPS)
    if kind == "written":
        return WrittenRMSNorm(d)
    if kind == "fp32":
        return Fp32RMSNorm(d)
    raise ValueError(f"unknown norm {kind!r}: module, written or fp32")


def rotate(x, cos, sin, fp32: bool = False):
    """RoPE on the last dimension's two halves: in x's dtype, or with `fp32` in fp32 and cast back."""
    if fp32:
        a, b = x.float().chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).type_as(x)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class PlainBlock(nn.Module):
    """Pre-norm attention and SwiGLU MLP, for a whole causal sequence or one token into a K/V bank."""

    def __init__(
        self,
        d: int,
        heads: int,
        kv_heads: int,
        ffn: int,
        *,
        fused: bool = False,
        norm: str = "module",
        rope_fp32: bool = False,
        repeat_kv: bool = False,
    ):
        super().__init__()
        self.h, self.kvh, self.hd = heads, kv_heads, d // heads
        self.fused, self.rope_fp32, self.repeat_kv = fused, rope_fp32, repeat_kv
        self.n1, self.n2 = make_norm(norm, d), make_norm(norm, d)
        if fused:
            self.qkv = nn.Linear(d, (heads + 2 * kv_heads) * self.hd, bias=False)
            self.gate_up = nn.Linear(d, 2 * ffn, bias=False)
        else:
            self.q, self.k = nn.Linear(d, heads * self.hd, bias=False), nn.Linear(d, kv_heads * self.hd, bias=False)
            self.v = nn.Linear(d, kv_heads * self.hd, bias=False)
            self.gate, self.up = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.o = nn.Linear(heads * self.hd, d, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x, cos, sin, bank=None):
        """x [B, L, d]; cos, sin broadcast against [B, heads, L, hd / 2]. Without `bank`: causal attention
        over the L tokens. With `bank` = (mask, kbank, vbank, at) and L = 1: row b's token is written at
        position at[b] of the banks [B, kv_heads, max_len, hd], and attends to the bank under `mask`."""
        B, L, _ = x.shape
        h = self.n1(x)
        if self.fused:
            q, k, v = self.qkv(h).split([self.h * self.hd, self.kvh * self.hd, self.kvh * self.hd], -1)
        else:
            q, k, v = self.q(h), self.k(h), self.v(h)
        q = q.view(B, L, self.h, self.hd).transpose(1, 2)
        k = k.view(B, L, self.kvh, self.hd).transpose(1, 2)
        v = v.view(B, L, self.kvh, self.hd).transpose(1, 2)
        if not self.rope_fp32:
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = rotate(q, cos, sin, self.rope_fp32), rotate(k, cos, sin, self.rope_fp32)
        if self.repeat_kv and self.kvh != self.h:
            k = k.repeat_interleave(self.h // self.kvh, dim=1)
            v = v.repeat_interleave(self.h // self.kvh, dim=1)
        gqa = self.kvh != self.h and not self.repeat_kv
        if bank is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            mask, kbank, vbank, at = bank
            rows = torch.arange(B, device=x.device)
            kbank[rows, :, at] = k[:, :, 0]
            vbank[rows, :, at] = v[:, :, 0]
            y = F.scaled_dot_product_attention(q, kbank, vbank, attn_mask=mask, enable_gqa=gqa)
        x = x + self.o(y.transpose(1, 2).reshape(B, L, -1))
        h = self.n2(x)
        if self.fused:
            gate, up = self.gate_up(h).chunk(2, -1)
        else:
            gate, up = self.gate(h), self.up(h)
        return x + self.down(F.silu(gate) * up)


class PlainLooped(nn.Module):
    """embed -> prelude -> (inject; core) x R -> coda -> norm -> head."""

    def __init__(
        self,
        vocab: int,
        d: int,
        heads: int,
        kv_heads: int,
        ffn: int,
        n_prelude: int = 1,
        n_core: int = 2,
        n_coda: int = 1,
        *,
        injection: str = "additive",
        fused: bool = False,
        norm: str = "module",
        rope_fp32: bool = False,
        repeat_kv: bool = False,
        rope_base: float = 1e6,
        max_len: int | None = None,
    ):
        super().__init__()
        if injection not in ("additive", "linear"):
            raise ValueError(f"unknown injection {injection!r}: additive or linear")
        self.d, self.kv_heads, self.hd, self.injection, self.max_len = d, kv_heads, d // heads, injection, max_len
        mk = lambda n: nn.ModuleList(  # noqa: E731
            PlainBlock(d, heads, kv_heads, ffn, fused=fused, norm=norm, rope_fp32=rope_fp32, repeat_kv=repeat_kv)
            for _ in range(n)
        )
        self.emb = nn.Embedding(vocab, d)
        self.prelude, self.core, self.coda = mk(n_prelude), mk(n_core), mk(n_coda)
        if injection == "linear":
            self.inject = nn.Linear(d, d, bias=False)
            self.decay = nn.Parameter(torch.full((d,), 0.5))
        self.norm = make_norm(norm, d)
        self.head = nn.Linear(d, vocab, bias=False)
        inv = 1.0 / (rope_base ** (torch.arange(0, self.hd, 2).double() / self.hd))
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        if max_len is not None:
            angles = torch.arange(max_len, dtype=torch.float32)[:, None] * self.inv_freq
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

    def init_weights(self, std: float = 0.02, embed_std: float | None = None) -> PlainLooped:
        """Every matrix from N(0, std^2); the embedding from N(0, embed_std^2) when given."""
        for name, p in self.named_parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=embed_std if embed_std is not None and name == "emb.weight" else std)
        return self

    # -- training: the whole sequence ------------------------------------------------------------
    def rope(self, L: int, device):
        if self.max_len is not None:
            return self.cos[:L], self.sin[:L]
        ang = torch.arange(L, device=device).float()[:, None] * self.inv_freq
        return ang.cos(), ang.sin()

    def inject_input(self, e):
        return self.inject(e) if self.injection == "linear" else e

    def inject_step(self, s, u):
        return self.decay * s + u if self.injection == "linear" else s + u

    def forward(self, tokens, state0, depth: int):
        """Logits [B, L, vocab] in fp32 of `tokens` [B, L] after `depth` recurrences from `state0` [B, L, d]."""
        cos, sin = self.rope(tokens.shape[1], tokens.device)
        e = self.emb(tokens)
        for blk in self.prelude:
            e = blk(e, cos, sin)
        u, s = self.inject_input(e), state0.type_as(e)
        for _ in range(depth):
            s = self.inject_step(s, u)
            for blk in self.core:
                s = blk(s, cos, sin)
        for blk in self.coda:
            s = blk(s, cos, sin)
        return self.head(self.norm(s)).float()

    # -- decoding: one token per row ---------------------------------------------------------------
    def decoding(self, batch: int, max_len: int) -> PlainLooped:
        """Allocate the K/V banks of `step`: one per physical layer, `batch` rows of `max_len` positions."""
        n = len(self.prelude) + len(self.core) + len(self.coda)
        self.banks = [
            (torch.zeros(batch, self.kv_heads, max_len, self.hd), torch.zeros(batch, self.kv_heads, max_len, self.hd))
            for _ in range(n)
        ]
        self.keys = torch.arange(max_len)
        return self

    def begin(self, tokens, at):
        ang = at[:, None, None, None].float() * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        mask = (self.keys[None, :] <= at[:, None])[:, None, None, :]
        e = self.emb(tokens)[:, None]
        for i, blk in enumerate(self.prelude):
            e = blk(e, cos, sin, (mask, *self.banks[i], at))
        return self.inject_input(e), cos, sin, mask

    def recur(self, s, u, cos, sin, mask, at):
        s = self.inject_step(s, u)
        for j, blk in enumerate(self.core):
            s = blk(s, cos, sin, (mask, *self.banks[len(self.prelude) + j], at))
        return s

    def end(self, s, cos, sin, mask, at):
        first = len(self.prelude) + len(self.core)
        for j, blk in enumerate(self.coda):
            s = blk(s, cos, sin, (mask, *self.banks[first + j], at))
        return self.head(self.norm(s))[:, 0].float()

    def recur_many(self, s, u, cos, sin, mask, at):
        for _ in range(self.unroll):
            s = self.recur(s, u, cos, sin, mask, at)
        return s

    def shallow(self, tokens, at, depth: int):
        """A whole step (prelude, `depth` recurrences, coda) as one function: one graph compiled."""
        cls = type(self)  # the pieces themselves, not their compiled wrappers
        u, cos, sin, mask = cls.begin(self, tokens, at)
        s = torch.zeros_like(u)
        for _ in range(depth):
            s = cls.recur(self, s, u, cos, sin, mask, at)
        return cls.end(self, s, cos, sin, mask, at)

    unroll, whole = 1, 0

    def compiled(self, unroll: int = 1, whole: int = 0) -> PlainLooped:
        """Compile the decode pieces as looplm's `DecodeStep` does on a CPU: the same split (prelude,
        `unroll` recurrences per graph and one for the rest, coda; a step of at most `whole`
        recurrences as one graph), inductor's C++ wrapper. (Not its row kernels: this stack's linears
        and attention stay the BLAS's and SDPA's.)"""
        options = {"cpp_wrapper": True, "size_asserts": False}
        self.unroll, self.whole = unroll, whole
        self.begin, self.recur_many, self.recur, self.end, self.shallow = (
            torch.compile(f, dynamic=False, options=options)
            for f in (self.begin, self.recur_many, self.recur, self.end, self.shallow)
        )
        return self

    @torch.no_grad()
    def step(self, tokens, at, depth: int):
        """fp32 logits [B, vocab] of one token per row (`tokens` [B] at positions `at` [B]) at `depth`:
        one graph up to `whole` recurrences, else depth // unroll calls of the unrolled graph, then one
        recurrence at a time."""
        if depth <= self.whole:
            return self.shallow(tokens, at, depth)
        u, cos, sin, mask = self.begin(tokens, at)
        s = torch.zeros_like(u)
        many, rest = divmod(depth, self.unroll) if self.unroll > 1 else (0, depth)
        for _ in range(many):
            s = self.recur_many(s, u, cos, sin, mask, at)
        for _ in range(rest):
            s = self.recur(s, u, cos, sin, mask, at)
        return self.end(s, cos, sin, mask, at)
