"""The optimizer's parameter groups: what weight decay applies to (design §12); every trainer
(pretraining, RL, distillation) builds its AdamW from them."""

from __future__ import annotations

import torch


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices of the blocks, embedding and head; none on norm gains or on the
    injection's parameters (decay would pull dt/A_log and the identity-initialised W toward 0;
    design §12)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and not name.startswith("injection.") else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
