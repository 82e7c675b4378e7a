"""Pictures of a learned depth prior from a run's metrics: the pmf over training and depth allocation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from looplm.errors import UserError


def prior_history(metrics: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(steps, pmfs [n, cap], allocation counts of the last record) from a run's metrics.jsonl."""
    steps, pmfs, allocation = [], [], None
    for line in Path(metrics).read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if "depth/pmf" in rec:
            steps.append(rec["step"])
            pmfs.append(rec["depth/pmf"])
            allocation = rec.get("depth/allocation", allocation)
    if not steps:
        raise UserError(f"{metrics} has no depth-prior records (was the run trained with --depth.sampler learned?)")
    return np.array(steps), np.array(pmfs), None if allocation is None else np.array(allocation)


def plot_prior(metrics: Path, out: Path, *, max_depth_shown: int = 20, title: str | None = None) -> Path:
    """Three panels: the pmf over 1..max_depth_shown against training step (heat map), the first and last
    pmf, and the share of microbatches (and of recurrence compute) spent at each depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, pmfs, allocation = prior_history(metrics)
    shown = min(max_depth_shown, pmfs.shape[1])
    depths = np.arange(1, shown + 1)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    im = axes[0].imshow(
        pmfs[:, :shown].T, aspect="auto", origin="lower", cmap="viridis", extent=(steps[0], steps[-1], 0.5, shown + 0.5)
    )
    fig.colorbar(im, ax=axes[0], label="p(R)")
    axes[0].set(xlabel="optimizer step", ylabel="depth R", title="prior pmf over training")
    axes[1].plot(depths, pmfs[0, :shown], "o-", label=f"step {steps[0]}")
    axes[1].plot(depths, pmfs[-1, :shown], "s-", label=f"step {steps[-1]}")
    k = np.arange(1, pmfs.shape[1] + 1)
    axes[1].set(xlabel="depth R", ylabel="p(R)", title=f"mean {pmfs[0] @ k:.2f} -> {pmfs[-1] @ k:.2f}")
    axes[1].legend()
    if allocation is not None and allocation.sum() > 0:
        share = allocation[:shown] / allocation.sum()
        compute = allocation * k
        axes[2].bar(depths - 0.2, share, width=0.4, label="microbatches")
        axes[2].bar(depths + 0.2, compute[:shown] / compute.sum(), width=0.4, label="recurrence compute")
        axes[2].legend()
    axes[2].set(xlabel="depth R", ylabel="share", title="depth allocation over the run")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
