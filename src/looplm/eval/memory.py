"""Peak memory of the depth report (`looplm.eval.report.depth_report`), estimated from the shapes.

The report runs an fp32 model without autograd. Its two large protocols:

- native perplexity (`native_perplexity`): a batch of B rows x L tokens at the deepest R. Alive at
  the peak: the boolean document mask [B, 1, L, L], `STATE_BUFFERS` [B, L, d] states (the working
  state, the previous one and the two kept for the state change, the prelude output, the
  injection's prepared input and its concatenation [s; e], the block's residual stream and norm;
  before the first recurrence the seeded initial state's int64/float64 hashes instead), the widest
  block's insides (SwiGLU's gate, up, silu(gate) and product [B, L, ffn]; or Q, K and V), and one
  chunk of the cross-entropy (chunk logits [c, V] and a same-sized temporary of the log-sum-exp).
- the sharing table (`sharing_table`): one row at a time; the full cache holds K and V of every
  layer visit (prelude, core x R, coda) for T tokens (P + C - 1 with a CacheEval span, else the row),
  and the scored chunk's logits [n, V] (fp32, their concatenation and CE's log-softmax).

Attention is assumed not to materialise [B, H, L, L] scores (SDPA's memory-efficient kernel on
CUDA). `tests/test_eval_memory.py` checks the estimate against the bytes measured at a tiny shape.
"""

from __future__ import annotations

import torch

from looplm.config import ModelConfig
from looplm.eval.perplexity import EVAL_CE_CHUNK_ROWS

FP32 = 4
STATE_BUFFERS = 10  # [B, L, d] states alive at once in a no-grad forward (see the module docstring)


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of `LoopedLM(cfg)`, counted on the meta device (nothing allocated)."""
    from looplm.model import LoopedLM

    with torch.device("meta"):
        return sum(p.numel() for p in LoopedLM(cfg).parameters())


def perplexity_bytes(cfg: ModelConfig, seq_len: int, batch: int, ce_chunk_rows: int = EVAL_CE_CHUNK_ROWS) -> int:
    """Activation bytes (weights apart) of one `native_perplexity` batch of `batch` x `seq_len` tokens."""
    tokens = batch * seq_len
    state = tokens * cfg.d_model * FP32
    mask = batch * seq_len * seq_len  # bool
    ffn = 4 * tokens * cfg.ffn_dim * FP32
    attention = tokens * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim * FP32
    ce = 2 * min(ce_chunk_rows, tokens) * cfg.vocab_size * FP32 + 2 * state  # + the coda output and its norm
    return mask + STATE_BUFFERS * state + max(ffn + state, attention + state, ce)


def sharing_bytes(cfg: ModelConfig, seq_len: int, depth: int, span: tuple[int, int] | None) -> int:
    """Activation bytes of one row of the full-cache sharing protocol at `depth`: the cache, the larger
    of the prompt's forward and the scored chunk's, and the logits (the prompt's [P, V] and the head's
    packed weight while it is prefilled, then the scored ones three times: kept, concatenated, in the
    cross-entropy)."""
    if span is not None:
        prompt, scored = span
        length = prompt + scored - 1
    else:
        prompt, scored, length = seq_len // 2, seq_len - seq_len // 2, seq_len
    visits = cfg.n_prelude + cfg.n_core * depth + cfg.n_coda
    cache = visits * 2 * length * cfg.n_kv_heads * cfg.head_dim * FP32
    head = cfg.vocab_size * cfg.d_model * FP32  # the CPU BLAS packs the head's weight for a many-row product
    logits = max(prompt * cfg.vocab_size * FP32 + head, 3 * scored * cfg.vocab_size * FP32)
    return cache + logits + perplexity_bytes(cfg, max(prompt, scored), 1, ce_chunk_rows=0)  # + the forward


def eval_peak_bytes(cfg: ModelConfig, seq_len: int, eval_cfg) -> dict[str, int]:
    """{"weights", "perplexity", "sharing", "peak"} in bytes for the report of `eval_cfg`
    (`looplm.eval.report.EvalConfig`) on a model `cfg` with rows of `seq_len` tokens."""
    weights = parameter_count(cfg) * FP32
    deepest = max(eval_cfg.depths, default=1)
    batch = min(eval_cfg.batch_size, eval_cfg.max_sequences)
    ppl = perplexity_bytes(cfg, seq_len, batch)
    sharing = sharing_bytes(cfg, seq_len, deepest, eval_cfg.cacheeval_span) if eval_cfg.sharing_sequences else 0
    return {"weights": weights, "perplexity": ppl, "sharing": sharing, "peak": weights + max(ppl, sharing)}
