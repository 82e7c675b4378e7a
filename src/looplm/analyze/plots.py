"""PNG figures of the fixed-point report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from looplm.analyze.convergence import NEVER  # noqa: E402


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def convergence_histogram(report: dict, path: Path) -> Path:
    """Tokens per convergence depth at tau (log scale), with the never-converged tokens as the last bar."""
    c = report["convergence"]
    hist = c["histogram"]
    top = max([d for d, n in enumerate(hist) if n] or [0])
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.bar(range(top + 1), hist[: top + 1], width=0.9, color="tab:blue", label="converged")
    ax.bar([top + 2], [c["never"]], width=0.9, color="tab:red", label=f"not within {c['horizon']}")
    ax.set_xticks(
        list(range(0, top + 1, max(1, (top + 1) // 10))) + [top + 2],
        [str(d) for d in range(0, top + 1, max(1, (top + 1) // 10))] + ["never"],
    )
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.5)  # a bar of one token stays visible
    ax.set_xlabel("convergence depth (recurrences)")
    ax.set_ylabel("tokens")
    median = c["median_depth"]
    ax.set_title(
        f"convergence depth at tau={c['tau']:g}: {100 * c['fraction_converged']:.1f}% converged, "
        f"median {median if median is not None else '-'}",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    return _save(fig, path)


def position_vs_depth(report: dict, depth: torch.Tensor, position: torch.Tensor, path: Path) -> Path:
    """Convergence depth against position (converged tokens, subsampled) with the interval medians."""
    c = report["convergence"]
    done = depth != NEVER
    d, p = depth[done].float(), position[done].float()
    if d.numel() > 4000:
        keep = torch.randperm(d.numel(), generator=torch.Generator().manual_seed(0))[:4000]
        d, p = d[keep], p[keep]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    jitter = (torch.rand(d.shape, generator=torch.Generator().manual_seed(1)) - 0.5) * 0.6
    ax.scatter(p, d + jitter, s=3, alpha=0.25, color="tab:blue", label="tokens (jittered)")
    last = float(position.max())
    label = "interval median"
    for b in c["intervals"]:
        if b["median_depth"] is not None:  # a segment over the positions the interval covers
            ax.hlines(b["median_depth"], b["start"], min(b["end"] - 1, last), color="tab:orange", lw=2.5, label=label)
            label = None
    rho = c["spearman_position_depth"]
    ax.set_title(
        f"position vs convergence depth (Spearman {rho:.3f})" if rho is not None else "position vs convergence depth",
        fontsize=10,
    )
    ax.set_xlabel("position")
    ax.set_ylabel("convergence depth")
    ax.legend(fontsize=8)
    return _save(fig, path)


def relative_change_curve(report: dict, path: Path) -> Path:
    """Median and interquartile band of the token-wise relative state change per recurrence."""
    c = report["convergence"]
    ch = c["change"]
    r = list(range(1, c["horizon"] + 1))
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.fill_between(r, ch["q25"], ch["q75"], alpha=0.3, color="tab:blue", label="25-75%")
    ax.plot(r, ch["median"], color="tab:blue", label="median")
    ax.axhline(c["tau"], color="tab:red", ls="--", lw=1, label=f"tau = {c['tau']:g}")
    ax.set_yscale("log")
    ax.set_xlabel("recurrence r")
    ax.set_ylabel("|h^r - h^(r-1)| / |h^(r-1)|")
    ax.set_title("token-wise relative state change", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def sharing_vs_depth(report: dict, path: Path) -> Path:
    """Terminal-KV sharing penalty against depth R (chunk scoring and one-token decoding)."""
    sh = report["sharing"]
    depths = list(sh)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(depths, [sh[r]["sharing_penalty"] for r in depths], "o-", label="chunk")
    ax.plot(depths, [sh[r]["cacheeval_penalty"] for r in depths], "s-", label="one-token decode")
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xlabel("depth R")
    ax.set_ylabel("sharing penalty (% PPL)")
    ax.set_title("terminal-KV sharing penalty vs depth", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


PLOT_NAMES = ("convergence_hist.png", "position_depth.png", "relative_change.png", "sharing_depth.png")
"""Every figure `write_plots` may write."""


def write_plots(analysis, folder: Path) -> list[Path]:
    """The report's figures as PNGs in `folder`."""
    rep = analysis.report
    out = [
        convergence_histogram(rep, folder / "convergence_hist.png"),
        position_vs_depth(rep, analysis.depth, analysis.position, folder / "position_depth.png"),
        relative_change_curve(rep, folder / "relative_change.png"),
    ]
    if rep.get("sharing"):
        out.append(sharing_vs_depth(rep, folder / "sharing_depth.png"))
    return out
