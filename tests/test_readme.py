"""The README's commands, as a reader would type them.

Every `looplm ...` command of the README's bash blocks (and the `looplm.cli` part of its `torchrun`
lines) is taken from the file itself. The `generate`, `eval`, `analyze`, `export` and `serve` commands
on `runs/...` and `out/hf` run, on random tiny models standing in for the README's runs (`runs/tiny`:
text, `runs/tasks` and `runs/tiny2k`: the task generator) and on small files at the README's
`path/to/...` placeholders; options that only set how much work is done are appended in smaller
sizes (the README's own options are parsed and used, and later options win). The `distill` command
that makes `runs/distill2k` runs with a few steps. Training lines, and commands on released
checkpoints (`ckpt/...`) or on your own data, are parsed only: the parser must accept them.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from _jobs import write_random_run

import looplm.cli as cli

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread

README = Path(__file__).resolve().parents[1] / "README.md"
RUNNABLE = {"generate", "eval", "analyze", "export", "serve"}
# Appended options that shrink the work of a command (argparse: the last value wins).
SMALLER = {
    "eval": [
        "--max-sequences",
        "2",
        "--task-examples",
        "8",
        "--sharing-sequences",
        "2",
        "--generation-examples",
        "4",
        "--depths",  # the README's sweeps reach R = 64 (three sharing protocols at each depth)
        "1",
        "3",
        "--device",
        "cpu",
    ],
    "analyze": [
        "--sequences",
        "2",
        "--horizon",
        "6",
        "--kv-depths",
        "2",
        "--solve-spans",
        "1",
        "--solve-length",
        "8",
        "--sharing-sequences",
        "1",
        "--sharing-depths",
        "2",
        "--no-plots",
        "--device",
        "cpu",
    ],
    "generate": [
        "--device",
        "cpu",
        "--no-compile",
        "--max-new-tokens",
        "24",
    ],  # compiling changes speed, not text (tests/test_infer_step.py)
    "serve": [
        "--device",
        "cpu",
        "--port",
        "0",
        "--no-compile",
    ],  # looplm serve binds its port before serving: any free one
    "distill": [
        "--steps",
        "2",
        "--micro-batch",
        "4",
        "--calibration-rows",
        "4",
        "--val-rows",
        "2",
        "--val-every",
        "0",
        "--report-rows",
        "2",
        "--report-examples",
        "4",
        "--device",
        "cpu",
    ],
}


def readme_commands() -> list[list[str]]:
    """The argv (after `looplm`) of every looplm command in the README's bash blocks, in order."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&")  # quotes kept, `;` and `&&` split
            lexer.whitespace_split = True
            parts: list[list[str]] = [[]]
            for word in lexer:
                parts.append([]) if word in (";", "&&") else parts[-1].append(word)
            for words in parts:
                if words[:1] == ["looplm"]:
                    commands.append(words[1:])
                elif "looplm.cli" in words and words[:1] == ["torchrun"]:
                    commands.append(words[words.index("looplm.cli") + 1 :])
    return commands


def outputs(argv: list[str]) -> set[str]:
    """Paths a command writes (not inputs that must exist)."""
    out = {argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--output", "--out-dir", "--train.out-dir")}
    if argv[0] == "export":
        out.add([a for a in argv[1:] if not a.startswith("-")][1])
    return out


def runnable(argv: list[str]) -> bool:
    if "--help" in argv:
        return True
    if argv[0] not in RUNNABLE and argv[:2] != ["distill", "runs/tiny2k"]:
        return False
    paths = [a for a in argv[1:] if "/" in a and not a.startswith("-") and a not in outputs(argv)]
    return all(Path(p).exists() for p in paths)


@pytest.fixture
def readme_world(tmp_path, monkeypatch):
    """The working folder of the README's commands: its runs and the files its placeholders name."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOOPLM_DEBUG", raising=False)
    write_random_run(tmp_path / "runs" / "tiny", data__source="shakespeare", model__max_seq_len=256)
    write_random_run(tmp_path / "runs" / "tasks")
    shutil.copytree(tmp_path / "runs" / "tasks", tmp_path / "runs" / "tiny2k")
    texts = tmp_path / "path" / "to" / "texts"
    texts.mkdir(parents=True)
    for i in range(24):
        (texts / f"{i:02d}.txt").write_text(f"A short held-out scene, number {i}.\nROMEO. Speak again.\n" * 3)
    (tmp_path / "path" / "to" / "choices.jsonl").write_text(
        '{"context": "+1,2=", "choices": ["3", "4"], "gold": 0}\n{"context": "+2,2=", "choices": ["4", "5"], "gold": 0}\n'
    )
    (tmp_path / "path" / "to" / "gsm8k_test.jsonl").write_text('{"question": "1+1?", "answer": "so #### 2"}\n')
    return tmp_path


def serve_once(monkeypatch, served: list):
    """`uvicorn.Server.run` replaced by one request to the server's app (the socket `looplm serve` bound is
    closed by it, unused)."""
    uvicorn = pytest.importorskip("uvicorn")
    from fastapi.testclient import TestClient

    def run(server, sockets=None):
        with TestClient(server.config.app) as client:
            served.append(client.post("/v1/completions", json={"prompt": "ROMEO.\n", "max_tokens": 4}).json())

    monkeypatch.setattr(uvicorn.Server, "run", run)


@pytest.mark.slow
def test_readme_examples(readme_world, monkeypatch, capsys):
    commands = readme_commands()
    assert len(commands) > 40
    ran, parsed, served = [], [], []
    stubs = {
        name: functools.wraps(fn)(lambda *a, _name=name, **k: parsed.append(_name))
        for name, fn in cli._SUBCOMMANDS.items()
    }
    for argv in commands:
        if runnable(argv):
            if argv[0] == "export":
                pytest.importorskip("transformers")
            if argv[0] == "serve":
                serve_once(monkeypatch, served)
            try:
                rc = cli.main(argv + ([] if "--help" in argv else SMALLER.get(argv[0], [])))
            except SystemExit as exit_:  # --help
                rc = exit_.code
            out, err = capsys.readouterr()
            assert rc == 0, (argv, err[-2000:])
            ran.append(argv)
            if argv[:2] == ["generate", "runs/tiny"]:
                prompt = argv[argv.index("--prompt") + 1]
                assert out.startswith(prompt) and len(out.rstrip("\n")) > len(prompt), out
        else:
            with monkeypatch.context() as m:
                m.setattr(cli, "_SUBCOMMANDS", stubs)
                rc = cli.main(argv)
            out, err = capsys.readouterr()
            assert rc == 0 and parsed, (argv, err[-2000:])
            parsed.clear()
    names = {tuple(a[:2]) for a in ran}
    for need in [
        ("eval", "runs/tasks"),
        ("eval", "runs/tiny"),
        ("generate", "runs/tiny"),
        ("generate", "runs/tasks"),
        ("analyze", "runs/tiny"),
        ("serve", "runs/tiny"),
        ("distill", "runs/tiny2k"),
        ("generate", "runs/tiny2k"),
        ("eval", "runs/tiny2k"),
        ("export", "runs/tiny"),
    ]:
        assert need in names, need
    assert served and served[0]["choices"][0]["text"] is not None
    assert (readme_world / "out" / "hf" / "config.json").is_file()
    assert json.loads((readme_world / "runs" / "tasks" / "eval.json").read_text())["choice"]
    assert (readme_world / "runs" / "tiny" / "analyze-tau0.01" / "report.json").is_file()
    assert torch.get_num_threads() == 1  # analyze restored the thread count it changed
