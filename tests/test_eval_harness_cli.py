"""`looplm-lm-eval`: lm-eval's own command line with `--model looplm` registered (the plain `lm_eval` cannot
import looplm's adapter by itself), on a local task; unknown model_args are refused by name."""

from __future__ import annotations

import json
import sys

import pytest
from _jobs import write_choice_task, write_random_run

pytest.importorskip("lm_eval", reason="optional extra: lm-eval")
pytestmark = pytest.mark.usefixtures("single_thread")


def run_script(monkeypatch, capsys, *args):
    import lm_eval.tasks

    from looplm.eval.harness_cli import main

    class LocalTasks(lm_eval.tasks.TaskManager):
        """lm-eval's task index without its built-in tasks (indexing their YAML files costs ~10 s)."""

        def __init__(self, *args, include_defaults=False, **kwargs):
            super().__init__(*args, include_defaults=include_defaults, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTasks)
    monkeypatch.setattr(sys, "argv", ["looplm-lm-eval", *map(str, args)])
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rc = main()
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.slow
def test_the_script_runs_lm_eval_with_the_looplm_model(tmp_path, monkeypatch, capsys):
    run = write_random_run(tmp_path / "run")
    write_choice_task(
        tmp_path,
        [
            {"context": "+1,2=", "choices": ["3", "4"], "gold": 0},
            {"context": "+2,2=", "choices": ["4", "5", "6"], "gold": 0},
        ],
    )
    rc, out, err = run_script(
        monkeypatch,
        capsys,
        "--model",
        "looplm",
        "--model_args",
        f"checkpoint={run},depth=2",
        "--tasks",
        "looplm_choice",
        "--include_path",
        tmp_path,
        "--output_path",
        tmp_path / "out",
    )
    assert rc == 0, err[-3000:]
    assert "looplm_choice" in out
    results = [json.loads(p.read_text()) for p in (tmp_path / "out").rglob("results*.json")]
    assert results and "acc,none" in results[0]["results"]["looplm_choice"]


def test_unknown_model_args_are_refused_by_name():
    from looplm.eval.harness import LoopLMHarness

    with pytest.raises(ValueError, match=r"unknown model_args: dept, cach \(known: checkpoint, depth"):
        LoopLMHarness.create_from_arg_string("checkpoint=x,dept=3,cach=full", {"batch_size": 1})


def test_the_script_ends_a_user_error_in_one_line(monkeypatch, capsys):
    """A looplm error raised inside lm-eval's run (here the adapter's refusal of a misspelt model_arg,
    raised where lm-eval would build the model) ends with one `error:` line and status 2; lm-eval
    itself is stood in for, so no task index is built (the end-to-end run is the test above)."""
    import lm_eval.__main__

    from looplm.eval.harness import LoopLMHarness

    def fake_cli_evaluate():
        assert sys.argv[1:3] == ["--device", "auto"]  # lm-eval's own default would be cuda:0
        LoopLMHarness.create_from_arg_string("checkpoint=x,dept=3", {"batch_size": 1})

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", fake_cli_evaluate)
    rc, _, err = run_script(
        monkeypatch, capsys, "--model", "looplm", "--model_args", "checkpoint=x,dept=3", "--tasks", "x"
    )
    assert rc == 2 and err.strip().splitlines() == [err.strip().splitlines()[-1]], err
    assert err.strip().startswith("error: unknown model_args: dept"), err


@pytest.mark.parametrize(
    "given",
    [
        ["--model_args", "checkpoint=x,device=cpu"],
        ["--model_args=device=cpu,depth=3"],
        ["--model_args", "checkpoint=x", "device=cpu"],  # lm-eval takes several words (nargs="+")
        ["-a", "checkpoint=x,device=cpu"],
        ["--model_args", '{"checkpoint": "x", "device": "cpu"}'],  # and JSON
    ],
)
def test_a_device_in_model_args_is_refused_in_one_line(tmp_path, monkeypatch, capsys, given):
    """lm-eval passes its own --device to the model as `device=`: one given in --model_args too, in any of
    lm-eval's spellings, ended in Python's "got multiple values for keyword argument 'device'" traceback."""
    write_choice_task(tmp_path, [{"context": "+1,2=", "choices": ["3", "4"], "gold": 0}])
    args = ["--model", "looplm", *given, "--tasks", "looplm_choice", "--include_path", tmp_path]
    rc, _, err = run_script(monkeypatch, capsys, *args)
    assert rc == 2 and err.strip().splitlines()[-1] == (
        "error: give the device as --device (lm-eval's option), not in --model_args"
    ), err[-3000:]


@pytest.mark.parametrize(
    ("given", "handed_over"),
    [
        # lm-eval's own subcommands and help pass through as typed: an inserted --device made `ls tasks` a
        # legacy `run` that failed with "unrecognized arguments: ls tasks"
        (["ls", "tasks"], ["ls", "tasks"]),
        (["validate", "--tasks", "x"], ["validate", "--tasks", "x"]),
        (["--help"], ["--help"]),
        (["run", "-h"], ["run", "-h"]),
        # a run gets looplm's device default, after `run` when the subcommand is named
        (
            ["run", "--model", "looplm", "--tasks", "x"],
            ["run", "--device", "auto", "--model", "looplm", "--tasks", "x"],
        ),
        (["--model", "looplm", "-t", "x"], ["--device", "auto", "--model", "looplm", "-t", "x"]),
        (["--model", "looplm", "--task=x", "--device", "cpu"], ["--model", "looplm", "--task=x", "--device", "cpu"]),
        (["--config", "c.yaml"], ["--device", "auto", "--config", "c.yaml"]),
    ],
)
def test_lm_evals_subcommands_pass_through_and_runs_get_the_device(monkeypatch, capsys, given, handed_over):
    import lm_eval.__main__

    seen = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.append(sys.argv[1:]))
    rc, _, err = run_script(monkeypatch, capsys, *given)
    assert rc == 0 and seen == [handed_over], err


def test_a_run_without_tasks_is_refused_in_one_line(monkeypatch, capsys):
    """lm-eval itself ended such a run in a ValueError traceback, with exit status 0."""
    import lm_eval.__main__

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: pytest.fail("lm-eval was started"))
    rc, _, err = run_script(monkeypatch, capsys, "--model", "looplm", "--model_args", "checkpoint=x")
    assert rc == 2 and err.strip().splitlines() == [
        "error: looplm-lm-eval needs --tasks (for example --tasks hellaswag; `looplm-lm-eval ls tasks` lists them)"
    ], err
