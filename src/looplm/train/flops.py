"""Training FLOPs per token from the drawn depths (design §5)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from looplm.config import ModelConfig


def _units(cfg: ModelConfig, seq_len: int) -> tuple[float, float, float]:
    """(static_u, layer_u, inj_u): multiply-accumulate units per token (design §5)."""
    d, V, F = cfg.d_model, cfg.vocab_size, cfg.ffn_dim
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    norm_u = 4 * d
    ffn_mats = 2 if cfg.ffn_act == "relu2" else 3  # relu2: w1, w2; swiglu: w1, w3, w2
    layer_u = norm_u + 2 * d * hd * (H + Hkv) + H * hd * seq_len + ffn_mats * d * F
    if cfg.injection in ("parcae-decay", "parcae-nonorm"):
        inj_u = d * d + 6 * d
    elif cfg.injection == "ortho":
        inj_u = d * d + 6 * d + 3 * d + 1
    elif cfg.injection == "huginn-linear":
        inj_u = 2 * d * d
    elif cfg.injection == "deq-qkv":
        inj_u = 0.0  # its Q/K/V projections of e are computed once per forward (counted below)
    else:
        inj_u = d
    static_u = (d + V + d * V) + norm_u + (cfg.n_prelude + cfg.n_coda) * layer_u
    if cfg.coda_proj:
        static_u += d * d
    if cfg.injection == "deq-qkv":
        static_u += cfg.n_core * d * hd * (H + 2 * Hkv)
    return static_u, layer_u, inj_u


def flops_per_token(cfg: ModelConfig, seq_len: int, depth: int, bptt_window: int | None) -> float:
    """FLOPs/token = 6 train_u + 2 fwd_u for one forward+backward at `depth` (design §5).

    `bptt_window` is the resolved window (`DepthConfig.effective_bptt_window()`; None = full BPTT)."""
    if isinstance(bptt_window, str):
        raise TypeError(f"bptt_window {bptt_window!r} is unresolved; pass DepthConfig.effective_bptt_window()")
    static_u, layer_u, inj_u = _units(cfg, seq_len)
    g = depth if bptt_window is None else min(depth, bptt_window)
    f = depth - g
    rec_u = cfg.n_core * layer_u + inj_u
    return 6 * (static_u + g * rec_u) + 2 * f * rec_u


def expected_flops_per_token(cfg: ModelConfig, seq_len: int, pmf: np.ndarray, bptt_window: int | None) -> float:
    """Expectation of `flops_per_token` over a depth pmf (index r-1)."""
    return float(sum(p * flops_per_token(cfg, seq_len, r + 1, bptt_window) for r, p in enumerate(pmf) if p > 0))


def mean_flops_per_token(cfg: ModelConfig, seq_len: int, depths: Iterable[int], bptt_window: int | None) -> float:
    depths = list(depths)
    return sum(flops_per_token(cfg, seq_len, r, bptt_window) for r in depths) / max(1, len(depths))
