"""Progress bars suit where stderr goes (off when it is not a terminal), and the eval bar counts work by depth."""

from __future__ import annotations

import pytest
from _jobs import write_random_run
from test_cli import run_main

import looplm.cli as cli

pytestmark = pytest.mark.usefixtures("single_thread")


def test_bars_are_off_when_stderr_is_not_a_terminal(capsys):
    bar = cli._progress(10, "eval")  # pytest's captured stderr is not a terminal
    assert bar.disable
    bar.close()


@pytest.mark.parametrize("source", ["shakespeare", "tasks"])
def test_the_eval_bar_advances_by_depth(tmp_path, monkeypatch, capsys, source):
    """A batch at depth R costs about R times a batch at depth 1: the bar's units are recurrences, and it
    ends at its total (the task generator's held-out examples are those left once the training prompts
    are dropped, fewer than asked for)."""
    seen = {}

    class Bar:
        def __init__(self, total, desc, disable=False, unit="batch"):
            seen["total"], seen["updates"] = total, []

        def update(self, n):
            seen["updates"].append(n)

        def close(self):
            pass

    monkeypatch.setattr(cli, "_progress", Bar)
    run = write_random_run(tmp_path / "run", data__source=source, data__n_task_examples=3000)
    rc, _, err = run_main(
        [
            "eval",
            run,
            "--depths",
            "1",
            "4",
            "--max-sequences",
            "4",
            "--batch-size",
            "2",
            "--sharing-sequences",
            "2",
            "--task-examples",
            "40",
            "--device",
            "cpu",
        ],
        capsys,
    )
    assert rc == 0, err
    assert sorted(set(seen["updates"])) == [1, 4]
    assert sum(seen["updates"]) == seen["total"]
    if source == "shakespeare":
        assert seen["total"] == (1 + 4) * (2 + 1)  # 2 perplexity batches + 1 sharing, per depth


def test_training_progress_off_a_terminal_is_plain_lines(capsys):
    """With stderr not a terminal (nohup, CI) the trainer's progress is a line now and then, never a
    carriage-return bar."""
    from looplm.train.progress import LineProgress, progress_bar

    bar = progress_bar(4, 0, "train")  # pytest's captured stderr is not a terminal
    assert isinstance(bar, LineProgress)
    bar.every_s = 0.0
    for i in range(4):
        bar.set_postfix(loss=f"{1.0 / (i + 1):.3f}")
        bar.update(1)
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines() == [f"train: step {n}/4 ({25 * n}%), loss={1.0 / n:.3f}" for n in range(1, 5)]
