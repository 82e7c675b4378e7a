"""The distilled-prefill student S_psi: predicts the teacher's depth-R endpoint from the prelude output (design §9).

    z_hat = Blocks(in_proj(e~))      a bias-free d x d in_proj, then copies of the core blocks, no final norm

Model code only: it knows nothing of training. `from_teacher(..., init="teacher")` sets
in_proj = diag(dt) W_inj (the injection applied to a zero state) and copies the core blocks, so
before any training the student outputs the teacher's one-recurrence state from a zero state;
`init="random"` is the paper's ablation.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from looplm.config import ModelConfig
from looplm.errors import UserError
from looplm.model.blocks import Block, RMSNorm
from looplm.model.injection import Additive, ParcaeDiagonal
from looplm.model.looped import value_kw

StudentInit = Literal["teacher", "random"]


class EndpointStudent(nn.Module):
    """z_hat = blocks(in_proj(e~)) with e~ = e, or RMSNorm(e) when the teacher's injection normalises
    its input (Parcae-Decay's prelude norm), so that teacher init is exact for that scheme too."""

    def __init__(self, cfg: ModelConfig, n_blocks: int = 2, input_norm: bool = False):
        super().__init__()
        cfg.validate()
        if n_blocks < 1:
            raise UserError(f"the student needs at least one block, got {n_blocks}")
        self.cfg, self.n_blocks = cfg, n_blocks
        self.input_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if input_norm else None
        self.in_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        # block i is shaped like core block i mod n_core (with its value-embedding gate, if any)
        self.blocks = nn.ModuleList(Block(cfg, cfg.has_value_embed(i % cfg.n_core)) for i in range(n_blocks))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Random init (the ablation): in_proj and block matrices truncated normal std 0.02 (design §1)."""
        nn.init.trunc_normal_(self.in_proj.weight, std=0.02, a=-0.06, b=0.06)
        for block in self.blocks:
            block.reset_parameters()
        if self.input_norm is not None:
            nn.init.ones_(self.input_norm.weight)

    def forward(self, e: torch.Tensor, rope, mask, values: list | None = None) -> torch.Tensor:
        """Predicted endpoint [B, L, d] from the prelude output e [B, L, d] (same rope and mask as the teacher).

        `values`: the teacher's per-core-layer value embeddings (`Context.core_values`); block i reads
        entry i mod n_core. Required for a teacher with value embeddings (cfg.value_embeds)."""
        if self.cfg.value_embeds != "none" and values is None:
            raise UserError(
                "this student's teacher has value embeddings: pass values=the teacher's Context.core_values"
            )
        x = self.in_proj(self.input_norm(e) if self.input_norm is not None else e)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, mask, **(value_kw(values, i % len(values)) if values else {}))
        return x

    def arch(self) -> dict:
        """What rebuilds this module: the teacher's shape, the block count and the input norm."""
        return {"model": self.cfg.to_dict(), "n_blocks": self.n_blocks, "input_norm": self.input_norm is not None}

    @classmethod
    def from_arch(cls, arch: dict) -> "EndpointStudent":
        return cls(ModelConfig.from_dict(arch["model"]), arch["n_blocks"], arch["input_norm"])

    @classmethod
    def from_teacher(cls, teacher, n_blocks: int | None = None, init: StudentInit = "teacher") -> "EndpointStudent":
        """A student shaped after `teacher` (a LoopedLM); `n_blocks` defaults to the core's block count.

        Teacher init (design §9) needs an injection that is linear and bias-free in e~ at a zero state
        (parcae-decay, parcae-nonorm, ortho, additive); block i copies core block i mod n_core.
        """
        inj = teacher.injection
        norm = isinstance(inj, ParcaeDiagonal) and inj.prelude_norm is not None
        student = cls(teacher.cfg, teacher.cfg.n_core if n_blocks is None else n_blocks, input_norm=norm)
        student.to(next(teacher.parameters()).device)
        if init == "random":
            return student
        if init != "teacher":
            raise UserError(f"unknown student init {init!r}; choose teacher or random")
        if inj.exit_norm is not None:
            raise UserError(
                f"teacher init: the teacher's recurrence ends in its exit norm ({teacher.cfg.exit_norm}), "
                "which the student has no place for; use random init"
            )
        with torch.no_grad():
            if isinstance(inj, ParcaeDiagonal):  # Inj(0, e~) = dt * (W e~); OrthoInj too (alpha = 0 at s = 0)
                student.in_proj.weight.copy_(inj.dt()[:, None] * inj.W.weight)
                if norm:
                    student.input_norm.weight.copy_(inj.prelude_norm.weight)
            elif isinstance(inj, Additive):  # Inj(0, e) = e
                student.in_proj.weight.copy_(torch.eye(teacher.cfg.d_model))
            else:
                raise UserError(
                    f"teacher init needs a parcae-decay, parcae-nonorm, ortho or additive teacher, "
                    f"not {teacher.cfg.injection!r}; use random init"
                )
            for i, block in enumerate(student.blocks):
                block.load_state_dict(teacher.core[i % len(teacher.core)].state_dict())
        return student
