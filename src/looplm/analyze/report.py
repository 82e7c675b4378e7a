"""The fixed-point report of `looplm analyze`: every design §11 measurement of one checkpoint.

Held-out rows are run past the trained depth once; that trajectory gives the convergence profile
(up to the horizon), the KV settling table (at the KV depths) and the carryover alignment (at the
horizon). Fixed-point solves run on their own spans; the sharing penalty reuses looplm.eval.cached.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from looplm.analyze.carryover import carryover_alignment, summarize
from looplm.analyze.convergence import convergence_depths, convergence_profile, median_or_none
from looplm.analyze.kv_settling import KVSums, kv_recurrences
from looplm.analyze.solves import SolveRule, span_solves
from looplm.analyze.trajectory import run_trajectory, start
from looplm.config import check_depth
from looplm.errors import UserError

Progress = Callable[[str, int], None]
"""progress(description, units done since the last call)."""


@dataclass
class AnalyzeConfig:
    """What `looplm analyze` measures (design §11)."""

    horizon: int = 64
    """Observation horizon H: recurrences run for the convergence profile and the carryover endpoint."""
    tau: float = 0.02
    """Convergence threshold on the token-wise relative state change (the paper: 0.02; 0.01 in App. C.4)."""
    sequences: int = 16
    """Held-out rows for the convergence profile, KV settling and carryover alignment."""
    batch_size: int = 8
    """Rows per forward pass."""
    position_interval: int = 128
    """Width of the position buckets for the median convergence depth per position interval."""
    kv_depths: tuple[int, ...] = (5, 25, 64, 160)
    """Depths r at which the KV change |K^(r+span) - K^r| / |K^r| is measured (may exceed max_depth)."""
    kv_span: int = 5
    """Recurrences between the two K/V compared by the KV settling table."""
    solve_spans: int = 8
    """Held-out spans for the fixed-point solves (0 skips them)."""
    solve_length: int | None = None
    """Tokens per span: a prefix and the current token (the last); None: a whole held-out row."""
    solve: SolveRule = field(default_factory=SolveRule)
    """The solve budget and qualification rule (fp32, math attention kernel)."""
    control_depth: int = 5
    """Depth R of the control: the prefix frozen after R plain recurrences instead of solved."""
    sharing_depths: tuple[int, ...] = (5, 16, 32)
    """Depths of the terminal-KV sharing penalty (looplm.eval.cached; empty skips it)."""
    sharing_sequences: int = 8
    """Held-out rows for the sharing penalty."""
    output: Path | None = None
    """Folder for report.json, summary.txt and the PNG plots (default: <run>/analyze next to the checkpoint)."""
    plots: bool = True
    """Write the PNG plots."""

    def validate(self, max_depth: int | None = None) -> None:
        """ValueError with a one-line reason for settings that cannot work."""
        if self.horizon < 1:
            raise UserError(f"horizon must be >= 1, got {self.horizon}")
        if not self.tau > 0:
            raise UserError(f"tau must be > 0, got {self.tau}")
        for name in ("sequences", "batch_size", "position_interval", "kv_span", "control_depth"):
            if getattr(self, name) < 1:
                raise UserError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.solve_spans < 0 or self.sharing_sequences < 0:
            raise UserError("solve-spans and sharing-sequences must be >= 0")
        if self.kv_depths:
            kv_recurrences(self.kv_depths, self.kv_span)
        if self.solve_length is not None and self.solve_length < 2:
            raise UserError(f"solve-length must be >= 2 (a prefix and a current token), got {self.solve_length}")
        self.solve.validate()
        if max_depth is not None:
            for r in self.sharing_depths:
                check_depth("sharing depths", r, max_depth, "the model's max_depth")

    def work_units(self, n_rows: int) -> int:
        """Progress units `analyze` reports for a dataset of `n_rows` held-out rows."""
        batches = -(-min(n_rows, self.sequences) // self.batch_size)
        solves = 4 * -(-min(n_rows, self.solve_spans) // self.batch_size)
        return batches + solves + (len(self.sharing_depths) if self.sharing_sequences else 0)


@dataclass
class Analysis:
    report: dict
    """The JSON-able report."""
    depth: torch.Tensor
    """Convergence depth per profiled token (NEVER = -1), flat."""
    position: torch.Tensor
    """RoPE position per profiled token, flat."""


def require_recurrence(checkpoint: Path) -> None:
    """ValueError when a checkpoint's model has no recurrent core to analyze (n_core < 1). An
    unreadable config is left to `load_model`, which names the problem."""
    try:
        n_core = json.loads((Path(checkpoint) / "config.json").read_text())["model"]["n_core"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    if not isinstance(n_core, int) or n_core < 1:
        raise UserError(
            f"{checkpoint}: the model has no recurrent core (n_core={n_core}); "
            "fixed-point diagnostics need a looped model"
        )


def _batches(n: int, size: int):
    for lo in range(0, n, size):
        yield list(range(lo, min(n, lo + size)))


def _max(x: torch.Tensor) -> float | None:
    return float(x.max()) if x.numel() else None


@torch.no_grad()
def profile_rows(
    model, data, cfg: AnalyzeConfig, device, progress: Progress
) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Convergence profile, KV settling and carryover alignment over the first `cfg.sequences` rows."""
    n = min(len(data), cfg.sequences)
    kv_at = kv_recurrences(cfg.kv_depths, cfg.kv_span) if cfg.kv_depths else ()
    sums = KVSums(cfg.kv_depths, cfg.kv_span) if cfg.kv_depths else None
    changes, positions, cos, amp = [], [], [], []
    for idx in _batches(n, cfg.batch_size):
        b = data.get_batch(idx).to(device)
        begin = start(model, b.inputs, doc_ids=b.doc_ids, positions=b.positions, example_ids=b.example_ids)
        traj = run_trajectory(
            model,
            begin,
            cfg.horizon,
            kv_at=kv_at,
            on_step=lambda r: progress(f"trajectory r={r}", 0) if r % 16 == 0 else None,
        )
        changes.append(traj.change)
        positions.append(begin.positions)
        if sums is not None:
            sums.add(traj.kv)
        align = carryover_alignment(model.injection, traj.endpoint, begin.ctx.injected)
        if align is not None:
            cos.append(align["cos"].flatten())
            amp.append(align["amplification"].flatten())
        progress("trajectories", 1)
    change, pos = torch.cat(changes, dim=1), torch.cat(positions, dim=0)
    carry = {"injection": model.cfg.injection, "depth": cfg.horizon}
    if cos:
        carry.update(cos=summarize(torch.cat(cos)), amplification=summarize(torch.cat(amp)))
    else:
        why = {
            "deq-qkv": "DEQ-QKV injects into the core's attention instead",
            "none": "injection none: the input enters only through the initial state",
        }.get(model.cfg.injection, f"injection {model.cfg.injection}")
        carry["note"] = f"no core-entrance injection ({why}): carryover is not defined"
    out = {
        "convergence": convergence_profile(change, pos, cfg.tau, cfg.position_interval),
        "kv_settling": sums.table() if sums is not None else [],
        "carryover": carry,
    }
    return out, convergence_depths(change, cfg.tau).flatten().cpu(), pos.flatten().cpu()


def solve_rows(model, data, cfg: AnalyzeConfig, device, progress: Progress) -> dict:
    """Joint vs frozen-prefix solves over the first `cfg.solve_spans` rows (see analyze.solves)."""
    n = min(len(data), cfg.solve_spans)
    length = data.seq_len if cfg.solve_length is None else min(cfg.solve_length, data.seq_len)
    parts: dict[str, list] = {}
    for idx in _batches(n, cfg.batch_size):
        b = data.get_batch(idx).to(device)
        cut = slice(0, length)
        out = span_solves(
            model,
            b.inputs[:, cut],
            doc_ids=b.doc_ids[:, cut],
            positions=b.positions[:, cut],
            example_ids=b.example_ids,
            rule=cfg.solve,
            control_depth=cfg.control_depth,
            progress=progress,
        )
        for k, v in out.items():
            parts.setdefault(k, []).append(v.cpu())
    r = {k: torch.cat(v) for k, v in parts.items()}
    pair = r["prefix_qualified"] & r["joint_qualified"] & r["frozen_qualified"]
    ctrl = pair & r["control_qualified"]
    return {
        "spans": n,
        "span_tokens": length,
        "rule": dataclasses.asdict(cfg.solve),
        "control_depth": cfg.control_depth,
        "qualified": {name: int(r[f"{name}_qualified"].sum()) for name in ("prefix", "joint", "frozen", "control")},
        "qualified_pairs": int(pair.sum()),
        "median_depth": {
            name: median_or_none(r[f"{name}_depth"][r[f"{name}_qualified"]].float())
            for name in ("prefix", "joint", "frozen")
        },
        "max_depth": {
            name: _max(r[f"{name}_depth"][r[f"{name}_qualified"]].float()) for name in ("prefix", "joint", "frozen")
        },
        "gap": {"median": median_or_none(r["gap"][pair]), "max": _max(r["gap"][pair])},
        "kl": {"median": median_or_none(r["kl"][pair]), "max": _max(r["kl"][pair])},
        "control": {
            "spans": int(ctrl.sum()),
            "gap_median": median_or_none(r["control_gap"][ctrl]),
            "kl_median": median_or_none(r["control_kl"][ctrl]),
        },
        "per_span": {k: v.tolist() for k, v in r.items()},
    }


def analyze(model, tokenizer, data, cfg: AnalyzeConfig, device="cpu", progress: Progress | None = None) -> Analysis:
    """All design §11 diagnostics of a trained model on held-out data: `data`, a PackedDataset, or a
    `looplm.data.record.DataRecord` (its validation split)."""
    from looplm.data.record import DataRecord
    from looplm.eval.cached import sharing_table

    progress = progress or (lambda desc, n: None)
    cfg.validate(model.cfg.max_depth)
    if isinstance(data, DataRecord):
        data = data.validation(tokenizer)
    if len(data) == 0:
        raise UserError("no held-out sequences to analyze")
    seconds = {}
    t = time.perf_counter()
    report, depth, pos = profile_rows(model, data, cfg, device, progress)
    seconds["profile"] = time.perf_counter() - t
    report["solves"] = None
    if cfg.solve_spans:
        t = time.perf_counter()
        report["solves"] = solve_rows(model, data, cfg, device, progress)
        seconds["solves"] = time.perf_counter() - t
    report["sharing"] = None
    if cfg.sharing_depths and cfg.sharing_sequences:
        t = time.perf_counter()
        report["sharing"] = sharing_table(
            model,
            data,
            cfg.sharing_depths,
            max_sequences=cfg.sharing_sequences,
            device=device,
            progress=lambda _depth: progress("sharing", 1),
        )
        seconds["sharing"] = time.perf_counter() - t
    report["model"] = {k: model.cfg.to_dict()[k] for k in ("injection", "d_model", "n_prelude", "n_core", "n_coda")}
    report["config"] = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    report["seconds"] = seconds
    return Analysis(report, depth, pos)


# -- output ----------------------------------------------------------------------------------------
def _fmt(x, spec: str = ".3g") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _change_line(c: dict) -> str:
    """The median relative change at r = 1, 5, 16 and the horizon H: one label per value, so depths
    past the horizon are left out of both, and H is not repeated when it is one of them."""
    H = c["horizon"]
    depths = [r for r in (1, 5, 16) if r < H] + [H]
    labels = [str(r) for r in depths[:-1]] + [f"H = {H}"]
    return f"  relative change (median) at r = {', '.join(labels)}: " + ", ".join(
        _fmt(c["change"]["median"][r - 1]) for r in depths
    )


def format_summary(report: dict) -> str:
    """A one-screen plain-text summary of the report."""
    c = report["convergence"]
    lines = [
        f"fixed-point diagnostics ({report['model']['injection']}, {c['tokens']} held-out tokens"
        + (f" of {report['data']}" if report.get("data") else "")
        + ", "
        f"horizon {c['horizon']}, tau {c['tau']:g})",
        f"  converged: {100 * c['fraction_converged']:.1f}% of tokens; median convergence depth "
        f"{_fmt(c['median_depth'])}; never: {c['never']}",
        f"  Spearman(position, depth) = {_fmt(c['spearman_position_depth'])}; median depth per "
        f"{c['intervals'][0]['end'] - c['intervals'][0]['start']}-position interval: "
        + ", ".join(f"{b['start']}: {_fmt(b['median_depth'])}" for b in c["intervals"][:6])
        + (" ..." if len(c["intervals"]) > 6 else ""),
        _change_line(c),
    ]
    if report["kv_settling"]:
        rows = report["kv_settling"]
        depths = sorted({row["depth"] for row in rows})
        cell = {(row["layer"], row["depth"]): row for row in rows}
        lines += [
            "",
            f"KV settling: |X^(r+{report['config']['kv_span']}) - X^r| / |X^r| in % per core layer, "
            f"and |K^r| / |K^{depths[0]}|",
            f"{'':>14}" + "".join(f"{'r=' + str(r):>11}" for r in depths),
        ]
        for j in sorted({row["layer"] for row in rows}):
            for key, label in (("K_change", "K"), ("V_change", "V"), ("K_norm_ratio", "|K|")):
                scale, spec = (1, ".4f") if key == "K_norm_ratio" else (100, ".3g")
                lines.append(
                    f"  layer {j} {label:<4}"
                    + "".join(
                        f"{_fmt(None if cell[j, r][key] is None else scale * cell[j, r][key], spec):>11}"
                        for r in depths
                    )
                )
    co = report["carryover"]
    lines += [""]
    if "cos" in co:
        lines += [
            f"carryover alignment at r={co['depth']} (median, 10-90% of tokens):",
            f"  cos(carryover, q) {co['cos']['median']:.3f} [{co['cos']['q10']:.3f}, {co['cos']['q90']:.3f}]; "
            f"amplification 1 + <carryover, q>/|q|^2 = {co['amplification']['median']:.4f}x "
            f"[{co['amplification']['q10']:.4f}, {co['amplification']['q90']:.4f}]",
        ]
    else:
        lines.append(f"carryover: {co['note']}")
    s = report.get("solves")
    if s:
        q = s["qualified"]
        lines += [
            "",
            f"fixed-point solves ({s['spans']} spans of {s['span_tokens']} tokens, "
            f"<= {s['rule']['max_depth']} recurrences, fp32, math attention):",
            f"  qualified: prefix {q['prefix']}, joint {q['joint']}, frozen {q['frozen']}; all three: "
            f"{s['qualified_pairs']}; median depth prefix {_fmt(s['median_depth']['prefix'])}, joint "
            f"{_fmt(s['median_depth']['joint'])}",
            f"  joint vs frozen-prefix: state gap median {_fmt(s['gap']['median'])} "
            f"(max {_fmt(s['gap']['max'])}), "
            f"KL median {_fmt(s['kl']['median'])}",
            f"  depth-{s['control_depth']} prefix control ({s['control']['spans']} spans): state gap median "
            f"{_fmt(s['control']['gap_median'])}, KL median {_fmt(s['control']['kl_median'])}",
        ]
    if report.get("sharing"):
        lines += [
            "",
            "terminal-KV sharing penalty, 100 (PPL_terminal / PPL_full - 1), chunk / one-token decode:",
            "  "
            + "; ".join(
                f"R={r}: {v['sharing_penalty']:.3f}% / {v['cacheeval_penalty']:.3f}%"
                for r, v in report["sharing"].items()
            ),
        ]
    return "\n".join(lines)


def write_outputs(analysis: Analysis, folder: Path, plots: bool = True) -> list[Path]:
    """report.json, summary.txt and (with `plots`) the PNG figures in `folder`; returns the paths."""
    from looplm.analyze.plots import PLOT_NAMES

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in PLOT_NAMES:  # an earlier run's figures would contradict this report (or its --no-plots)
        (folder / name).unlink(missing_ok=True)
    paths = [folder / "report.json", folder / "summary.txt"]
    paths[0].write_text(json.dumps(analysis.report, indent=1, default=str))
    paths[1].write_text(format_summary(analysis.report) + "\n")
    if plots:
        from looplm.analyze.plots import write_plots

        paths += write_plots(analysis, folder)
    return paths
