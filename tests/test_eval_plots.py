"""The run folder's pictures: held-out perplexity and dstate against depth R, and the loss curve."""

from __future__ import annotations

import json

import matplotlib.image
import pytest
from _jobs import shared_cache, tiny_flags, write_random_run
from test_cli import run_main

pytestmark = pytest.mark.usefixtures("single_thread")
PNG = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    assert path.read_bytes()[:8] == PNG, path
    height, width, _ = matplotlib.image.imread(path).shape
    assert height > 100 and width > 100


def test_the_depth_series_are_the_reports_numbers(tmp_path, capsys):
    from looplm.eval.plots import depth_series

    run = write_random_run(tmp_path / "run", data__source="shakespeare")
    rc, _, err = run_main(
        ["eval", run, "--depths", "3", "1", "2", "--max-sequences", "2", "--sharing-sequences", "0", "--device", "cpu"],
        capsys,
    )
    assert rc == 0, err
    report = json.loads((run / "eval.json").read_text())  # keys are strings once written
    series = depth_series(report)
    assert series["depth"] == [1, 2, 3]
    assert series["ppl"] == [report["perplexity"][str(r)]["ppl"] for r in (1, 2, 3)]
    assert series["state_change"] == [report["perplexity"][str(r)]["state_change"] for r in (1, 2, 3)]
    assert_png(run / "ppl_vs_depth.png")
    assert not (run / "loss.png").exists()  # no metrics.jsonl: nothing to draw


def test_the_loss_series_are_the_metrics_records(tmp_path):
    from looplm.eval.plots import loss_series, write_loss_plot

    records = [
        {"step": 1, "loss": 5.0},
        {"step": 2, "loss": 4.0},
        {"step": 2, "val_loss": 4.5, "val_ppl": 90.0},
        {"step": 3, "loss": 9.0},
        {"step": 3, "loss": 3.0},
    ]  # step 3 logged again after a resume: the last wins
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    series = loss_series(tmp_path / "metrics.jsonl")
    assert series == {"step": [1, 2, 3], "loss": [5.0, 4.0, 3.0], "val_step": [2], "val_loss": [4.5]}
    assert_png(write_loss_plot(series, tmp_path / "loss.png"))


def test_train_writes_both_pictures_into_the_run_folder(tmp_path, tmp_path_factory, capsys):
    flags = tiny_flags(tmp_path, "run", cache=shared_cache(tmp_path_factory), train__steps=2)
    rc, out, err = run_main(["train", "tiny", *flags], capsys)
    assert rc == 0, err
    for name in ("ppl_vs_depth.png", "loss.png"):
        assert_png(tmp_path / "run" / name)
        assert str(tmp_path / "run" / name) in out
