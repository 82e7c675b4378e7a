"""A learned exit gate and its exit rules (Ouro's early exit; design §14, beyond the paper).

After recurrence r = 1..R the gate reads the state s^r and gives an exit hazard
lambda_r = sigmoid(w . s^r + b). The exit distribution over depths is

    p_r = lambda_r * prod_{i<r} (1 - lambda_i)   for r < R,    p_R = prod_{i<R} (1 - lambda_i),

so it sums to one whatever the gate says. Three rules turn it into logits:

- fixed step: the logits of recurrence k (ignores the gate);
- threshold: the first r whose cumulative probability sum_{i<=r} p_i reaches the threshold q
  (R when none does), per token;
- expected: sum_r p_r * logits^r (the probability-weighted logits Ouro trains on).

The rules are plain tensor arithmetic here; `LoopedLM.forward(..., return_states=True)` gives the
states they read.
"""

from __future__ import annotations

import torch
from torch import nn


class ExitGate(nn.Module):
    """lambda = sigmoid(Linear(d, 1)(s)): the per-token exit hazard of a state."""

    def __init__(self, d_model: int):
        super().__init__()
        self.proj = nn.Linear(d_model, 1, bias=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        """Gate logits [..., L] (before the sigmoid) of states [..., L, d]."""
        return self.proj(s).squeeze(-1).float()


def exit_distribution(gate_logits: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """p [B, L, R] from the gate logits of recurrences 1..R (a list of [B, L], or [B, L, R]).
    The last recurrence takes all the remaining probability."""
    g = torch.stack(list(gate_logits), dim=-1) if isinstance(gate_logits, (list, tuple)) else gate_logits
    lam = torch.sigmoid(g.float())
    R = lam.shape[-1]
    pdf, remaining = [], torch.ones_like(lam[..., 0])
    for r in range(R):
        if r < R - 1:
            pdf.append(lam[..., r] * remaining)
            remaining = remaining * (1.0 - lam[..., r])
        else:
            pdf.append(remaining)
    return torch.stack(pdf, dim=-1)


def threshold_exit(pdf: torch.Tensor, threshold: float) -> torch.Tensor:
    """0-based exit index [B, L]: the first recurrence whose cumulative exit probability is >=
    `threshold`, else the last one."""
    reached = pdf.cumsum(-1) >= threshold
    first = reached.float().argmax(-1)
    return torch.where(reached.any(-1), first, torch.full_like(first, pdf.shape[-1] - 1))


def select_depth(per_depth: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """per_depth [B, L, R, ...] at the per-token index [B, L] -> [B, L, ...]."""
    idx = index.reshape(*index.shape, 1, *([1] * (per_depth.ndim - 3)))
    idx = idx.expand(*index.shape, 1, *per_depth.shape[3:])
    return per_depth.gather(2, idx).squeeze(2)


def expected_logits(logits: list[torch.Tensor], pdf: torch.Tensor) -> torch.Tensor:
    """sum_r p_r * logits^r for per-recurrence logits (a list of R tensors [B, L, V])."""
    out = None
    for r, lg in enumerate(logits):
        term = lg * pdf[..., r, None].to(lg.dtype)
        out = term if out is None else out + term
    return out
