"""The run folder's pictures (matplotlib, Agg backend: no display needed): held-out perplexity and the
state change dstate against test-time depth R from an eval report, and the loss curve from metrics.jsonl.

The series are built from the report's and the log's own numbers (`depth_series`, `loss_series`), then drawn.
"""

from __future__ import annotations

import json
from pathlib import Path

DEPTH_PLOT = "ppl_vs_depth.png"
LOSS_PLOT = "loss.png"


def depth_series(report: dict) -> dict[str, list]:
    """{"depth", "ppl", "state_change"} in increasing depth from `report["perplexity"]` (keys: ints in memory,
    strings once written as JSON); a depth without a state change (R = 1 of some models) has None."""
    ppl = {int(r): v for r, v in report["perplexity"].items()}
    depths = sorted(ppl)
    return {
        "depth": depths,
        "ppl": [ppl[r]["ppl"] for r in depths],
        "state_change": [ppl[r].get("state_change") for r in depths],
    }


def loss_series(metrics: Path) -> dict[str, list]:
    """{"step", "loss", "val_step", "val_loss"} from a run's metrics.jsonl; a step logged twice (a run resumed
    from an earlier checkpoint logs its steps again) keeps its last record."""
    train: dict[int, float] = {}
    val: dict[int, float] = {}
    for line in Path(metrics).read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "loss" in record:
            train[int(record["step"])] = float(record["loss"])
        if "val_loss" in record:
            val[int(record["step"])] = float(record["val_loss"])
    return {
        "step": sorted(train),
        "loss": [train[s] for s in sorted(train)],
        "val_step": sorted(val),
        "val_loss": [val[s] for s in sorted(val)],
    }


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    _pyplot().close(fig)
    return path


def write_depth_plot(series: dict[str, list], path: Path, title: str = "") -> Path:
    """Perplexity (left axis) and dstate (right axis, where measured) against R on a log-x axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.plot(series["depth"], series["ppl"], "o-", color="tab:blue", label="held-out perplexity")
    ax.set_xscale("log")
    ax.set_xticks(series["depth"], [str(r) for r in series["depth"]])
    ax.minorticks_off()
    ax.set_xlabel("test-time depth R (recurrences)")
    ax.set_ylabel("perplexity", color="tab:blue")
    measured = [(r, d) for r, d in zip(series["depth"], series["state_change"]) if d is not None]
    if measured:
        right = ax.twinx()
        right.plot(*zip(*measured), "s--", color="tab:red", label="dstate")
        right.set_ylabel("dstate (relative state change)", color="tab:red")
    ax.set_title(title or "held-out perplexity and dstate vs depth", fontsize=10)
    return _save(fig, path)


def write_loss_plot(series: dict[str, list], path: Path) -> Path:
    """Training loss per logged step, and the validation loss where it was measured."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.plot(series["step"], series["loss"], color="tab:blue", label="train loss")
    if series["val_step"]:
        ax.plot(series["val_step"], series["val_loss"], "o-", color="tab:orange", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.legend(fontsize=8)
    ax.set_title("loss", fontsize=10)
    return _save(fig, path)


def write_run_plots(report: dict, report_path: Path) -> list[Path]:
    """The pictures beside the report at `report_path`: its depth plot (named after the report: eval.json ->
    ppl_vs_depth.png, eval-<data>.json -> ppl_vs_depth-<data>.png), and the loss curve when the folder holds
    a run's metrics.jsonl. Returns the paths written."""
    folder, stem = report_path.parent, report_path.stem
    suffix = stem[len("eval") :] if stem.startswith("eval") else f"-{stem}"
    written = [write_depth_plot(depth_series(report), folder / f"{Path(DEPTH_PLOT).stem}{suffix}.png")]
    metrics = folder / "metrics.jsonl"
    if metrics.is_file():
        series = loss_series(metrics)
        if series["step"]:
            written.append(write_loss_plot(series, folder / LOSS_PLOT))
    return written
