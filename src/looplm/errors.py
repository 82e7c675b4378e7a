"""The error a user can fix: a bad option, file, data source or checkpoint.

`looplm`'s command line prints a `UserError` as one line (`error: ...`, exit status 2) and
anything else as an internal error with a one-line summary (the traceback with `--debug`).
It is a `ValueError`, so code that catches ValueError keeps working.
"""


class UserError(ValueError):
    """Something the user can fix (an option, a file, a checkpoint); the message is one line."""


def install_hint(extra: str) -> str:
    """How to add the optional extra `extra`, written as README's Install section installs looplm (from its
    checkout, pinned by constraints.txt), so a hint never pulls a torch build the install avoided."""
    return f'pip install -c constraints.txt -e ".[{extra}]" in the looplm checkout (drop -c constraints.txt on a GPU install)'
