"""Staging folders: a token cache or tokenized folder is written into `.NAME.tmp-HOST-PID-RAND` beside its
final place and renamed into place when complete, so readers never see half of one.

A process killed hard (SIGKILL, out of memory, a lost node) cannot delete its staging folder, and such a
folder can hold gigabytes of tokens. Each new build of the same NAME therefore first deletes the staging
folders of NAME left by processes of this host that are no longer running. Folders of other hosts (a
shared file system) and of live processes are left alone: they may still be written.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
from pathlib import Path

__all__ = ["staging_folder"]


def _host() -> str:
    return "".join(c if c.isalnum() or c == "-" else "_" for c in socket.gethostname()) or "host"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _abandoned(folder: Path, prefix: str, host: str) -> bool:
    owner = folder.name[len(prefix) :].rsplit("-", 2)
    if len(owner) != 3 or owner[0] != host or not owner[1].isdigit():
        return False
    return int(owner[1]) != os.getpid() and not _running(int(owner[1]))


def staging_folder(parent: Path, name: str) -> Path:
    """A new empty folder in `parent` to build `parent / name` in, after deleting the staging folders of
    `name` that ended processes of this host left behind. The folder gets the default mode (not
    `tempfile.mkdtemp`'s 0700, which would carry over to the published folder)."""
    parent.mkdir(parents=True, exist_ok=True)
    prefix, host = f".{name}.tmp-", _host()
    for old in parent.glob(f"{prefix}*"):
        if old.is_dir() and _abandoned(old, prefix, host):
            shutil.rmtree(old, ignore_errors=True)
    folder = parent / f"{prefix}{host}-{os.getpid()}-{secrets.token_hex(4)}"
    folder.mkdir()
    return folder
