"""Metrics sinks: JSONL always; TensorBoard and Weights & Biases when installed and enabled."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path


class MetricsLogger:
    """Appends one JSON object per record to `out_dir/metrics.jsonl` (main process only)."""

    def __init__(self, out_dir: Path, *, enabled: bool, tensorboard: bool, wandb: bool, config: dict | None = None):
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self._tb = self._wandb = None
        self._tb_dir: Path | None = None  # the writer opens at the run's first step (`truncate_after`)
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                import torch.utils.tensorboard  # noqa: F401  (the tensorboard extra, README: Install)

                self._tb_dir = Path(out_dir) / "tensorboard"
            except ImportError:
                self._tb_dir = None
        if wandb:
            try:
                import wandb as wb

                self._wandb = wb.init(project="looplm", dir=str(out_dir), config=config or {})
            except ImportError:
                self._wandb = None

    def log(self, record: dict, step: int) -> None:
        if not self.enabled:
            return
        record = {"step": step, **record}
        if self._tb_dir is not None and self._tb is None:
            self._open_tensorboard(None)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step" and math.isfinite(v)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def truncate_after(self, step: int | None, keep_at_step: Callable[[dict], bool] | None = None) -> None:
        """At the start of a run resumed at `step`, drop the records past it (all of them on a fresh start,
        `step` None, over an earlier attempt's log) so that the log equals an uninterrupted run's; a torn
        line (a process killed mid-write) goes too. `keep_at_step(record)`: whether a record at `step`
        itself stays (a session that stopped there logged its last step, which an uninterrupted run logs
        only on its grid)."""
        if not self.enabled:
            return
        if self._tb_dir is not None and self._tb is None:  # its events past `step` are hidden, as records go
            self._open_tensorboard(0 if step is None else step + 1)
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines() if step is not None else []
        kept = [
            line
            for line in lines
            if (n := _step(line)) is not None
            and (n < step or (n == step and (keep_at_step is None or keep_at_step(json.loads(line)))))
        ]
        self.path.write_text("".join(line + "\n" for line in kept))

    def _open_tensorboard(self, purge_step: int | None) -> None:
        """The TensorBoard writer; `purge_step`: events of earlier attempts at that step and later are hidden."""
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(str(self._tb_dir), purge_step=purge_step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _step(line: str) -> int | None:
    """The step of one metrics.jsonl line, None for a line that is not a whole record."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
