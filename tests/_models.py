"""A tiny model whose next token depends on context and depth, for exactness tests of the caches,
the serving engine, the HTTP API and the Transformers adapter.

A randomly initialised tiny model (block weights std 0.02) barely looks at its context: its largest
logit is about 0.5 and no argmax moves when the core KV banks are replaced by noise, so a test that
compares greedy text or token ids only sees gross errors. `decisive_model` draws the block weights
with std 0.1 and the head with std 0.6: the context changes most argmaxes, the depth many, logits
spread over about +-15, and the recurrence stays contractive (the distance between two runs from
different initial states shrinks at every recurrence), so the rounding of a batched run against a
single-row one does not grow with depth. `tests/test_decisive_model.py` checks these properties.
"""

from __future__ import annotations

import torch
from torch import nn

from looplm.config import ModelConfig
from looplm.model import LoopedLM

BLOCK_STD = 0.1
HEAD_STD = 0.6


def decisive_model(vocab_size: int = 258, *, seed: int = 0, **fields) -> LoopedLM:
    """A tiny LoopedLM (d 32, 4/2 heads, 1/2/1 blocks, 64 positions, depths to 16 unless `fields`
    say otherwise) in eval mode, with the larger weights described above (default vocabulary: the
    byte tokenizer's 258)."""
    cfg = dict(vocab_size=vocab_size, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64, max_depth=16)
    torch.manual_seed(seed)
    model = LoopedLM(ModelConfig(**{**cfg, **fields}))
    with torch.no_grad():
        for block in (*model.prelude, *model.core, *model.coda):
            block.reset_parameters(std=BLOCK_STD)
        if not model.cfg.tie_embeddings:
            nn.init.trunc_normal_(model.head.weight, std=HEAD_STD, a=-3 * HEAD_STD, b=3 * HEAD_STD)
    return model.eval()
