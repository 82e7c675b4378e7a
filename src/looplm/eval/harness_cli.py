"""`looplm-lm-eval`: lm-eval's command line (`lm_eval ...`, same arguments) with `--model looplm` registered.

The plain `lm_eval` script cannot import looplm's adapter by itself (lm-eval finds models only in modules
that were imported), so this script imports `looplm.eval.harness` first, then hands over to lm-eval:

    looplm-lm-eval --model looplm --model_args checkpoint=runs/tiny,depth=5 --tasks hellaswag

A looplm user error (a bad checkpoint or model_args) ends with one `error: ...` line and exit status 2.
"""

from __future__ import annotations

import sys

from looplm.errors import UserError, install_hint


def main() -> int:
    try:
        import looplm.eval.harness  # noqa: F401  (registers --model looplm)
        from lm_eval.__main__ import cli_evaluate
    except ImportError as err:
        print(f"error: looplm-lm-eval needs lm-eval ({err}): {install_hint('lm-eval')}", file=sys.stderr)
        return 2
    problem = _complete_run_arguments(sys.argv)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        cli_evaluate()
    except (UserError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # lm-eval's argparse errors and --help
        return exit_.code if isinstance(exit_.code, int) else 1
    return 0


def _given(args: list[str], *names: str) -> bool:
    """Whether an option of `names` is in `args`, as argparse reads them (`--opt=v`, `-ov`, or a long
    option's unambiguous prefix such as `--task`)."""
    for arg in args:
        flag = arg.split("=", 1)[0]
        for name in names:
            if name.startswith("--") and len(flag) > 2 and name.startswith(flag):
                return True
            if not name.startswith("--") and arg.startswith(name):
                return True
    return False


def _complete_run_arguments(argv: list[str]) -> str | None:
    """Add `--device auto` to an evaluation run (lm-eval's default device is cuda:0; looplm's, CUDA when
    available), in place; return why the run cannot start, or None. lm-eval's own subcommands (`ls tasks`,
    `validate`) and help pass through untouched: lm-eval takes arguments before a subcommand as a legacy
    `run`, so an inserted `--device` would turn `ls tasks` into a run."""
    args = argv[1:]
    if not args or args[0] in ("ls", "validate", "-h", "--help"):
        return None
    at = 2 if args[0] == "run" else 1  # where the run's own arguments start in argv
    run_args = argv[at:]
    if _given(run_args, "-h", "--help"):
        return None
    if not _given(run_args, "--tasks", "-t", "--config", "-C"):
        return "looplm-lm-eval needs --tasks (for example --tasks hellaswag; `looplm-lm-eval ls tasks` lists them)"
    if not _given(run_args, "--device"):
        argv[at:at] = ["--device", "auto"]
    return None


if __name__ == "__main__":
    sys.exit(main())
