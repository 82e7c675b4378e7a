"""Training FLOPs (design §5) against hand-computed numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from looplm.config import ModelConfig
from looplm.depth import FixedDepth, PLNDepth, UniformDepth
from looplm.train.flops import expected_flops_per_token, flops_per_token, mean_flops_per_token

# d = 32, V = 50, H = 4, H_kv = 2, head_dim = 8, F = 64, 1 / 2 / 1 blocks.
CFG = ModelConfig(
    vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32, injection="parcae-nonorm"
)
L = 16

# Worked by hand from design §5 for CFG at L = 16:
#   norm_u   = 4d = 128
#   layer_u  = 128 + 2*32*8*(4+2) + 2*4*8*(16/2) + 3*32*64 = 128 + 3072 + 512 + 6144 = 9856
#   The injection's map of e runs once per forward (d^2 = 1024 MACs, in the static part); per recurrence:
#   inj_u    = 6d = 192                               (diagonal: decay * s + q)
#            = 192 + 3*32 + 1 = 289                   (ortho: plus the projection off u)
#            = d^2 = 1024                             (huginn-linear: A_state s; A_input e once)
#   static_u = (32 + 50 + 32*50) + 128 + (1+1)*9856 + 1024 = 1682 + 128 + 19712 + 1024 = 22546
#   rec_u    = 2*9856 + inj_u = 19904 (diagonal), 20001 (ortho), 20736 (linear)
# R = 5, b = 2: g = 2, f = 3
#   train_u = 22546 + 2*19904 = 62354;  fwd_u = 3*19904 = 59712
#   FLOPs   = 6*62354 + 2*59712 = 374124 + 119424 = 493548
#   (charging W e at every recurrence, as the paper's formula does, would add 6*1*1024 + 2*3*1024 = 12288)
HAND = {
    ("parcae-nonorm", 5, 2): 493548,
    # R = 5, b = None (g = 5): 6*(22546 + 5*19904) = 6*122066 = 732396
    ("parcae-nonorm", 5, None): 732396,
    # R = 1, b = 10: 6*(22546 + 19904) = 254700
    ("parcae-decay", 1, 10): 254700,
    # ortho, R = 4, b = 1: 6*(22546 + 20001) + 2*3*20001 = 255282 + 120006 = 375288
    ("ortho", 4, 1): 375288,
    # huginn-linear, R = 3, b = 3: 6*(22546 + 3*20736) = 6*84754 = 508524
    ("huginn-linear", 3, 3): 508524,
}


@pytest.mark.parametrize("key", list(HAND))
def test_flops_per_token_hand_computed(key):
    injection, depth, window = key
    cfg = ModelConfig(**{**CFG.to_dict(), "injection": injection})
    assert flops_per_token(cfg, L, depth, window) == pytest.approx(HAND[key], rel=1e-12)


def spec5_flops(d, V, H, H_kv, hd, F, n_prelude, n_core, n_coda, L, R, b, inj_u, static_extra=0):
    """design §5 (paper App. B.3) written out: per-token multiply-accumulate units, FLOPs = 6 train + 2 fwd."""
    norm_u = 4 * d
    layer_u = norm_u + 2 * d * hd * (H + H_kv) + H * hd * L + 3 * d * F
    static_u = (d + V + d * V) + norm_u + (n_prelude + n_coda) * layer_u + static_extra
    g = R if b is None else min(R, b)
    f = R - g
    rec_u = n_core * layer_u + inj_u
    return 6 * (static_u + g * rec_u) + 2 * f * rec_u


# DEQ-QKV (design §2, paper App. B.4) has no entrance injection (inj_u = 0); its bias-free projections of e
# into Q (H*hd), K and V (H_kv*hd each) in every core layer are computed once per forward, since e does
# not change across recurrences: static += n_core * d * hd * (H + 2 H_kv). (Adding the offsets to Q/K/V
# is elementwise, like the residual additions layer_u leaves out.) Additive s' = s + e: inj_u = d.
# By hand for CFG at L = 16 (layer_u = 9856, static_u = 21522 as above):
#   deq-qkv:  static_u = 21522 + 2*32*8*(4 + 2*2) = 21522 + 4096 = 25618;  rec_u = 2*9856 = 19712
#     R = 4, b = 1:    6*(25618 + 19712) + 2*3*19712 = 271980 + 118272 = 390252
#     R = 3, b = None: 6*(25618 + 3*19712) = 6*84754 = 508524
#   additive: rec_u = 19712 + 32 = 19744
#     R = 5, b = 2:    6*(21522 + 2*19744) + 2*3*19744 = 366060 + 118464 = 484524
#     R = 2, b = None: 6*(21522 + 2*19744) = 366060
INJECTION_HAND = {
    ("deq-qkv", 4, 1): 390252,
    ("deq-qkv", 3, None): 508524,
    ("additive", 5, 2): 484524,
    ("additive", 2, None): 366060,
}


@pytest.mark.parametrize("key", list(INJECTION_HAND))
def test_flops_deq_qkv_and_additive_hand_computed(key):
    injection, depth, window = key
    cfg = ModelConfig(**{**CFG.to_dict(), "injection": injection})
    assert flops_per_token(cfg, L, depth, window) == pytest.approx(INJECTION_HAND[key], rel=1e-12)


@pytest.mark.parametrize("injection", ["deq-qkv", "additive"])
@pytest.mark.parametrize("depth,window", [(1, None), (1, 10), (5, 2), (7, None), (12, 10), (64, 10)])
def test_flops_deq_qkv_and_additive_follow_spec5(injection, depth, window):
    cfg = ModelConfig(**{**CFG.to_dict(), "injection": injection, "max_seq_len": 64})
    d, H, H_kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    if injection == "deq-qkv":
        inj_u, extra = 0, cfg.n_core * d * hd * (H + 2 * H_kv)
    else:
        inj_u, extra = d, 0
    want = spec5_flops(
        d,
        cfg.vocab_size,
        H,
        H_kv,
        hd,
        cfg.ffn_dim,
        cfg.n_prelude,
        cfg.n_core,
        cfg.n_coda,
        48,
        depth,
        window,
        inj_u,
        extra,
    )
    assert flops_per_token(cfg, 48, depth, window) == pytest.approx(want, rel=1e-12)


def test_deq_qkv_projections_are_counted_once_per_forward():
    from looplm.model import LoopedLM

    deq = ModelConfig(**{**CFG.to_dict(), "injection": "deq-qkv"})
    # the projection MACs per token equal the projections' weight count in the model
    n_proj = sum(p.numel() for p in LoopedLM(deq).injection.parameters())
    assert n_proj == 2 * 32 * 8 * (4 + 2 * 2) == 4096
    # ...counted once (6x, with gradient) whatever R: a recurrence costs only the core layers
    layer_u = 9856
    assert flops_per_token(deq, L, 6, None) - flops_per_token(deq, L, 5, None) == pytest.approx(6 * 2 * layer_u)
    assert flops_per_token(deq, L, 6, 2) - flops_per_token(deq, L, 5, 2) == pytest.approx(2 * 2 * layer_u)
    add = ModelConfig(**{**CFG.to_dict(), "injection": "additive"})
    assert flops_per_token(deq, L, 1, None) - flops_per_token(add, L, 1, None) == pytest.approx(6 * (4096 - 32))
    assert sum(p.numel() for p in LoopedLM(add).injection.parameters()) == 0  # s + e: d additions only


def test_injection_of_e_is_charged_once_per_forward():
    # one more recurrence costs the core layers and the injection's state part only: 6 (2*9856 + 192)
    assert flops_per_token(CFG, L, 6, None) - flops_per_token(CFG, L, 5, None) == pytest.approx(6 * (2 * 9856 + 192))
    # the injection matrix of e is one d x d map (the MACs per token of W e), counted once whatever R
    from looplm.model import LoopedLM

    assert LoopedLM(CFG).injection.W.weight.numel() == 32 * 32


# Attention pairs a document mask leaves, by hand. Rows of L = 8:
#   [0 0 0 1 1 1 1 1]: document 0 runs 3*4/2 = 6 pairs, document 1 5*6/2 = 15   -> 21
#   [0 0 0 0 0 0 0 0]: one document, 8*9/2 = 36 (causal, the diagonal included)  -> 36
#   [0 1 2 3 4 5 6 7]: every token alone, 8 pairs                                 ->  8
# 65 pairs over 24 queries: 65/24 keys per query.
DOCS = [[0, 0, 0, 1, 1, 1, 1, 1], [0] * 8, list(range(8))]


def test_keys_per_query_counts_the_pairs_a_document_mask_runs():
    from looplm.model.blocks import causal_document_mask
    from looplm.train.flops import keys_per_query

    doc = torch.tensor(DOCS)
    assert keys_per_query(doc) == pytest.approx(65 / 24, rel=1e-15)
    assert int(causal_document_mask(doc).sum()) == 65  # the mask the model applies has those pairs
    assert keys_per_query(torch.zeros(2, 16, dtype=torch.long)) == pytest.approx(17 / 2)  # (L + 1) / 2


def test_flops_with_the_pairs_a_mask_runs():
    # layer_u with k keys per query: 128 + 3072 + 2*4*8*k + 6144; at k = 65/24 the attention term is
    # 64*65/24 = 173.333...; static_u = 1682 + 128 + 2*layer_u + 1024, rec_u = 2*layer_u + 192
    k = 65 / 24
    layer_u = 128 + 3072 + 64 * k + 6144
    static_u, rec_u = 1682 + 128 + 2 * layer_u + 1024, 2 * layer_u + 192
    want = 6 * (static_u + 2 * rec_u) + 2 * 3 * rec_u  # R = 5, b = 2
    assert flops_per_token(CFG, 8, 5, 2, keys_per_query=k) == pytest.approx(want, rel=1e-12)
    # the default is the full causal row of the paper's convention: L/2 keys per query
    assert flops_per_token(CFG, L, 5, 2, keys_per_query=L / 2) == flops_per_token(CFG, L, 5, 2)


def test_flops_reject_an_unresolved_window():
    with pytest.raises(TypeError, match="effective_bptt_window"):
        flops_per_token(CFG, L, 5, "auto")  # type: ignore[arg-type]


def test_flops_window_semantics():
    # a window >= R is full BPTT; each extra no-grad recurrence costs 2 rec_u, each grad one 6 rec_u
    rec_u = 19904
    assert flops_per_token(CFG, L, 5, 5) == flops_per_token(CFG, L, 5, 50) == flops_per_token(CFG, L, 5, None)
    assert flops_per_token(CFG, L, 6, 2) - flops_per_token(CFG, L, 5, 2) == pytest.approx(2 * rec_u)
    assert flops_per_token(CFG, L, 6, None) - flops_per_token(CFG, L, 5, None) == pytest.approx(6 * rec_u)
    # the attention term grows linearly in the sequence length: H*hd per layer per token per position
    per_pos = 4 * 8 * (1 + 1 + 2 * 5)  # (prelude + coda + n_core * R) layers at R = 5
    assert flops_per_token(CFG, L + 1, 5, None) - flops_per_token(CFG, L, 5, None) == pytest.approx(6 * per_pos)


@pytest.mark.parametrize("depth,window", [(1, None), (5, 2), (12, 10)])
def test_expected_flops_of_fixed_pmf_equals_pointwise(depth, window):
    pmf = FixedDepth(depth).pmf()
    assert expected_flops_per_token(CFG, L, pmf, window) == pytest.approx(
        flops_per_token(CFG, L, depth, window), rel=1e-12
    )


def test_expected_flops_is_pmf_weighted_sum():
    for pmf in (PLNDepth(5.0).pmf(), UniformDepth(2, 6).pmf()):
        naive = 0.0
        for r in range(1, 65):
            naive += pmf[r - 1] * flops_per_token(CFG, L, r, 10)
        assert expected_flops_per_token(CFG, L, pmf, 10) == pytest.approx(naive, rel=1e-12)
    # uniform 2..6 is the average of the five depths
    avg = np.mean([flops_per_token(CFG, L, r, 3) for r in range(2, 7)])
    assert expected_flops_per_token(CFG, L, UniformDepth(2, 6).pmf(), 3) == pytest.approx(avg, rel=1e-12)
    assert mean_flops_per_token(CFG, L, [2, 3, 4, 5, 6], 3) == pytest.approx(avg, rel=1e-12)


def test_keys_per_query_of_one_row_and_of_no_depths():
    from looplm.train.flops import keys_per_query

    # one row [L] is a batch of one: [0 0 0 1 1 1 1 1] runs 6 + 15 = 21 pairs over 8 queries
    assert keys_per_query(torch.tensor(DOCS[0])) == pytest.approx(21 / 8, rel=1e-15)
    assert keys_per_query(np.array(DOCS)[None]) == pytest.approx(65 / 24, rel=1e-15)  # [1, B, L]
    assert mean_flops_per_token(CFG, L, [], 2) == 0.0  # no draws (yet): no FLOPs, not a division by zero
