"""Typed configuration of `looplm distill` (design §9 defaults)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from looplm.config import check_finite
from looplm.errors import UserError


@dataclass
class DistillConfig:
    """Distil a non-recurrent student that predicts a frozen teacher's depth-R endpoint (design §9)."""

    out_dir: Path = Path("runs/distill")
    """Run folder: checkpoints (with the teacher's content hash), metrics.jsonl, report.json."""
    depth: int = 5
    """Teacher depth R whose endpoint z^R the student predicts (the prefill depth it replaces)."""
    init: Literal["teacher", "random"] = "teacher"
    """Student init: teacher (in_proj = diag(dt) W_inj, blocks copied from the core) or random (the ablation)."""
    student_blocks: int | None = None
    """Blocks in the student (default: the teacher core's count, 2 at 1/2/1)."""
    steps: int = 300
    """Optimizer steps (the warmup + cosine schedule spans them)."""
    micro_batch: int = 16
    """Rows per step."""
    seq_len: int | None = None
    """Tokens per row (default: the teacher's training seq_len)."""
    lr: float = 1e-3
    """Peak AdamW learning rate."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip (0 disables)."""
    warmup: int = 8
    """Linear warmup steps: the lr rises to the peak, reached at the last of them; then a cosine decay to 0.1x over
    the remaining steps (the last step runs at 0.1x)."""
    kl_weight: float = 1.0
    """beta in loss = MSE(z_hat, z^R)/E + beta * KL(p_T || p_S) (KL through the frozen coda and head)."""
    calibration_rows: int = 64
    """Training rows, evenly spaced over the training split, on which the energy E = mean((z^R)^2) is measured once
    (fp64) and checkpointed."""
    val_rows: int = 32
    """Held-out rows for validation (relative state error and KL): the first rows of the held-out split."""
    val_every: int = 50
    """Validate every this many steps and at the end (0: only at the end)."""
    log_every: int = 10
    """Metrics line every this many steps."""
    checkpoint_every: int = 100
    """Write a checkpoint every this many steps (and at the end)."""
    keep_checkpoints: int = 2
    """How many recent checkpoints to keep."""
    resume: bool = False
    """Continue from the latest checkpoint in out_dir (same teacher and config)."""
    seed: int = 0
    """Seed of the student init and of the data order."""
    device: str = "auto"
    """Device: auto (CUDA when available), cpu, cuda, cuda:N; under torchrun each rank takes cuda:LOCAL_RANK."""
    progress: bool = True
    """Show a progress bar."""
    report_rows: int = 32
    """After training: held-out rows for each prefill arm's continuation perplexity (0 skips the arms table)."""
    report_examples: int = 200
    """After training: generator-task examples for each prefill arm's exact match (0 skips; task-trained teachers)."""

    def validate(self) -> None:
        for name in ("steps", "micro_batch", "calibration_rows", "log_every", "checkpoint_every", "val_rows"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "warmup",
            "val_every",
            "report_rows",
            "report_examples",
            "weight_decay",
            "kl_weight",
            "grad_clip",
        ):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
        check_finite(self, ("lr", "weight_decay", "kl_weight", "grad_clip", "beta1", "beta2"))
        if self.student_blocks is not None and self.student_blocks < 1:
            raise UserError(f"student_blocks must be >= 1, got {self.student_blocks}")
        if self.lr <= 0:
            raise UserError(f"lr must be > 0, got {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"{name} must be in [0, 1), got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()}


# Settings that may change between a run and its resume.
RESUMABLE = {
    "resume",
    "progress",
    "log_every",
    "checkpoint_every",
    "keep_checkpoints",
    "val_every",
    "device",
    "report_rows",
    "report_examples",
}
