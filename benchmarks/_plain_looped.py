"""A plain looped decoder for benchmarks: the limit looplm's decode step is measured against.

Written from scratch with no looplm code: token embedding, a prelude block, `n_core` core blocks
iterated R times with additive injection of the prelude output, a coda block and a head. Each
block is pre-norm attention (nn.Linear Q/K/V/O, RoPE, `F.scaled_dot_product_attention` over a
preallocated per-layer KV bank under a length mask) and a SwiGLU MLP. One bank per physical layer
(terminal KV sharing), one token per step, static shapes: what a hand-written compiled decoder
of the same shape does per layer visit, without looplm's generality (depth plans, caches, value
embeddings, exits). Weights are random: speed does not depend on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PlainBlock(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.h, self.kvh, self.hd = heads, kv_heads, d // heads
        self.n1, self.n2 = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
        self.q, self.k = nn.Linear(d, d, bias=False), nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v, self.o = nn.Linear(d, kv_heads * self.hd, bias=False), nn.Linear(d, d, bias=False)
        self.w1, self.w3 = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)

    def forward(self, x, cos, sin, mask, kbank, vbank, at):
        B = x.shape[0]
        h = self.n1(x)
        q = self.q(h).view(B, 1, self.h, self.hd).transpose(1, 2)
        k = self.k(h).view(B, 1, self.kvh, self.hd).transpose(1, 2)
        v = self.v(h).view(B, 1, self.kvh, self.hd).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        rows = torch.arange(B, device=x.device)
        kbank[rows, :, at] = k[:, :, 0]
        vbank[rows, :, at] = v[:, :, 0]
        y = F.scaled_dot_product_attention(q, kbank, vbank, attn_mask=mask, enable_gqa=self.h != self.kvh)
        x = x + self.o(y.transpose(1, 2).reshape(B, 1, -1))
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class PlainLooped(nn.Module):
    """Prelude, core x R (additive injection), coda; `step` decodes one token per row."""

    def __init__(self, vocab: int, d: int, heads: int, kv_heads: int, ffn: int, n_core: int, batch: int,
                 max_len: int):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab, bias=False)
        self.prelude, self.coda = PlainBlock(d, heads, kv_heads, ffn), PlainBlock(d, heads, kv_heads, ffn)
        self.core = nn.ModuleList(PlainBlock(d, heads, kv_heads, ffn) for _ in range(n_core))
        self.norm = nn.RMSNorm(d, eps=1e-6)
        hd = d // heads
        self.banks = [(torch.zeros(batch, kv_heads, max_len, hd), torch.zeros(batch, kv_heads, max_len, hd))
                      for _ in range(n_core + 2)]
        self.inv = 1.0 / (1e6 ** (torch.arange(0, hd, 2).float() / hd))
        self.keys = torch.arange(max_len)

    def begin(self, tokens, at):
        ang = at[:, None, None, None].float() * self.inv
        cos, sin = ang.cos(), ang.sin()
        mask = (self.keys[None, :] <= at[:, None])[:, None, None, :]
        e = self.prelude(self.emb(tokens)[:, None], cos, sin, mask, *self.banks[0], at)
        return e, cos, sin, mask

    def recur(self, s, e, cos, sin, mask, at):
        s = s + e
        for j, block in enumerate(self.core):
            s = block(s, cos, sin, mask, *self.banks[1 + j], at)
        return s

    def end(self, s, cos, sin, mask, at):
        return self.head(self.norm(self.coda(s, cos, sin, mask, *self.banks[-1], at)))[:, 0].float()

    def compiled(self) -> PlainLooped:
        """Compile the three pieces as looplm's `DecodeStep` does on a CPU (the same split, inductor's
        C++ wrapper)."""
        options = {"cpp_wrapper": True, "size_asserts": False}
        self.begin, self.recur, self.end = (torch.compile(f, dynamic=False, options=options)
                                            for f in (self.begin, self.recur, self.end))
        return self

    @torch.no_grad()
    def step(self, tokens, at, depth: int):
        e, cos, sin, mask = self.begin(tokens, at)
        s = torch.zeros_like(e)
        for _ in range(depth):
            s = self.recur(s, e, cos, sin, mask, at)
        return self.end(s, cos, sin, mask, at)
