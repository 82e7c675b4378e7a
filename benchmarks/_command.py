"""How a benchmark records the command that produced its result: as run from the repository root,
with paths inside the repository written relative to it, so that a result names no folder of the
machine it ran on (`/home/...`, a worktree) but a command anyone can rerun from a checkout.

Scripts in benchmarks/ import it as `from _command import command_line` (benchmarks/ is on sys.path
when a script there runs). Paths outside the repository (e.g. `--out /tmp/x.json`) stay as given.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(os.path.realpath(Path(__file__).resolve().parents[1]))


def relative(arg) -> str:
    """`arg` as a string; an absolute path inside the repository (also as `--opt=PATH`) relative to its root."""
    arg = str(arg)
    if arg.startswith("-") and "=" in arg:
        opt, _, value = arg.partition("=")
        return f"{opt}={relative(value)}"
    if os.path.isabs(arg):
        try:
            return Path(os.path.realpath(arg)).relative_to(ROOT).as_posix()
        except ValueError:
            return arg
    return arg


def join(args) -> str:
    """A shell command line of `args`, repository paths relative to the root."""
    return shlex.join([relative(a) for a in args])


def command_line(argv: list[str] | None = None, python: str = "python") -> str:
    """`python SCRIPT ARGS...` for this process (`argv`: sys.argv), the script's path relative to the
    repository root wherever it was started from."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        argv[0] = os.path.abspath(argv[0])
    return join([python, *argv])


def machine_line(threads: int) -> str:
    """Where a CPU result was measured: architecture, cores, torch version, torch threads."""
    import torch

    return f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {threads} thread(s)"
