"""`looplm analyze`: report, plots and summary from a trained checkpoint, and one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from _jobs import one_thread, shared_cache, tiny_job

from looplm import checkpoint as ckpt
from looplm.cli import main
from looplm.model.state import initial_state
from looplm.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread

FAST = [
    "--horizon",
    "6",
    "--sequences",
    "3",
    "--batch-size",
    "2",
    "--kv-depths",
    "2",
    "4",
    "--kv-span",
    "2",
    "--solve-spans",
    "2",
    "--solve-length",
    "16",
    "--solve.max-depth",
    "200",
    "--sharing-depths",
    "1",
    "2",
    "--sharing-sequences",
    "2",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder with the checkpoint of a 2-step tiny run."""
    root = tmp_path_factory.mktemp("analyze")
    with one_thread():
        Trainer(tiny_job(root, "run", cache=shared_cache(tmp_path_factory), train__steps=2)).fit()
    return root / "run"


def test_analyze_writes_report_plots_and_summary(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["analyze", str(run_dir), *FAST, "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert (out / "summary.txt").read_text().strip() in printed
    for name in ("convergence_hist", "position_depth", "relative_change", "sharing_depth"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert set(report) >= {"convergence", "kv_settling", "carryover", "solves", "sharing", "model", "config"}
    assert sorted(report["sharing"]) == ["1", "2"]
    assert {row["depth"] for row in report["kv_settling"]} == {2, 4} and len(report["kv_settling"]) == 2 * 2
    assert report["solves"]["spans"] == 2 and report["solves"]["span_tokens"] == 16
    assert "amplification" in report["carryover"]

    # The convergence profile against the native forward on the same held-out rows (an independent
    # path: LoopedLM.forward with the seeded state) and a plain loop over the rule.
    model, tokenizer, _ = ckpt.load_model(run_dir)
    b = ckpt.load_data(run_dir).validation(tokenizer).get_batch([0, 1, 2])
    with torch.no_grad():
        states = model(
            b.inputs,
            6,
            doc_ids=b.doc_ids,
            positions=b.positions,
            init="seeded",
            example_ids=b.example_ids,
            return_states=True,
        ).states
    s0 = initial_state(
        "seeded", states[0].shape, device="cpu", dtype=torch.float32, example_ids=b.example_ids, positions=b.positions
    )
    trajectory = [s0, *states]
    tau, H = report["convergence"]["tau"], 6
    hist, never = [0] * H, 0
    for i in range(3):
        for t in range(b.inputs.shape[1]):
            delta = [None] + [
                float((trajectory[r][i, t] - trajectory[r - 1][i, t]).norm() / trajectory[r - 1][i, t].norm())
                for r in range(1, H + 1)
            ]
            c = H  # walk back while the change of recurrence c is below tau
            while c > 0 and delta[c] < tau:
                c -= 1
            if c == H:
                never += 1
            else:
                hist[c] += 1
    assert report["convergence"]["never"] == never
    assert report["convergence"]["histogram"] == hist
    assert report["convergence"]["tokens"] == 3 * b.inputs.shape[1]


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--horizon", "0"], "horizon must be >= 1, got 0"),
        (["--tau", "0"], "tau must be > 0, got 0.0"),
        (["--tau", "-0.5"], "tau must be > 0, got -0.5"),
        (["--kv-span", "0"], "kv-span must be >= 1"),
        (["--kv-depths", "0", "5"], "KV depths must be >= 1"),
        (["--solve.tol", "0"], "solve tolerances must be > 0"),
        (["--solve.tol", "nan"], "solve tolerances must be > 0"),  # NaN: every solve ran to max_depth, none passed
        (["--solve.drift-tol", "nan"], "solve tolerances must be > 0"),
        (["--sharing-depths", "100"], "sharing depths must be in 1..64"),
    ],
)
def test_bad_settings_are_one_line_errors(run_dir, tmp_path, capsys, flags, message):
    assert main(["analyze", str(run_dir), *flags, "--output", str(tmp_path / "o")]) == 2
    assert message in _error(capsys)
    assert not (tmp_path / "o").exists()


def test_a_rerun_into_the_same_folder_leaves_no_figure_of_the_earlier_run(run_dir, tmp_path, capsys):
    """A second run without sharing (or with --no-plots) kept the first run's PNGs beside a report that
    contradicts them."""
    out = tmp_path / "out"
    assert main(["analyze", str(run_dir), *FAST, "--output", str(out)]) == 0
    assert (out / "sharing_depth.png").is_file()
    assert main(["analyze", str(run_dir), *FAST, "--sharing-sequences", "0", "--output", str(out)]) == 0
    assert json.loads((out / "report.json").read_text())["sharing"] is None
    assert not (out / "sharing_depth.png").exists() and (out / "relative_change.png").is_file()
    assert main(["analyze", str(run_dir), *FAST, "--no-plots", "--output", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "summary.txt"]
    capsys.readouterr()


def test_the_carryover_note_names_the_models_injection(tmp_path, capsys):
    """A model without a core-entrance injection has no carryover; the note blamed DEQ-QKV for injection none."""
    from _jobs import write_random_run

    run = write_random_run(tmp_path / "run", model__injection="none", model__state_init="input")
    out = tmp_path / "out"
    assert main(["analyze", str(run), *FAST, "--sharing-sequences", "0", "--no-plots", "--output", str(out)]) == 0
    note = json.loads((out / "report.json").read_text())["carryover"]["note"]
    assert note == (
        "no core-entrance injection (injection none: the input enters only through the initial state): "
        "carryover is not defined"
    )
    capsys.readouterr()


def test_other_data_gets_its_own_folder_and_the_report_names_its_data(run_dir, tmp_path, capsys):
    run = shutil.copytree(run_dir, tmp_path / "run", symlinks=True)
    assert main(["analyze", str(run), *FAST, "--data", "shakespeare"]) == 0
    assert "held-out tokens of shakespeare" in capsys.readouterr().out
    assert json.loads((run / "analyze-shakespeare" / "report.json").read_text())["data"] == "shakespeare"
    assert not (run / "analyze").exists()  # the run's own analysis was overwritten before


def test_an_output_that_is_a_file_is_refused_before_the_work(run_dir, tmp_path, capsys):
    # it was an internal error (FileExistsError) once the whole analysis had run
    (tmp_path / "file").write_text("")
    assert main(["analyze", str(run_dir), *FAST, "--output", str(tmp_path / "file")]) == 2
    assert "is a file, not a folder" in _error(capsys)
    assert main(["analyze", str(run_dir), *FAST, "--output", str(tmp_path / "file" / "out")]) == 2
    assert "file" in _error(capsys)


def test_checkpoint_without_a_recurrent_core(run_dir, tmp_path, capsys):
    path = ckpt.resolve(shutil.copytree(run_dir, tmp_path / "run", symlinks=True))
    config = ckpt.read_json(path, "config.json")
    config["model"]["n_core"] = 0
    ckpt.write_json(path, "config.json", config)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["sha256"]["config.json"] = ckpt.file_sha256(path / "config.json")
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    assert main(["analyze", str(path)]) == 2
    assert "no recurrent core (n_core=0)" in _error(capsys)


def test_missing_checkpoint(tmp_path, capsys):
    assert main(["analyze", str(tmp_path / "nothing")]) == 2
    assert "no checkpoint folder" in _error(capsys)


@pytest.mark.parametrize(
    "horizon, depths", [(1, [1]), (3, [1, 3]), (5, [1, 5]), (8, [1, 5, 8]), (16, [1, 5, 16]), (32, [1, 5, 16, 32])]
)
def test_summary_labels_one_relative_change_per_value(horizon, depths):
    # `looplm analyze --horizon 8` printed "at r = 1, 5, 16, H:" with three values: r = 16 > H was
    # dropped from the values only.
    from looplm.analyze import format_summary

    median = [1.0 / r for r in range(1, horizon + 1)]  # a distinct value per depth
    report = {
        "model": {"injection": "parcae-nonorm"},
        "kv_settling": [],
        "carryover": {"note": "n/a"},
        "convergence": {
            "tokens": 10,
            "horizon": horizon,
            "tau": 0.01,
            "fraction_converged": 0.5,
            "median_depth": 2.0,
            "never": 5,
            "spearman_position_depth": 0.1,
            "intervals": [{"start": 0, "end": 8, "median_depth": 2.0}],
            "change": {"median": median},
        },
    }
    line = next(x for x in format_summary(report).splitlines() if "relative change (median)" in x)
    labels, values = line.split(" at r = ", 1)[1].split(": ", 1)
    labels, values = labels.split(", "), values.split(", ")
    assert len(labels) == len(values) == len(depths), line
    assert labels[-1] == f"H = {horizon}" and labels[:-1] == [str(r) for r in depths[:-1]], line
    assert values == [format(1.0 / r, ".3g") for r in depths], line


def test_progress_units_add_up_to_the_announced_work(run_dir):
    """The progress bar's total, `work_units`, is what `analyze` reports, with and without the
    sharing table."""
    from looplm.analyze.report import AnalyzeConfig, analyze
    from looplm.analyze.solves import SolveRule

    model, tokenizer, _ = ckpt.load_model(run_dir)
    data = ckpt.load_data(run_dir).validation(tokenizer)
    for sharing in (2, 0):
        cfg = AnalyzeConfig(
            horizon=3,
            sequences=3,
            batch_size=2,
            kv_depths=(2,),
            kv_span=1,
            solve_spans=3,
            solve_length=6,
            solve=SolveRule(max_depth=30),
            sharing_depths=(1, 2),
            sharing_sequences=sharing,
            plots=False,
        )
        units = []
        analysis = analyze(model, tokenizer, data, cfg, progress=lambda desc, n: units.append(n))
        assert sum(units) == cfg.work_units(len(data)) == 2 + 4 * 2 + (2 if sharing else 0)
        assert (analysis.report["sharing"] is None) == (sharing == 0)


class _Rows:
    """A stand-in held-out dataset: row i's tokens are all i (so a fake solve knows its rows)."""

    seq_len = 16

    def __len__(self):
        return 4

    def get_batch(self, idx):
        from types import SimpleNamespace

        t = torch.tensor(idx)[:, None].expand(-1, self.seq_len).clone()
        b = SimpleNamespace(inputs=t, doc_ids=t * 0, positions=t * 0 + torch.arange(self.seq_len), example_ids=t[:, 0])
        b.to = lambda device: b
        return b


def test_solve_summary_counts_qualified_rows_only(monkeypatch):
    """Depth statistics are
    over each solve's qualified rows, gap and KL over the rows where prefix, joint and frozen all
    qualified, the control's over those whose control qualified too; spans are cut to the rows' length."""
    from looplm.analyze import report as rep
    from looplm.analyze.report import AnalyzeConfig, solve_rows

    T, F = True, False
    per_row = {
        "prefix_qualified": [T, T, T, F],
        "prefix_depth": [10, 20, 40, -1],
        "joint_qualified": [T, T, F, T],
        "joint_depth": [12, 14, -1, 30],
        "frozen_qualified": [T, T, T, T],
        "frozen_depth": [5, 6, 7, 8],
        "control_qualified": [F, T, T, T],
        "gap": [1e-7, 3e-7, 0.5, 0.9],
        "kl": [1e-9, 3e-9, 0.2, 0.4],
        "control_gap": [0.7, 0.1, 0.3, 0.4],
        "control_kl": [0.8, 0.05, 0.3, 0.4],
    }
    widths = []

    def fake_span_solves(model, tokens, **kw):
        widths.append(tokens.shape[1])
        rows = tokens[:, 0].tolist()
        return {k: torch.tensor([v[i] for i in rows]) for k, v in per_row.items()}

    monkeypatch.setattr(rep, "span_solves", fake_span_solves)
    out = solve_rows(
        None, _Rows(), AnalyzeConfig(solve_spans=4, batch_size=3, solve_length=100), "cpu", lambda *a: None
    )
    assert widths == [16, 16] and out["spans"] == 4 and out["span_tokens"] == 16  # 100 > the rows' 16 tokens
    assert out["qualified"] == {"prefix": 3, "joint": 3, "frozen": 4, "control": 3} and out["qualified_pairs"] == 2
    assert out["median_depth"] == {"prefix": 20.0, "joint": 14.0, "frozen": 6.5}
    assert out["max_depth"] == {"prefix": 40.0, "joint": 30.0, "frozen": 8.0}
    assert out["gap"]["median"] == pytest.approx(2e-7) and out["gap"]["max"] == pytest.approx(3e-7)
    assert out["kl"]["median"] == pytest.approx(2e-9) and out["kl"]["max"] == pytest.approx(3e-9)
    assert out["control"]["spans"] == 1
    assert out["control"]["gap_median"] == pytest.approx(0.1) and out["control"]["kl_median"] == pytest.approx(0.05)


def test_solve_spans_are_the_rows_first_tokens(monkeypatch):
    """Guards the span cut: a span of `solve_length` tokens is the row's first tokens (positions 0..n-1)."""
    from looplm.analyze import report as rep
    from looplm.analyze.report import AnalyzeConfig, solve_rows

    seen = []

    def fake_span_solves(model, tokens, *, positions, **kw):
        seen.append(positions.clone())
        B = tokens.shape[0]
        flags, zeros = torch.ones(B, dtype=torch.bool), torch.zeros(B)
        out = {f"{n}_qualified": flags for n in ("prefix", "joint", "frozen", "control")}
        out.update({f"{n}_depth": zeros.long() for n in ("prefix", "joint", "frozen")})
        return out | {k: zeros for k in ("gap", "kl", "control_gap", "control_kl")}

    monkeypatch.setattr(rep, "span_solves", fake_span_solves)
    solve_rows(None, _Rows(), AnalyzeConfig(solve_spans=2, batch_size=2, solve_length=5), "cpu", lambda *a: None)
    assert len(seen) == 1 and torch.equal(seen[0], torch.arange(5).expand(2, 5))
