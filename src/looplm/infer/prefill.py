"""Prefill arms: how a prompt is written into an empty terminal cache before decoding (design §7, 9).

- `teacher`: the looped model at R_pre recurrences (`extend`);
- `student`: distilled prefill. Prelude (bank 0), z_hat = S(e) from the student, one teacher
  recurrence Inj(z_hat, e~) + core (banks 1..n_core), coda (bank n_core + 1). With terminal KV
  sharing decoding reads only terminal banks, so decoding is unchanged (the teacher at R_dec);
- `r1`, `r2`: the teacher at R_pre = 1 or 2 (the paper's cheap baselines, Table 5).

At 1/2/1 blocks and R = 5 teacher prefill costs 1 + 10 + 1 = 12 block passes, distilled prefill
1 + 2 + 2 + 1 = 6 plus in_proj (`block_passes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from looplm.errors import UserError
from looplm.infer.cache import KVCache
from looplm.infer.extend import extend

PrefillArm = Literal["teacher", "student", "r1", "r2"]
PREFILL_ARMS: tuple[str, ...] = ("teacher", "student", "r1", "r2")


def check_arm_cache(arm: str, cache: str, *, prefix: str = "") -> None:
    """UserError when prefill arm `arm` cannot fill a cache of kind `cache`: the student writes terminal
    banks only. `prefix` "--" names the settings as looplm's options (--prefill, --cache)."""
    if arm == "student" and cache != "terminal":
        raise UserError(f"{prefix}prefill student writes terminal banks: it needs {prefix}cache terminal")


@torch.no_grad()
def student_prefill(
    model,
    student: nn.Module,
    tokens: torch.Tensor,
    cache: KVCache,
    *,
    example_ids: torch.Tensor | None = None,
    seed: int = 0,
    pad: torch.Tensor | None = None,
    **kw,
) -> torch.Tensor:
    """Distilled prefill of `tokens` [B, n] into an empty terminal `cache` (design §9); fp32 logits [B, n, V].

    The student sees the same rope and mask as the teacher's layers (left padding included); one
    teacher recurrence from its prediction writes the core's terminal banks."""
    check_arm_cache("student", cache.mode)
    return extend(model, tokens, cache, 1, example_ids=example_ids, seed=seed, pad=pad, initial=student, **kw).logits


@dataclass(frozen=True)
class Prefill:
    """One prefill arm, called like `extend` on an empty cache: `prefill(model, tokens, cache, depth, ...)`
    returns the prompt's fp32 logits [B, n, V].

    `depth` is the teacher's prefill depth R_pre, used by the `teacher` arm; `student` (an
    `EndpointStudent` distilled from this model) is needed by the `student` arm."""

    arm: str = "teacher"
    student: nn.Module | None = None

    def __post_init__(self) -> None:
        if self.arm not in PREFILL_ARMS:
            raise UserError(f"unknown prefill arm {self.arm!r}; choose one of {', '.join(PREFILL_ARMS)}")
        if self.arm == "student" and self.student is None:
            raise UserError("the student prefill arm needs a distilled student (--student PATH)")

    def teacher_depth(self, depth: int) -> int:
        """Teacher recurrences run over the prompt (1 for the student arm: the one after its prediction)."""
        return {"teacher": depth, "student": 1, "r1": 1, "r2": 2}[self.arm]

    def block_passes(self, cfg, depth: int) -> int:
        """Transformer-block passes per prompt token (design §9's cost count; in_proj not counted)."""
        student = self.student.n_blocks if self.arm == "student" else 0
        return cfg.n_prelude + student + self.teacher_depth(depth) * cfg.n_core + cfg.n_coda

    def __call__(self, model, tokens: torch.Tensor, cache: KVCache, depth: int, **kw) -> torch.Tensor:
        if self.arm == "student":
            return student_prefill(model, self.student, tokens, cache, **kw)
        return extend(model, tokens, cache, self.teacher_depth(depth), **kw).logits
