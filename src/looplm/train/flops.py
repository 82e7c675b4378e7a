"""Training FLOPs per token from the drawn depths (design §5)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from looplm.config import ModelConfig


def _units(cfg: ModelConfig, seq_len: int, keys_per_query: float | None = None) -> tuple[float, float, float]:
    """(static_u, layer_u, inj_u): multiply-accumulate units per token (design §5): static_u runs once per
    forward, layer_u per layer visit, inj_u per recurrence."""
    d, V, F = cfg.d_model, cfg.vocab_size, cfg.ffn_dim
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    norm_u = 4 * d
    ffn_mats = 2 if cfg.ffn_act == "relu2" else 3  # relu2: w1, w2; swiglu: w1, w3, w2
    kpq = seq_len / 2 if keys_per_query is None else keys_per_query
    # QK^T and AV: 2 H hd per key a query attends to (causal full rows: L/2 on average)
    layer_u = norm_u + 2 * d * hd * (H + Hkv) + 2 * H * hd * kpq + ffn_mats * d * F
    # The injection's maps of the prelude output e run once per forward (LoopedLM.context); per recurrence
    # only the state's part runs (design §5).
    once_u = 0.0
    if cfg.injection in ("parcae-decay", "parcae-nonorm"):
        inj_u, once_u = 6 * d, d * d  # decay * s + q; q = dt * W e
    elif cfg.injection == "ortho":
        inj_u, once_u = 6 * d + 3 * d + 1, d * d  # ... plus the projection off u
    elif cfg.injection == "huginn-linear":
        inj_u, once_u = d * d, d * d  # A_state s per recurrence; A_input e once
    elif cfg.injection == "deq-qkv":
        inj_u, once_u = 0.0, cfg.n_core * d * hd * (H + 2 * Hkv)  # Q/K/V projections of e per core layer
    elif cfg.injection == "additive":
        inj_u = d
    else:  # "none": s' = s
        inj_u = 0.0
    static_u = (d + V + d * V) + norm_u + (cfg.n_prelude + cfg.n_coda) * layer_u + once_u
    if cfg.coda_proj:
        static_u += d * d
    return static_u, layer_u, inj_u


def flops_per_token(
    cfg: ModelConfig, seq_len: int, depth: int, bptt_window: int | None, keys_per_query: float | None = None
) -> float:
    """FLOPs/token = 6 train_u + 2 fwd_u for one forward+backward at `depth` (design §5).

    `bptt_window` is the resolved window (`DepthConfig.effective_bptt_window()`; None = full BPTT).
    `keys_per_query`: the mean number of keys a query attends to; default seq_len / 2 (full causal
    rows, the paper's convention also for packed rows); `keys_per_query(doc_ids)` gives the pairs a
    document mask actually leaves."""
    if isinstance(bptt_window, str):
        raise TypeError(f"bptt_window {bptt_window!r} is unresolved; pass DepthConfig.effective_bptt_window()")
    static_u, layer_u, inj_u = _units(cfg, seq_len, keys_per_query)
    g = depth if bptt_window is None else min(depth, bptt_window)
    f = depth - g
    rec_u = cfg.n_core * layer_u + inj_u
    return 6 * (static_u + g * rec_u) + 2 * f * rec_u


def keys_per_query(doc_ids) -> float:
    """Mean over the queries of rows [B, L] of the keys the causal document mask lets each attend to
    (itself included): a query attends to the earlier tokens with its document id, so a row whose id
    k occurs c_k times runs sum_k c_k (c_k + 1) / 2 (query, key) pairs."""
    ids = np.asarray(doc_ids.cpu() if hasattr(doc_ids, "cpu") else doc_ids)
    pairs = 0
    for row in ids.reshape(-1, ids.shape[-1]):
        counts = np.unique(row, return_counts=True)[1].astype(np.int64)
        pairs += int((counts * (counts + 1) // 2).sum())
    return pairs / ids.size


def expected_flops_per_token(cfg: ModelConfig, seq_len: int, pmf: np.ndarray, bptt_window: int | None) -> float:
    """Expectation of `flops_per_token` over a depth pmf (index r-1)."""
    return float(sum(p * flops_per_token(cfg, seq_len, r + 1, bptt_window) for r, p in enumerate(pmf) if p > 0))


def mean_flops_per_token(cfg: ModelConfig, seq_len: int, depths: Iterable[int], bptt_window: int | None) -> float:
    depths = list(depths)
    return sum(flops_per_token(cfg, seq_len, r, bptt_window) for r in depths) / max(1, len(depths))
