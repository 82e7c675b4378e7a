"""Staging folders of token caches and tokenized folders: a build deletes the ones that killed processes of
this host left behind (SIGKILL skips any cleanup), and keeps those of live processes and other hosts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from looplm.data import ByteTokenizer, build_datasets
from looplm.data.pretokenized import tokenize_corpus
from looplm.data.staging import _host, staging_folder


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def leftovers(parent: Path, name: str) -> dict[str, Path]:
    """Staging folders as a killed build (dead pid, this host), a running one (the test's parent process)
    and another host's would leave them, each with a file in it."""
    folders = {
        "killed": parent / f".{name}.tmp-{_host()}-{dead_pid()}-0a1b2c3d",
        "running": parent / f".{name}.tmp-{_host()}-{os.getppid()}-0a1b2c3d",
        "other host": parent / f".{name}.tmp-elsewhere-{dead_pid()}-0a1b2c3d",
    }
    for folder in folders.values():
        folder.mkdir(parents=True)
        (folder / "tokens.bin").write_bytes(b"\0" * 64)
    return folders


def test_a_new_staging_folder_deletes_only_what_ended_processes_of_this_host_left(tmp_path):
    old = leftovers(tmp_path, "cache-key")
    unrelated = leftovers(tmp_path, "other-key")
    new = staging_folder(tmp_path, "cache-key")
    assert new.is_dir() and not any(new.iterdir()) and new.name.startswith(f".cache-key.tmp-{_host()}-{os.getpid()}-")
    assert not old["killed"].exists()
    assert old["running"].is_dir() and old["other host"].is_dir()
    assert all(p.is_dir() for p in unrelated.values())
    assert staging_folder(tmp_path, "cache-key") != new and new.is_dir()  # its own process's folder is kept


def write_corpus(root: Path) -> Path:
    root.mkdir()
    for i in range(6):
        (root / f"doc{i}.txt").write_text(f"document {i} " * 20)
    return root


def test_a_token_cache_build_deletes_a_killed_builds_folder(tmp_path):
    """End to end: a build killed with SIGKILL mid-way leaves its staging folder; the next build of the same
    cache deletes it."""
    corpus = write_corpus(tmp_path / "corpus")
    cache = tmp_path / "cache"
    script = (
        "import os, signal, sys\n"
        "import looplm.data.packing as packing\n"
        "from looplm.data import ByteTokenizer, build_datasets\n"
        "def killed(*args, **kwargs):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "packing.write_splits = killed\n"
        "build_datasets(sys.argv[1], ByteTokenizer(), seq_len=8, cache_dir=sys.argv[2])\n"
    )
    run = subprocess.run([sys.executable, "-c", script, str(corpus), str(cache)], capture_output=True, text=True)
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert [p.name for p in cache.iterdir() if ".tmp-" in p.name], "the killed build left no staging folder"
    train, _ = build_datasets(str(corpus), ByteTokenizer(), seq_len=8, cache_dir=cache)
    assert [p.name for p in cache.iterdir()] == [train.cache_dir.parent.name]


def test_tokenize_corpus_deletes_a_killed_runs_folder(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    old = leftovers(tmp_path, "out")
    out = tokenize_corpus(corpus, tmp_path / "out", holdout=0.2, progress=False)
    assert (out / "pretokenized.json").is_file()
    assert not old["killed"].exists() and old["running"].is_dir() and old["other host"].is_dir()
