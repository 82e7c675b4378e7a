"""The output head and next-token cross-entropy in row chunks, without fp32 logits for the whole batch.

`head(h)` followed by `F.cross_entropy(logits.float(), ...)` keeps [N, V] fp32 logits (4.2 GB at
8 x 2048 tokens and V = 64256) plus their gradient. `linear_cross_entropy` computes the same sum
chunk by chunk: each chunk's logits (the head's matmul in the autocast dtype, as `nn.Linear` would,
then fp32), their log-sum-exp and, when a gradient is wanted, the chunk's gradients with respect
to the head input and the head weight, which the backward only scales. At most one chunk of
logits lives at a time; nothing of the head is recomputed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _matmul_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear(h, weight)` computes in here: the autocast dtype when autocast is on."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(h.dtype, weight.dtype)


def chunk_ce(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, grad_dtype: torch.dtype | None):
    """(sum of CE over the supervised rows, d(sum)/d logits in `grad_dtype` or None) of one chunk's
    logits [c, V] in fp32: softmax - onehot(target), zero on ignored rows."""
    lf = logits.float()
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    lse = torch.logsumexp(lf, -1)
    picked = lf.gather(1, safe[:, None])[:, 0]
    total = torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
    if grad_dtype is None:
        return total, None
    onehot = torch.arange(lf.shape[1], device=lf.device) == safe[:, None]
    g = (torch.exp(lf - lse[:, None]) - onehot.float()) * valid[:, None]
    return total, g.to(grad_dtype)


_compiled_chunk_ce = None


def _chunk_ce_for(device: torch.device):
    """On CUDA the chunk's elementwise work compiled into a few fused kernels (eager it makes about six
    fp32 passes over [c, V]); elsewhere eager."""
    global _compiled_chunk_ce
    if device.type != "cuda":
        return chunk_ce
    if _compiled_chunk_ce is None:
        _compiled_chunk_ce = torch.compile(chunk_ce, dynamic=False, fullgraph=True)
    return _compiled_chunk_ce


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index: int, chunk_rows: int, want_grad: bool):
        dtype = _matmul_dtype(h, weight)
        ce = _chunk_ce_for(h.device)
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(dtype)
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h = torch.empty_like(h) if want_grad and ctx.needs_input_grad[0] else None
            grad_w = (
                torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
                if want_grad and ctx.needs_input_grad[1]
                else None
            )
            for start in range(0, h.shape[0], chunk_rows):
                hc = h[start : start + chunk_rows].to(dtype)
                # [chunk, V] logits of the head's matmul in its dtype, as head(h) gives them
                loss, g = ce(
                    hc @ w.t(),
                    targets[start : start + chunk_rows],
                    ignore_index,
                    dtype if grad_h is not None or grad_w is not None else None,
                )
                total += loss
                if grad_h is not None:
                    grad_h[start : start + chunk_rows] = (g @ w).to(h.dtype)
                if grad_w is not None:
                    grad_w += (g.t() @ hc).float()
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None))
        ctx.has, ctx.weight_dtype = (grad_h is not None, grad_w is not None), weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        saved = iter(ctx.saved_tensors)
        grad_h = grad_w = None
        if ctx.has[0]:
            grad_h = next(saved)
            grad_h = grad_h * grad_out.to(grad_h.dtype)
        if ctx.has[1]:
            grad_w = (next(saved) * grad_out.float()).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100, chunk_rows: int = 4096
) -> torch.Tensor:
    """sum over targets != ignore_index of CE(h @ weight^T, target), fp32 scalar, in chunks of
    `chunk_rows` rows of h [..., d] (targets [...]). Equals
    `F.cross_entropy(F.linear(h, weight).float(), targets, reduction="sum")` with its gradients."""
    h2, t2 = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    want_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    if not want_grad and h2.shape[0] <= chunk_rows:  # one chunk, no gradient: the plain path is the same
        return F.cross_entropy(F.linear(h2, weight).float(), t2, ignore_index=ignore_index, reduction="sum")
    return _LinearCrossEntropy.apply(h2, weight, t2, ignore_index, chunk_rows, want_grad)
