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
    if not any(a == "--device" or a.startswith("--device=") for a in sys.argv[1:]):
        sys.argv[1:1] = ["--device", "auto"]  # lm-eval's default is cuda:0; looplm's, CUDA when available
    try:
        cli_evaluate()
    except (UserError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # lm-eval's argparse errors and --help
        return exit_.code if isinstance(exit_.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
