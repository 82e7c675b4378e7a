"""What the command line says: install hints, option suggestions, positional paths after options."""

from __future__ import annotations

import sys

import pytest
from test_cli import assert_clean_exit, run_main

README_EXTRA = 'pip install -c constraints.txt -e ".[{}]"'  # README's Install section, with an extra


def test_a_missing_extra_names_readmes_install_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "looplm.hf", None)  # `from looplm.hf import ...` raises ImportError
    rc, _, err = run_main(["export", tmp_path / "run", tmp_path / "hf"], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert README_EXTRA.format("hf") in err, err


def test_a_hub_source_without_datasets_names_readmes_install_command(monkeypatch):
    from looplm.data.sources import DataError, _iter_hf

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=README_EXTRA.format("datasets").replace("[", r"\[").replace(".", r"\.")):
        next(_iter_hf("hf:nothing", "text"))


@pytest.mark.parametrize(
    ("argv", "wanted", "help_for"),
    [
        (["train", "tiny", "--steps", "40"], "unrecognized option --steps (did you mean --train.steps?)", "train tiny"),
        (
            ["train", "tiny", "--train.stpes", "3"],
            "unrecognized option --train.stpes (did you mean --train.steps",
            "train tiny",
        ),
        (
            ["eval", "run", "--max-sequence", "3"],
            "unrecognized option --max-sequence (did you mean --max-sequences?)",
            "eval",
        ),
        (["eval", "run", "--depth", "3"], "unrecognized option --depth (did you mean --depths", "eval"),
        (
            ["distill", "run", "--train.steps", "3"],
            "unrecognized option --train.steps (did you mean --steps?)",
            "distill",
        ),
    ],
)
def test_option_suggestions_belong_to_the_command(argv, wanted, help_for, capsys):
    """tyro suggests options of every subcommand; only the command's own are named, those with the same
    leaf name (`steps` of --train.steps) first."""
    rc, out, err = run_main(argv, capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert wanted in err, err
    for foreign in ("--eval.max-sequences", "--max-seq-len", "--num-steps", "--control-depth", "applied to"):
        assert foreign not in err, err
    assert err.rstrip().endswith(f"; see looplm {help_for} --help"), err


def test_a_path_after_a_several_value_option_is_named(tmp_path, capsys):
    """tyro reads every value after --prompt up to the next option, the checkpoint path included."""
    run = tmp_path / "runs" / "tiny"
    run.mkdir(parents=True)
    rc, _, err = run_main(["generate", "--prompt", "hi", str(run), "--depth", "3"], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert "missing required input for looplm generate: PATH" in err, err
    assert f"--prompt took {str(run)!r} as one of its values: put PATH first" in err, err
    rc, _, err = run_main(["eval", "--depths", "1", "2", "--max-sequences", "2"], capsys)
    assert "missing required input for looplm eval: PATH" in err and "took" not in err, err


def test_an_option_before_its_subcommand_is_told_where_it_goes(capsys):
    rc, _, err = run_main(["train", "--train.steps", "3", "tiny"], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert (
        "unrecognized option --train.steps (an option of looplm train L|M|S|tiny: give it after the subcommand's name)"
        in err
    ), err
    assert "ordering can matter" not in err


def test_a_single_value_option_before_a_missing_positional_is_not_blamed(capsys):
    """Only an option that read on past its first value (--prompt A PATH) took the path; --output PATH is
    one value, so the missing checkpoint is said alone."""
    rc, _, err = run_main(["eval", "--output", "reports/eval.json"], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert "missing required input for looplm eval: PATH" in err and "took" not in err, err


def test_a_mix_of_a_word_and_an_option_lists_the_subcommands(capsys):
    """An unknown word among the tokens (a misspelt preset) lists the subcommands, even beside an unknown option."""
    rc, _, err = run_main(["train", "XL", "--bogus"], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert "XL" in err and "; available subcommands: tiny, S, M, L" in err, err


def test_a_positional_is_never_suggested_as_an_option(capsys):
    """`--checkpoint` is no option of eval (the checkpoint is positional): no `did you mean --checkpoint?`,
    and an option spelt like one of eval's own is still suggested beside it."""
    rc, _, err = run_main(["eval", "run", "--checkpoint", "x", "--max-sequence", "2"], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert "--checkpoint, --max-sequence (did you mean --max-sequences?)" in err, err
    assert "did you mean --checkpoint" not in err, err


def test_a_path_after_an_option_given_with_equals_is_named(tmp_path, capsys):
    """tyro reads on past `--prompt=hi` just as past `--prompt hi` (`--prompt=hi a x/y --depth 3` makes the
    prompts hi, a and x/y), so the missing checkpoint is said with the option that took it."""
    run = tmp_path / "runs" / "tiny"
    run.mkdir(parents=True)
    rc, _, err = run_main(["generate", "--prompt=hi", str(run), "--depth", "3"], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert "missing required input for looplm generate: PATH" in err, err
    assert f"--prompt took {str(run)!r} as one of its values: put PATH first" in err, err


@pytest.mark.parametrize("given", [["--num-steps", "4"], ["--num-steps=4"]])
def test_a_path_that_went_to_a_positional_is_not_said_to_be_an_options(tmp_path, capsys, given):
    """`export --num-steps 4 CHECKPOINT` lacks OUT: tyro gives --num-steps its one value and the path to the
    checkpoint, so no option took it and the missing output is said alone."""
    run = tmp_path / "runs" / "tiny"
    run.mkdir(parents=True)
    rc, _, err = run_main(["export", *given, str(run)], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert "missing required input for looplm export: OUT" in err and "took" not in err, err
