"""How the compiled decode step computes a layer at one row on a CPU (design §16).

At batch 1 a recurrence of the tiny preset is 14 matrix-vector products and 2 attention calls of a
few microseconds of arithmetic each, and inside an inductor graph each of them is a call out of the
generated code (the BLAS's `mm`, the CPU SDPA kernel) that costs more than its arithmetic. Under
`RowKernels` (a torch function mode the step's compiled pieces run in, traced by Dynamo like any
other code) two calls are written out where that pays:

- `F.linear` of one row (x with a single row of features, fp32): y = sum(x[..., None, :] * W, -1),
  a broadcast product and a sum, which inductor generates as one loop of its own, fused with what
  follows;
- `F.scaled_dot_product_attention` of one query per row under a boolean mask [B or 1, 1, 1, S]:
  softmax(q K^T / sqrt(hd) + mask) V written out, grouped-query heads as a reshape (query head h
  reads key/value head h // (H / H_kv), as SDPA's `enable_gqa`).

Everything else, and every call of another shape, goes to torch unchanged; results equal the
eager step's to float rounding (tested). Measured on the 2-core CPU (BENCHMARKS.md): a batch-1 R = 32
step 1.4x faster from the products and 1.1x from the attention; at 16 rows the products lose to the
BLAS, so a linear of more than one row keeps `mm`. Eagerly the products would allocate [rows, out, in]:
the mode is for compiled pieces only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["RowKernels", "one_query_attention", "row_linear"]


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) as a broadcast product and a sum over the input features."""
    y = (x[..., None, :] * weight).sum(-1)
    return y if bias is None else y + bias


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale=None):
    """SDPA of one query per row: q [B, H, 1, hd], k/v [B, H_kv, S, hd] (H a multiple of H_kv), boolean
    mask [B or 1, 1, 1, S] (True = attend) -> [B, H, 1, hd]."""
    B, H, _, hd = q.shape
    Hk, S = k.shape[1], k.shape[2]
    scale = hd**-0.5 if scale is None else scale
    qg = q.reshape(B, Hk, H // Hk, hd)  # query head h = kv head * group + g
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, Hk, G, S]
    scores = scores.masked_fill(~mask.reshape(mask.shape[0], 1, 1, S), float("-inf"))
    return torch.matmul(scores.softmax(-1), v).reshape(B, H, 1, hd)


def _one_row(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.numel() == x.shape[-1]


def _written_out_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """`one_query_attention` for a call it covers, else None (SDPA runs)."""
    one_query = (
        q.ndim == 4
        and q.shape[2] == 1
        and isinstance(attn_mask, torch.Tensor)
        and attn_mask.dtype == torch.bool
        and attn_mask.ndim == 4
        and attn_mask.shape[1] == attn_mask.shape[2] == 1
        and dropout_p == 0.0
        and not is_causal
        and (enable_gqa or q.shape[1] == k.shape[1])
    )
    return one_query_attention(q, k, v, attn_mask, scale) if one_query else None


class RowKernels(TorchFunctionMode):
    """Inside it, one-row linears and one-query attention are written out (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and _one_row(args[0]):
            return row_linear(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            out = _written_out_attention(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)
