"""`looplm train` / `looplm eval`: end to end, kill-and-resume, and one-line errors on bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from _jobs import (
    error_line,
    looplm_cmd,
    one_thread,
    run_main,
    shared_cache,
    step_records,
    subprocess_env,
    tiny_flags,
    tiny_job,
)

from looplm import checkpoint as ckpt
from looplm.cli import main
from looplm.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread

CLI_TIMEOUT = 300


@pytest.fixture
def cache(tmp_path_factory):
    return shared_cache(tmp_path_factory)


def looplm(*args, timeout=CLI_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(
        looplm_cmd(*map(str, args)), env=subprocess_env(), capture_output=True, text=True, timeout=timeout
    )


def table_depths(text: str) -> list[int]:
    """Depths R of the rows of a printed depth report (`   R   val ppl ...`)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\s*R\s+val ppl", line))
    rows = []
    for line in lines[start + 2 :]:
        m = re.match(r"\s*(\d+)\s+(\d+\.\d+)", line)
        if not m:
            break
        rows.append(int(m.group(1)))
    return rows


def printed_path(stdout: str, label: str) -> Path:
    m = re.search(rf"^{label}:\s+(\S+)", stdout, re.M)
    assert m, f"no '{label}:' line in\n{stdout}"
    return Path(m.group(1))


def assert_clean_exit(rc, err, *, looplm_error: bool):
    """Non-zero exit, no traceback; looplm's own errors end stderr with one line `error: ...`."""
    assert rc == 2, (rc, err)
    assert "Traceback" not in err, err
    if looplm_error:
        error_line(err)


# -- end to end ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_train_then_eval_end_to_end(tmp_path, cache, capsys):
    flags = tiny_flags(tmp_path, "run", cache=cache)
    res = looplm("train", "tiny", *flags, "--eval.depths", 1, 2, "--eval.task-examples", 20)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "Traceback" not in res.stderr
    out = res.stdout
    assert "trained 8 steps" in out
    assert table_depths(out) == [1, 2]
    assert re.search(r"R\s+val ppl\s+(bits/byte\s+)?dstate\s+acc", out)  # state change and task accuracy columns
    checkpoint, metrics = printed_path(out, "checkpoint"), printed_path(out, "metrics")
    assert checkpoint == tmp_path / "run" / "checkpoints" / "step_0000008"
    ckpt.verify(checkpoint)
    assert metrics == tmp_path / "run" / "metrics.jsonl" and metrics.is_file()
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert sorted(report["perplexity"]) == ["1", "2"]

    records = step_records(tmp_path / "run")
    assert sorted(records) == list(range(1, 9))
    for r in records.values():
        for key in ("loss", "tokens_per_s", "depths", "model_tflops_per_s"):
            assert key in r, key
        assert len(r["depths"]) == 2 and r["tokens_per_s"] > 0 and r["model_tflops_per_s"] > 0

    rc, out, err = run_main(["eval", tmp_path / "run", "--depths", 1, 3], capsys)  # in-process: the script ran above
    assert rc == 0, err[-4000:]
    assert table_depths(out) == [1, 3]
    out_json = tmp_path / "run" / "eval.json"  # default: next to the run's checkpoints
    assert printed_path(out, "report") == out_json
    report = json.loads(out_json.read_text())
    assert sorted(report["perplexity"]) == ["1", "3"]
    assert sorted(report["tasks"]) == ["1", "3"]
    for r in report["perplexity"].values():
        assert r["ppl"] > 1 and r["tokens"] > 0


# -- a real kill --------------------------------------------------------------------------------
def latest_step(run: Path) -> int:
    try:
        return int((run / "checkpoints" / "latest").read_text().strip().split("_")[1])
    except (FileNotFoundError, IndexError, ValueError):
        return -1


def logged_steps(run: Path) -> list[int]:
    try:
        text = (run / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line)["step"] for line in text.splitlines() if line.endswith("}")]


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path, cache):
    steps = 20
    common = dict(cache=cache, train__steps=steps, train__checkpoint_every=2, eval__depths=())
    victim_flags = tiny_flags(tmp_path, "victim", **common)
    victim_dir, reference_dir = tmp_path / "victim", tmp_path / "reference"
    env = subprocess_env()
    with open(tmp_path / "victim.log", "w") as vlog, open(tmp_path / "reference.log", "w") as rlog:
        # the uninterrupted reference runs alongside the victim (one thread each)
        reference = subprocess.Popen(
            looplm_cmd("train", "tiny", *tiny_flags(tmp_path, "reference", **common)),
            env=env,
            stdout=rlog,
            stderr=subprocess.STDOUT,
        )
        victim = subprocess.Popen(
            looplm_cmd("train", "tiny", *victim_flags), env=env, stdout=vlog, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + CLI_TIMEOUT
            # kill once a checkpoint at step >= 2 exists and training has moved past it
            while not (
                latest_step(victim_dir) >= 2 and max(logged_steps(victim_dir), default=0) > latest_step(victim_dir)
            ):
                assert victim.poll() is None, (
                    f"run ended (rc {victim.returncode}) before it could be killed:\n{(tmp_path / 'victim.log').read_text()}"
                )
                assert time.monotonic() < deadline, "no checkpoint appeared"
                time.sleep(0.01)
            os.kill(victim.pid, signal.SIGKILL)
            assert victim.wait(timeout=60) == -signal.SIGKILL
        finally:
            if victim.poll() is None:
                victim.kill()
        killed_at = latest_step(victim_dir)
        assert 2 <= killed_at < steps
        assert max(logged_steps(victim_dir)) > killed_at  # records past the checkpoint are dropped on resume

        res = looplm("train", "tiny", *victim_flags, "--train.resume")
        assert res.returncode == 0, res.stderr[-4000:]
        assert reference.wait(timeout=CLI_TIMEOUT) == 0, (tmp_path / "reference.log").read_text()[-4000:]

    assert logged_steps(victim_dir) == list(range(1, steps + 1))  # no gaps or repeats
    got, want = step_records(victim_dir), step_records(reference_dir)
    assert {s: r["loss"] for s, r in got.items()} == {s: r["loss"] for s, r in want.items()}  # exact
    assert {s: r["depths"] for s, r in got.items()} == {s: r["depths"] for s, r in want.items()}
    a = ckpt.load_tensors(ckpt.resolve(victim_dir), "model.safetensors")
    b = ckpt.load_tensors(ckpt.resolve(reference_dir), "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not [p.name for p in (victim_dir / "checkpoints").iterdir() if p.name.startswith(".tmp")]


# -- bad input ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A finished 2-step run made with the same settings as `tiny_flags(root, "run", steps=2)`."""
    root = tmp_path_factory.mktemp("cli-run")
    with one_thread():
        Trainer(tiny_job(root, "run", cache=shared_cache(tmp_path_factory), train__steps=2)).fit()
    return root


BOX_DRAWING = set("╭╮╰╯│─")


@pytest.mark.parametrize(
    ("argv", "message", "help_for"),
    [
        (
            ["train", "tiny", "--train.stpes", "3"],
            "error: unrecognized option --train.stpes (did you mean --train.steps",
            "train tiny",
        ),
        (
            ["train", "tiny", "--train.steps", "abc"],
            "error: invalid value for --train.steps (expects INT): invalid literal for int() with base 10: 'abc'",
            "train tiny",
        ),
        (
            ["train", "tiny", "--train.bogus", "1", "--model.injectoin", "x"],
            "unrecognized options --train.bogus, --model.injectoin (did you mean --model.injection?)",
            "train tiny",
        ),
        (
            ["train", "tiny", "--model.injection", "foo"],
            "invalid choice 'foo' for argument '--model.injection'",
            "train tiny",
        ),
        (["train", "XL"], "error: unrecognized option XL; available subcommands: tiny, S, M, L", "train"),
        (["train", "tiny", "--depth.sampler", "sometimes"], "invalid choice 'sometimes'", "train tiny"),
        (["train", "tiny", "--train.steps"], "missing value for argument '--train.steps'", "train tiny"),
        (["eval"], "error: missing required input for looplm eval: PATH", "eval"),
        (["generate", "ckpt", "--temperature", "warm"], "invalid value for --temperature (expects FLOAT)", "generate"),
        (["bogus"], "error: unrecognized option bogus; available subcommands: train, eval", ""),
        ([], "error: missing subcommand: expected one of {train, eval, generate", ""),
        (["train"], "error: missing subcommand: expected one of {tiny, S, M, L}", "train"),
    ],
)
def test_parse_errors_are_one_line_with_a_help_pointer(argv, message, help_for, capsys):
    """tyro's boxed report becomes `error: ...; see looplm <subcommand> --help`, exit status 2."""
    rc, out, err = run_main(argv, capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert message in err, err
    assert err.rstrip().endswith(f"; see {' '.join(['looplm', *help_for.split()])} --help"), err
    assert not BOX_DRAWING & set(err), err
    assert out == ""


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--temperature", "-1", "temperature must be >= 0 (0 = greedy decoding), got -1.0"),
        ("--temperature", "nan", "temperature must be >= 0"),
        ("--top-p", "0", "top_p must be in (0, 1] (1 = all tokens), got 0.0"),
        ("--top-p", "1.5", "top_p must be in (0, 1] (1 = all tokens), got 1.5"),
        ("--stop", "", "stop strings must be non-empty"),
        ("--top-k", "-1", "top_k must be >= 0 (0 = all tokens), got -1"),
        ("--max-new-tokens", "0", "max_new_tokens must be >= 1, got 0"),
        ("--exit-tau", "0", "exit_tau must be > 0"),
    ],
)
def test_generate_rejects_bad_sampling_options(tmp_path, capsys, flag, value, message):
    """Checked before the checkpoint loads: the (missing) checkpoint is never reached."""
    rc, out, err = run_main(["generate", tmp_path / "nowhere", flag, value], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert message in err and err.rstrip().endswith("; see looplm generate --help"), err
    assert out == ""


def test_help_still_prints_in_full(capsys):
    rc, out, err = run_main(["train", "--help"], capsys)
    assert rc == 0 and err == ""
    assert all(preset in out for preset in ("tiny", "S", "M", "L"))
    rc, out, err = run_main(["train", "tiny", "--help"], capsys)
    assert rc == 0 and err == ""
    assert out.startswith("usage: looplm train tiny") and "--train.steps" in out and "Optimizer steps" in out
    rc, out, err = run_main(["generate", "--help"], capsys)
    assert rc == 0 and err == "" and "--top-p" in out and "0 = greedy" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--depth.sampler", "fixed", "--depth.depth", "0"], "fixed depth must be in 1..64, got 0"),
        (["--depth.sampler", "fixed", "--depth.depth", "65"], "fixed depth must be in 1..64, got 65"),
        (["--depth.sampler", "fixed", "--depth.depth", "2.5"], "fixed depth must be an integer"),
        (
            ["--model.max-seq-len", "256", "--data.seq-len", "512"],
            "data.seq_len 512 exceeds the model context max_seq_len 256",
        ),
        (["--model.n-heads", "3"], "not divisible by n_heads 3"),
        (["--train.steps", "0"], "train.steps must be >= 1"),
        (["--eval.depths", "0"], "eval.depths: depth must be in 1..64, got 0"),
        (["--eval.batch-size", "0"], "eval.batch_size: must be >= 1, got 0"),
        (["--eval.choice-tasks", "{missing}"], "eval.choice_tasks: no such file"),
        (["--eval.sample-depths", "1", "--eval.sample-prompt", ""], "eval.sample_prompt: the samples need a non-empty"),
        (["--eval.cacheeval-span", "60", "10"], "P + C <= the context max_seq_len=64"),
        # it failed after training and the other measurements, with no eval.json written
        (["--data.seq-len", "32", "--eval.cacheeval-span", "30", "10"], "do not fit the data's rows of 32"),
        (["--train.lr", "-1"], "train.lr must be > 0, got -1"),
        (["--train.beta1", "2"], "train.beta1 must be in [0, 1), got 2"),
        (["--train.warmup-frac", "2"], "train.warmup_frac must be in [0, 1], got 2"),
        (["--train.weight-decay", "-1"], "train.weight_decay must be >= 0, got -1"),
        (["--data.source", "{missing}"], "data source not found"),
        (["--data.source", "{empty}"], "has no non-empty document"),
        (["--data.source", "{latin1}"], "is not valid UTF-8"),
        (["--train.out-dir", "{file}"], "is a file, not a folder: choose another --train.out-dir"),
    ],
)
def test_train_user_errors_are_one_line(tmp_path, cache, capsys, extra, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("not a run folder\n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n\nd\xe9j\xe0 vu\n".encode("latin-1"))
    paths = {
        "missing": tmp_path / "missing.txt",
        "empty": tmp_path / "empty",
        "latin1": tmp_path / "latin1.txt",
        "file": tmp_path / "file",
    }
    extra = [a.format(**paths) for a in extra]
    rc, _, err = run_main(["train", "tiny", *tiny_flags(tmp_path, cache=cache), *extra], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert message in err
    assert not list(tmp_path.rglob("checkpoints")), "refused only after training"


def test_eval_depth_zero(trained_run, capsys):
    rc, out, err = run_main(["eval", trained_run / "run", "--depths", "0"], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert "depth must be in 1..64, got 0" in err


@pytest.mark.parametrize("damage", ["flip", "manifest", "missing"])
def test_eval_of_a_broken_checkpoint(trained_run, tmp_path, capsys, damage):
    path = ckpt.resolve(trained_run / "run")
    if damage == "missing":
        target = tmp_path / "nowhere"
    else:
        target = tmp_path / "ck"
        shutil.copytree(path, target)
        if damage == "flip":
            f = target / "model.safetensors"
            data = bytearray(f.read_bytes())
            data[100] ^= 0x40
            f.write_bytes(bytes(data))
        else:
            (target / "manifest.json").unlink()
    rc, out, err = run_main(["eval", target, "--depths", "1"], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert damage != "missing" or out == ""  # nothing on stdout for a run that is not there
    assert {"flip": "model.safetensors is corrupt", "manifest": "no manifest.json", "missing": "no checkpoint folder"}[
        damage
    ] in err


def test_resume_into_a_different_config(trained_run, cache, capsys):
    flags = tiny_flags(trained_run, "run", cache=cache, train__steps=2)
    rc, _, err = run_main(
        ["train", "tiny", *flags, "--train.resume", "--train.steps", "4", "--train.lr", "0.001"], capsys
    )
    assert_clean_exit(rc, err, looplm_error=True)
    assert "cannot resume into a different config" in err and "train.lr" in err
    assert "train.steps" not in err  # a resume may train longer


def test_fresh_run_into_a_used_folder(trained_run, cache, capsys):
    rc, _, err = run_main(["train", "tiny", *tiny_flags(trained_run, "run", cache=cache, train__steps=2)], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert "already holds checkpoints" in err


@pytest.mark.slow
def test_console_script_reports_errors_without_traceback(tmp_path):
    """The installed `looplm` script: exit status and stderr as a user sees them, for an error of the
    config layer, a parse error and --help (every error message is checked in-process above)."""
    calls = [
        ("train", "tiny", "--model.injection", "foo"),
        ("train", "tiny", "--train.stpes", "3"),
        ("train", "--help"),
    ]
    with ThreadPoolExecutor(2) as pool:  # independent processes: two at a time on two cores
        bad_injection, typo, help_ = pool.map(lambda args: looplm(*args, timeout=120), calls)
    for res in (bad_injection, typo):
        assert_clean_exit(res.returncode, res.stderr, looplm_error=True)
    assert "foo" in bad_injection.stderr and bad_injection.stderr.rstrip().endswith("; see looplm train tiny --help")
    assert "--train.stpes (did you mean --train.steps" in typo.stderr and "--help" in typo.stderr
    assert help_.returncode == 0 and help_.stderr == "" and "tiny" in help_.stdout


def test_generate_command_streams_and_rejects_bad_input(tmp_path, capsys):
    """`looplm generate` on a trained checkpoint: streamed single prompt, batched prompts, clear errors."""
    import looplm.cli as cli

    job = tiny_job(tmp_path)
    Trainer(job).fit()
    capsys.readouterr()  # what training printed
    run = str(job.train.out_dir)
    assert cli.main(["generate", run, "--prompt", "+1,2=", "--max-new-tokens", "3", "--depth", "2"]) == 0
    assert capsys.readouterr().out.startswith("+1,2=")
    assert cli.main(["generate", run, "--prompt", "+1,2=", "+30,40=", "--cache", "full", "--max-new-tokens", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "--- prompt 1 of 2 ---" and lines[1].startswith("+1,2=")
    assert lines[2] == "--- prompt 2 of 2 ---" and lines[3].startswith("+30,40=")
    for bad, msg in (
        (["--depth", "0"], "depth"),
        (["--prompt", ""], "empty"),
        (["--prompt", "x" * 300], "has 300 tokens, more than the context max_seq_len=64"),
        (["--prompt", "x", "--prefill-depth", "0"], "prefill_depth must be in 1..64, got 0"),
        (["--prompt", "x", "--max-new-tokens", "1000"], "exceeds the context"),
        (["--prompt", "x", "--exit-tau", "0.1", "--min-depth", "9"], "min_depth 9 exceeds"),
        (["--prompt", "x", "--exit-gate", "0.5"], "exit gate"),
        # settings an arm would ignore silently
        (["--prompt", "x", "--prefill", "r1", "--prefill-depth", "3"], "--prefill r1 has its own"),
        (["--prompt", "x", "--student", "somewhere"], "--student is read only with --prefill student"),
        (["--prompt", "x", "--min-depth", "3"], "give --exit-tau too"),
    ):
        assert cli.main(["generate", run, *bad]) == 2
        out, err = capsys.readouterr()
        assert err.startswith("error:") and msg in err and "Traceback" not in err, err
        assert out == "", out  # refused before the prompt is echoed


def test_eval_decoding_protocols_from_jsonl(tmp_path, capsys):
    """`looplm eval` with choice tasks, GSM8K-format JSONL and cached generation on generator tasks."""
    job = tiny_job(tmp_path)
    Trainer(job).fit()
    choice = tmp_path / "choice.jsonl"
    choice.write_text(
        '{"context": "+1,2=", "choices": ["3", "4"], "gold": 0}\n'
        '{"context": "+2,2= ", "choices": ["4", "5", "6"], "gold": 0}\n'
    )
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text('{"question": "1+1?", "answer": "so #### 2"}\n')
    out_json = tmp_path / "report.json"
    rc = main(
        [
            "eval",
            str(job.train.out_dir),
            "--depths",
            "1",
            "2",
            "--task-examples",
            "0",
            "--max-sequences",
            "4",
            "--sharing-sequences",
            "0",
            "--generation-examples",
            "6",
            "--choice-tasks",
            str(choice),
            "--gsm8k",
            str(gsm),
            "--output",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    for title in ("generator tasks, greedy generation", "choice tasks (acc / acc_norm)", "GSM8K-format exact match"):
        assert title in out
    report = json.loads(out_json.read_text())
    assert report["choice"]["1"]["n"] == 2 and report["gsm8k"]["2"]["n"] == 1
    assert report["generation"]["1"]["n"] >= 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "x", "choices": ["a"], "gold": 0}\n')
    assert (
        main(
            [
                "eval",
                str(job.train.out_dir),
                "--depths",
                "1",
                "--task-examples",
                "0",
                "--sharing-sequences",
                "0",
                "--max-sequences",
                "2",
                "--choice-tasks",
                str(bad),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        err.startswith("error: --choice-tasks: ") and "bad.jsonl" in err and "Traceback" not in err
    )  # before measuring


# -- defaults that follow the checkpoint, reports, devices (issue: a newcomer's first hour) ------------
def error_lines(err: str) -> list[str]:
    """The `error: ...` / `internal error: ...` lines of stderr (progress bars and warnings aside)."""
    return [line for line in err.replace("\r", "\n").splitlines() if "error: " in line]


class GenerateSpy:
    """Records what `looplm generate` asks `looplm.infer.generate.generate` for, then runs it."""

    def __init__(self, monkeypatch):
        import looplm.infer.generate as gen

        self.calls, real = [], gen.generate
        monkeypatch.setattr(gen, "generate", lambda *a, **k: self.calls.append((a, k)) or real(*a, **k))


# text: 64 new tokens, cut to the 59 that the 64-token context leaves after the 6-token prompt
@pytest.mark.parametrize(("source", "stop", "max_new_tokens"), [("tasks", ("\n",), 16), ("shakespeare", (), 59)])
def test_generate_stop_and_length_follow_the_checkpoints_data(
    tmp_path, monkeypatch, capsys, source, stop, max_new_tokens
):
    """A text checkpoint continues past newlines (the README's `--prompt "ROMEO."` printed only the
    prompt: the task generator's newline stop applied to text); a task checkpoint stops after its answer."""
    from _jobs import write_random_run

    run = write_random_run(tmp_path / "run", data__source=source)
    spy = GenerateSpy(monkeypatch)
    rc, out, err = run_main(["generate", run, "--prompt", "ROMEO.", "--depth", "2", "--device", "cpu"], capsys)
    assert rc == 0, err
    ((args, kwargs),) = spy.calls
    assert (kwargs["sampling"].stop, kwargs["sampling"].max_new_tokens) == (stop, max_new_tokens)
    assert out.startswith("ROMEO.")
    rc, out, err = run_main(
        ["generate", run, "--prompt", "ROMEO.", "--stop", "x", "--max-new-tokens", "3", "--device", "cpu"], capsys
    )
    assert rc == 0, err
    assert (spy.calls[-1][1]["sampling"].stop, spy.calls[-1][1]["sampling"].max_new_tokens) == (("x",), 3)


def test_generate_prompt_defaults_only_for_task_checkpoints(tmp_path, monkeypatch, capsys):
    from _jobs import write_random_run

    from looplm.data import TaskConfig, generate_examples

    spy = GenerateSpy(monkeypatch)
    tasks = write_random_run(tmp_path / "tasks")  # the tiny job's tasks: add_msd
    rc, out, err = run_main(["generate", tasks, "--device", "cpu", "--depth", "2"], capsys)
    assert rc == 0, err
    ((args, _),) = spy.calls
    want = generate_examples(TaskConfig(kinds=("add_msd",), min_difficulty=1, max_difficulty=3), 1, seed=0)[0]
    assert args[2] == [want.prompt] and out.startswith(want.prompt)
    text = write_random_run(tmp_path / "text", data__source="shakespeare")
    rc, out, err = run_main(["generate", text, "--device", "cpu"], capsys)
    assert rc == 2 and out == "" and "Traceback" not in err
    assert any("give --prompt" in line for line in error_lines(err)), err


def test_generate_prompt_with_no_text_is_a_one_line_error(random_run, capsys):
    """`--prompt` followed by no text parses as an empty tuple: a one-line user error, not an internal one
    (guards `if not prompt` in _generate_prompts)."""
    rc, out, err = run_main(["generate", random_run, "--prompt", "--device", "cpu"], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert error_line(err) == "error: --prompt needs at least one text" and out == ""


@pytest.mark.parametrize("command", ["eval", "analyze"])
def test_reports_of_a_standalone_checkpoint_stay_in_its_folder(tmp_path, capsys, command):
    """A checkpoint folder outside a run (what `looplm convert` writes) gets its report inside it, never
    two folders up."""
    from _jobs import write_random_run

    run = write_random_run(tmp_path / "run")
    folder = tmp_path / "ckpts" / "p2-s"
    folder.parent.mkdir()
    shutil.copytree(ckpt.resolve(run), folder)
    cheap = {
        "eval": ["--depths", "1", "--task-examples", "4", "--max-sequences", "2", "--sharing-sequences", "0"],
        "analyze": [
            "--horizon",
            "4",
            "--kv-depths",
            "2",
            "--solve-spans",
            "0",
            "--sharing-sequences",
            "0",
            "--no-plots",
        ],
    }[command]
    rc, out, err = run_main([command, folder, *cheap, "--device", "cpu"], capsys)
    assert rc == 0, err
    report = folder / ("eval.json" if command == "eval" else "analyze/report.json")
    assert report.is_file()
    assert not (tmp_path / "eval.json").exists() and not (tmp_path / "analyze").exists()
    ckpt.verify(folder)  # the report beside the weights leaves the checkpoint intact
    rc, out, err = run_main([command, run, *cheap, "--device", "cpu"], capsys)  # a run: its run folder
    assert rc == 0, err
    assert (run / ("eval.json" if command == "eval" else "analyze/report.json")).is_file()


def test_every_model_command_defaults_to_the_auto_device():
    import inspect

    import looplm.cli as cli

    for fn in (cli.evaluate, cli.generate, cli.analyze, cli.serve):
        assert inspect.signature(fn).parameters["device"].default == "auto", fn.__name__
    assert cli._device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert cli._device("cpu").type == "cpu"


def test_version(capsys):
    from looplm import __version__

    rc, out, err = run_main(["--version"], capsys)
    assert rc == 0 and out.strip() == f"looplm {__version__}" and err == ""


def test_a_long_internal_error_is_cut_to_300_characters(tmp_path, monkeypatch, capsys):
    """An internal error's first line is kept whole up to 300 characters; a longer one is cut to its first
    297 and `...` (300 in all), so the one line stays readable."""
    import looplm.checkpoint

    for length, shown in ((300, "y" * 300), (301, "z" * 297 + "...")):
        message = shown[0] * length

        def broken(*args, message=message, **kwargs):
            raise ValueError(message)

        monkeypatch.setattr(looplm.checkpoint, "load_model", broken)
        monkeypatch.delenv("LOOPLM_DEBUG", raising=False)
        rc, _, err = run_main(["eval", tmp_path, "--device", "cpu"], capsys)
        assert rc == 1, err
        assert f"internal error: ValueError: {shown} (looplm --debug" in err, err


def test_internal_errors_are_one_line_and_debug_shows_the_traceback(tmp_path, monkeypatch, capsys):
    """A bug (here a ValueError that is not a UserError) is reported as an internal error, exit 1, with its
    traceback only under --debug or LOOPLM_DEBUG=1; a UserError stays `error: ...`, exit 2."""
    import looplm.checkpoint

    from looplm.errors import UserError

    def broken(*args, **kwargs):
        raise ValueError("shapes do not broadcast\nsecond line")

    monkeypatch.setattr(looplm.checkpoint, "load_model", broken)
    monkeypatch.delenv("LOOPLM_DEBUG", raising=False)
    argv = ["eval", tmp_path, "--device", "cpu"]
    rc, out, err = run_main(argv, capsys)
    assert rc == 1 and "Traceback" not in err
    (line,) = error_lines(err)
    assert line.startswith("internal error: ValueError: shapes do not broadcast") and "--debug" in line
    rc, out, err = run_main(["--debug", *argv], capsys)
    assert rc == 1 and "Traceback" in err and "in broken" in err
    monkeypatch.setenv("LOOPLM_DEBUG", "1")
    rc, out, err = run_main(argv, capsys)
    assert rc == 1 and "Traceback" in err
    monkeypatch.delenv("LOOPLM_DEBUG")

    def refused(*args, **kwargs):
        raise UserError("the checkpoint says no")

    monkeypatch.setattr(looplm.checkpoint, "load_model", refused)
    rc, out, err = run_main(argv, capsys)
    assert rc == 2 and "Traceback" not in err and error_lines(err) == ["error: the checkpoint says no"]


def test_user_errors_of_every_layer_share_one_type():
    from looplm.checkpoint import CheckpointError
    from looplm.config import ModelConfig
    from looplm.data import DataError
    from looplm.errors import UserError

    assert issubclass(CheckpointError, UserError) and issubclass(DataError, UserError)
    assert issubclass(UserError, ValueError)  # callers that catch ValueError keep working
    with pytest.raises(UserError, match="n_heads"):
        ModelConfig(d_model=30, n_heads=4).validate()


HELP_COMMANDS = [
    ["train", "tiny"],
    ["train", "S"],
    ["eval"],
    ["generate"],
    ["analyze"],
    ["distill"],
    ["rl"],
    ["tokenize"],
    ["export"],
    ["convert"],
    ["serve"],
    [],
]


def string_defaults(obj) -> list[str]:
    """Every string default (also inside tuples) of a subcommand's parameters and their config dataclasses."""
    import dataclasses
    import inspect

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [s for f in dataclasses.fields(obj) for s in string_defaults(getattr(obj, f.name))]
    if callable(obj):
        return [
            s
            for p in inspect.signature(obj).parameters.values()
            if p.default is not p.empty
            for s in string_defaults(p.default)
        ]
    if isinstance(obj, (tuple, list)):
        return [s for x in obj for s in string_defaults(x)]
    return [obj] if isinstance(obj, str) else []


def flat(text: str) -> str:
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


@pytest.mark.parametrize(("preset", "shown"), [("tiny", "(default: 1 5)"), ("S", "(default: none)")])
def test_help_shows_the_presets_own_sample_depths(capsys, preset, shown):
    """`--eval.sample-depths` is empty by default (shown as none, tyro would print nothing), but the tiny
    preset sets 1 5: its --help shows that, not a fixed "none"."""
    rc, out, _ = run_main(["train", preset, "--help"], capsys)
    text = flat(out)
    assert rc == 0
    assert shown in text[text.index("--eval.sample-depths") :].split("--eval.", 2)[1]


@pytest.mark.parametrize("command", HELP_COMMANDS, ids=lambda c: " ".join(c) or "looplm")
def test_help_texts_are_readable(capsys, command):
    """No empty `(default: )`, no default printed with a literal newline (it broke the box), no Sphinx markup."""
    import looplm.cli as cli
    from looplm.train.config import job_preset

    rc, out, err = run_main([*command, "--help"], capsys)
    assert rc == 0 and err == ""
    assert "(default: )" not in out
    for markup in ("``", ":class:", ":data:", ":meth:", ":func:"):
        assert markup not in out, markup
    if command:
        source = job_preset(command[1]) if command[0] == "train" else cli._SUBCOMMANDS[command[0]]
        multiline = [s for s in string_defaults(source) if "\n" in s]
        if command[0] == "rl":  # its prompt template (eval's sample prompt now defaults to one from the data)
            assert multiline, "the check below would see nothing"
        for value in multiline:
            assert flat(value.replace("\n", "\\n")) in flat(out), value


def test_help_lists_the_task_kinds(capsys):
    from looplm.data.tasks import TASK_KINDS, TASKS

    assert set(TASK_KINDS) == set(TASKS)
    rc, out, _ = run_main(["train", "tiny", "--help"], capsys)
    block = out[out.index("--data.tasks.kinds") : out.index("--data.tasks.min-difficulty")]
    flat = re.sub(r"[│\s]+", " ", block)
    for kind in TASK_KINDS:
        assert kind in flat, kind


# -- refused before any work, with a one-line error ------------------------------------------------------
@pytest.fixture
def random_run(tmp_path):
    from _jobs import write_random_run

    return write_random_run(tmp_path / "run", data__source="shakespeare")


def test_export_writes_only_into_a_new_empty_or_earlier_export_folder(random_run, tmp_path, capsys):
    pytest.importorskip("transformers")
    step = ckpt.resolve(random_run)
    before = ckpt.verify(step)
    rc, _, err = run_main(["export", random_run, step], capsys)  # into the checkpoint itself
    assert_clean_exit(rc, err, looplm_error=True)
    assert "is not empty" in err and ckpt.verify(step) == before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("important")
    rc, _, err = run_main(["export", random_run, mine], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert (mine / "config.json").read_text() == "important"
    for flag in ("--num-steps", "--prefill-steps"):
        rc, _, err = run_main(["export", random_run, tmp_path / "hf", flag, 0], capsys)
        assert_clean_exit(rc, err, looplm_error=True)
        assert f"{flag[2:].replace('-', '_')} must be in 1..64" in err
    for _ in range(2):  # a new folder, then the same folder again: an earlier export is replaced
        rc, _, err = run_main(["export", random_run, tmp_path / "hf", "--num-steps", 2], capsys)
        assert rc == 0, err
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_steps"] == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--depths"], "--depths: give at least one depth"),
        (["--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
        (["--cacheeval-span", "1024", "512"], "P + C <= the context max_seq_len=64"),
        (["--choice-tasks", "nope.jsonl"], "--choice-tasks: no such file"),
        (["--sample-depths", "1", "--sample-prompt", "A" * 300], "--sample-prompt: does not fit the context"),
        (["--device", "bogus"], "unknown device 'bogus'"),
    ],
)
def test_eval_refuses_bad_options_before_it_measures(random_run, capsys, extra, message):
    rc, out, err = run_main(["eval", random_run, "--depths", 1, "--max-sequences", 2, *extra], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert message in err, err
    assert not (random_run / "eval.json").exists() and "val ppl" not in out


def test_eval_refuses_a_span_no_held_out_document_holds_before_it_measures(tmp_path, capsys, monkeypatch):
    """Task documents are short: a span that fits the rows (50 <= 64) but no document failed only after the
    native perplexity and task accuracy had run, and no report was written."""
    import looplm.eval.report
    from _jobs import write_random_run

    run = write_random_run(tmp_path / "run", data__source="tasks")
    monkeypatch.setattr(looplm.eval.report, "depth_report", lambda *a, **k: pytest.fail("measured first"))
    rc, out, err = run_main(["eval", run, "--depths", 1, "--max-sequences", 2, "--cacheeval-span", 30, 20], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert "cacheeval span 30 20: no held-out document has 50 tokens" in err, err
    assert "val ppl" not in out and not (run / "eval.json").exists()


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="cuda:1 exists here")
def test_a_missing_cuda_device_is_a_user_error(random_run, capsys):
    rc, _, err = run_main(["generate", random_run, "--prompt", "x", "--device", "cuda:1"], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert "'cuda:1' requested" in err


@pytest.mark.parametrize("command", ["distill", "rl"])
def test_distill_and_rl_never_write_into_their_source_run(random_run, capsys, command):
    rc, _, err = run_main([command, random_run, "--out-dir", random_run / "sub", "--device", "cpu"], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert "overlaps the source run" in err and not (random_run / "sub").exists()


def test_a_closed_pipe_ends_quietly():
    """`looplm --help | head -1`: the reader is gone before looplm writes; no internal error, SIGPIPE's status."""
    proc = subprocess.Popen(
        looplm_cmd("--help"), env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=CLI_TIMEOUT) == 141, err
    assert "error" not in err and "Traceback" not in err, err


# -- resumed and interrupted runs say where they are (issue 33 item 3) --------------------------------
def test_a_resumed_run_counts_the_steps_of_this_session(tmp_path, cache, capsys):
    flags = tiny_flags(tmp_path, "run", cache=cache, train__steps=2, eval__depths=())
    rc, out, _ = run_main(["train", "tiny", *flags], capsys)
    assert rc == 0 and "\ntrained 2 steps, " in out
    rc, out, _ = run_main(["train", "tiny", *flags, "--train.resume", "--train.steps", "5"], capsys)
    assert rc == 0
    assert f"resuming {tmp_path / 'run'} from step 2 (of 5)" in out.splitlines()
    assert "\ntrained steps 3..5 (3 this session), " in out, out


def test_ctrl_c_names_the_step_the_checkpoint_and_the_resume_command(tmp_path, cache, capsys, monkeypatch):
    """Ctrl-C (KeyboardInterrupt from within step 6) ends with one line naming the interrupted step, the
    last checkpoint and the command that resumes the run; that command does."""
    import shlex

    step = Trainer.train_step

    def interrupted_at_6(self):
        if self.step == 5:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", interrupted_at_6)
    flags = tiny_flags(tmp_path, "run", cache=cache, train__steps=8, train__checkpoint_every=2, eval__depths=())
    rc, _, err = run_main(["train", "tiny", *flags], capsys)
    assert rc == 130
    line = err.strip().splitlines()[-1]
    prefix = "interrupted at step 5; last checkpoint step 4; resume with: "
    assert line.startswith(prefix), err
    command = shlex.split(line.removeprefix(prefix))
    assert command[:3] == ["looplm", "train", "tiny"]
    assert command[-3:] == ["--train.resume", "--train.out-dir", str(tmp_path / "run")]
    monkeypatch.setattr(Trainer, "train_step", step)
    rc, out, _ = run_main(command[1:], capsys)
    assert rc == 0 and "\ntrained steps 5..8 (4 this session), " in out, out
    assert latest_step(tmp_path / "run") == 8


def test_ctrl_c_before_the_first_checkpoint(tmp_path, cache, capsys, monkeypatch):
    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    rc, _, err = run_main(["train", "tiny", *tiny_flags(tmp_path, "run", cache=cache, eval__depths=())], capsys)
    assert rc == 130
    assert err.strip().splitlines()[-1] == (
        "interrupted at step 0, before the first checkpoint (step 8): "
        "nothing to resume; run the same command to start again"
    )


def test_the_verbose_decode_line_rates_the_tokens_after_the_first_step():
    """`generate --verbose`'s line: compiled, the rate after the first step (or speculation round) is the
    tokens decided after it over the time after it; no such clause eagerly or when nothing came after."""
    from looplm.cli import _decode_line

    stats = {"decoded_tokens": 120, "decode_seconds": 9.0, "first_step_seconds": 7.0, "first_step_tokens": 6}
    spec = {"acceptance_rate": 0.98, "tokens_per_verify": 4.92}
    line = _decode_line({**stats, **spec}, compile=True, speculated=True)
    assert line == (
        "decoded 120 tokens in 9.00 s (13.3 tokens/s; the first round took 7.0 s with compiling, the rest 57.0 "
        "tokens/s); speculation: 98% of drafts accepted, 4.92 tokens per verify"
    )
    plain = _decode_line({**stats, "first_step_tokens": 2}, compile=True, speculated=False)
    assert plain.endswith("the first step took 7.0 s with compiling, the rest 59.0 tokens/s)")
    assert _decode_line(stats, compile=False, speculated=False) == "decoded 120 tokens in 9.00 s (13.3 tokens/s)"
    done = {**stats, "first_step_tokens": 120}
    assert _decode_line(done, compile=True, speculated=False) == "decoded 120 tokens in 9.00 s (13.3 tokens/s)"


def test_generate_speculate_prints_the_same_text_and_the_acceptance_line(tmp_path, capsys):
    """`--speculate 2 --draft-depth 1 --verbose` (full cache): the same stdout as plain decoding, and a
    stderr line with the acceptance rate; bad --speculate / --draft-depth values are one-line errors."""
    from _jobs import write_random_run

    run = write_random_run(tmp_path / "run", data__source="shakespeare")
    base = [
        "generate",
        run,
        "--prompt",
        "ROMEO.",
        "--depth",
        "3",
        "--cache",
        "full",
        "--max-new-tokens",
        "11",
        "--device",
        "cpu",
    ]
    rc, plain, err = run_main(base, capsys)
    assert rc == 0, err
    rc, out, err = run_main([*base, "--speculate", "2", "--draft-depth", "1", "--verbose"], capsys)
    assert rc == 0, err
    assert out == plain and out.startswith("ROMEO.")
    (line,) = [x for x in err.splitlines() if "speculation:" in x]
    assert re.search(
        r"decoded \d+ tokens in .* s \(.* tokens/s\); speculation: \d+% of drafts accepted, "
        r"\d\.\d\d tokens per verify$",
        line,
    ), line
    for bad, msg in (
        (["--speculate", "-1"], "--speculate must be >= 0 (0 = off), got -1"),
        (["--speculate", "2", "--draft-depth", "3"], "draft_depth must be in 1..2 (below the decode depth 3), got 3"),
        (["--speculate", "2", "--draft-depth", "0"], "draft_depth must be in 1..2"),
    ):
        rc, out, err = run_main([*base, *bad], capsys)
        assert rc == 2 and out == "", (bad, out)
        assert len(error_lines(err)) == 1 and err.startswith("error:") and msg in err, err
        assert "Traceback" not in err


def test_generate_passes_its_options_to_looplms_generate(tmp_path, monkeypatch, capsys):
    """Kills L03 (cli.py generate: `compile=compile` -> `compile=False`): --compile, --cache, --depth and
    --prefill-depth reach `looplm.infer.generate.generate` (the spy records them, then runs it uncompiled to
    stay fast)."""
    from _jobs import run_main, write_random_run

    import looplm.infer.generate as gen

    run = write_random_run(tmp_path / "run", data__source="shakespeare")
    calls, real = [], gen.generate
    monkeypatch.setattr(gen, "generate", lambda *a, **k: calls.append((a, k)) or real(*a, **{**k, "compile": False}))
    argv = ["generate", run, "--prompt", "ROMEO.", "--max-new-tokens", "2", "--device", "cpu"]
    rc, _, err = run_main([*argv, "--compile", "--cache", "full", "--depth", "2", "--prefill-depth", "3"], capsys)
    assert rc == 0, err
    ((args, kwargs),) = calls
    assert kwargs["compile"] is True and kwargs["cache"] == "full"
    assert (args[3].depth, args[3].prefill_depth) == (2, 3)
    rc, _, err = run_main(argv, capsys)
    assert rc == 0, err
    assert calls[-1][1]["compile"] is False and calls[-1][1]["cache"] == "terminal"


# -- what eval and generate measure and print ---------------------------------------------------------------
class ReportSpy:
    """Records the progress bar's total and the prefill arms `looplm eval` hands `depth_report`, then runs it."""

    def __init__(self, monkeypatch):
        import looplm.cli as cli
        import looplm.eval.report as report

        self.totals, self.arms, progress, real = [], [], cli._progress, report.depth_report

        def bar(total, *args, **kwargs):
            self.totals.append(total)
            return progress(total, *args, **kwargs)

        def measured(*args, prefill=None, **kwargs):
            self.arms.append(None if prefill is None else [a.arm for a in prefill])
            return real(*args, prefill=prefill, **kwargs)

        monkeypatch.setattr(cli, "_progress", bar)
        monkeypatch.setattr(report, "depth_report", measured)


def test_eval_progress_total_counts_every_batch_of_every_depth(tmp_path, monkeypatch, capsys):
    """The bar's total (in recurrences) is sum(depths) x the batches per depth: ceil(3/2) = 2 perplexity
    batches, ceil(n/2) task batches for the n held-out examples the report scored (of the 5 asked for, those
    whose prompts the training set does not hold), one sharing batch."""
    from _jobs import write_random_run

    run = write_random_run(tmp_path / "run")  # the task generator
    spy = ReportSpy(monkeypatch)
    flags = ["--depths", 1, 2, "--max-sequences", 3, "--task-examples", 5, "--batch-size", 2]
    rc, _, err = run_main(["eval", run, *flags, "--sharing-sequences", 2, "--device", "cpu"], capsys)
    assert rc == 0, err
    n = json.loads((run / "eval.json").read_text())["tasks"]["1"]["n"]
    assert 0 < n < 5  # some asked-for examples were training prompts
    assert spy.totals == [(1 + 2) * (2 + -(-n // 2) + 1)]


def test_eval_names_each_prefill_arm_once_and_a_lone_arm_is_measured(random_run, monkeypatch, capsys):
    """`--prefill r1` alone is an arm to compare (only the default, teacher alone, adds none); an arm given
    twice is measured once, in the order first given."""
    spy = ReportSpy(monkeypatch)
    cheap = ["--depths", 1, "--max-sequences", 2, "--task-examples", 0, "--sharing-sequences", 0, "--device", "cpu"]
    for prefill in (["teacher"], ["r1"], ["r2", "teacher", "r2"]):
        rc, _, err = run_main(["eval", random_run, *cheap, "--prefill", *prefill], capsys)
        assert rc == 0, err
    assert spy.arms == [None, ["r1"], ["r2", "teacher"]]


def test_eval_with_the_checkpoints_own_data_writes_the_runs_report(random_run, capsys):
    """--data naming the data the checkpoint records is no other data: the report is the run's eval.json."""
    cheap = ["--depths", 1, "--max-sequences", 2, "--task-examples", 0, "--sharing-sequences", 0, "--device", "cpu"]
    rc, out, err = run_main(["eval", random_run, *cheap, "--data", "shakespeare"], capsys)
    assert rc == 0, err
    assert out.rstrip().endswith(f"report: {random_run / 'eval.json'}")
    assert (random_run / "eval.json").is_file() and not list(random_run.glob("eval-*.json"))


def test_eval_notes_generation_examples_only_on_data_without_generator_tasks(tmp_path, capsys):
    from _jobs import write_random_run

    cheap = ["--depths", 1, "--max-sequences", 2, "--task-examples", 0, "--sharing-sequences", 0, "--device", "cpu"]
    note = "note: --generation-examples scores generator tasks"
    for source, noted in (("tasks", False), ("shakespeare", True)):
        run = write_random_run(tmp_path / source, data__source=source)
        rc, _, err = run_main(["eval", run, *cheap, "--generation-examples", 1], capsys)
        assert rc == 0, err
        assert (note in err) == noted, (source, err)


def test_generate_length_default_leaves_room_after_the_longest_prompt(random_run, monkeypatch, capsys):
    """Several prompts of a text checkpoint: 64 new tokens at most, cut to what the 64-token context leaves
    after the longest (20 tokens: 64 - 20 + 1 = 45), not after the shortest."""
    spy = GenerateSpy(monkeypatch)
    rc, _, err = run_main(["generate", random_run, "--prompt", "ab", "x" * 20, "--depth", 2, "--device", "cpu"], capsys)
    assert rc == 0, err
    assert spy.calls[-1][1]["sampling"].max_new_tokens == 64 - 20 + 1


def test_generate_streams_the_prompt_once_then_the_text(random_run, monkeypatch, capsys):
    """One prompt: stdout is the prompt, its continuation (what generate returns) and a newline, nothing twice."""
    import looplm.infer.generate as gen

    texts, real = [], gen.generate
    monkeypatch.setattr(gen, "generate", lambda *a, **k: texts.append(real(*a, **k)) or texts[-1])
    argv = ["generate", random_run, "--prompt", "ROMEO.", "--depth", 2, "--max-new-tokens", 6, "--device", "cpu"]
    rc, out, err = run_main([*argv, "--temperature", 0], capsys)
    assert rc == 0, err
    ((text,),) = texts
    assert text and out == "ROMEO." + text + "\n"


def test_generate_with_exit_tau_reports_the_mean_decode_depth_without_verbose(random_run, capsys):
    """--exit-tau: a stderr line with the mean decode depth and its cap, the decode depth (not --min-depth)."""
    argv = ["generate", random_run, "--prompt", "ROMEO.", "--depth", 4, "--max-new-tokens", 3, "--device", "cpu"]
    rc, _, err = run_main([*argv, "--exit-tau", "0.5", "--min-depth", 2], capsys)
    assert rc == 0, err
    (line,) = [x for x in err.splitlines() if x.startswith("mean decode depth: ")]
    assert re.fullmatch(r"mean decode depth: \d\.\d\d \(max 4\)", line), line
    assert 2 <= float(line.split()[3]) <= 4


def test_the_verbose_decode_line_has_no_compile_clause_without_a_timed_first_step():
    """A first step that took no measured time (0 s) says nothing about compiling: plain rate only."""
    from looplm.cli import _decode_line

    stats = {"decoded_tokens": 10, "decode_seconds": 2.0, "first_step_seconds": 0.0, "first_step_tokens": 1}
    assert _decode_line(stats, compile=True, speculated=False) == "decoded 10 tokens in 2.00 s (5.0 tokens/s)"


CHEAP_ANALYZE = ["--horizon", 4, "--kv-depths", 2, "--solve-spans", 0, "--sharing-sequences", 0, "--no-plots"]


def test_analyze_refuses_negative_threads_and_restores_the_thread_count(random_run, capsys):
    """--threads -1 is a one-line error before any work; --threads 2 applies to the analysis only: torch's
    thread count is the caller's again afterwards."""
    rc, _, err = run_main(["analyze", random_run, *CHEAP_ANALYZE, "--threads", -1, "--device", "cpu"], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert "threads must be >= 0, got -1" in err and not (random_run / "analyze").exists()
    before = torch.get_num_threads()
    rc, _, err = run_main(["analyze", random_run, *CHEAP_ANALYZE, "--threads", before + 1, "--device", "cpu"], capsys)
    assert rc == 0, err
    assert torch.get_num_threads() == before


def test_a_transformers_folder_without_a_data_record_reads_as_text(random_run, tmp_path, monkeypatch, capsys):
    """A Hugging Face folder saved without looplm's extras records no data: generate takes the text defaults
    (no newline stop, 64 new tokens cut to the context), and eval --data reads rows that fit the 64-token
    context."""
    pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    rc, _, err = run_main(["export", random_run, hf], capsys)
    assert rc == 0, err
    (hf / ckpt.HF_EXPORT_INFO).unlink()
    spy = GenerateSpy(monkeypatch)
    rc, _, err = run_main(["generate", hf, "--prompt", "ROMEO.", "--depth", 2, "--device", "cpu"], capsys)
    assert rc == 0, err
    assert (spy.calls[-1][1]["sampling"].stop, spy.calls[-1][1]["sampling"].max_new_tokens) == ((), 59)
    cheap = ["--depths", 1, "--max-sequences", 2, "--task-examples", 0, "--sharing-sequences", 0, "--device", "cpu"]
    rc, _, err = run_main(["eval", hf, *cheap, "--data", "shakespeare", "--output", tmp_path / "e.json"], capsys)
    assert rc == 0, err
    assert json.loads((tmp_path / "e.json").read_text())["perplexity"]["1"]["tokens"] == 2 * 64


def test_tokenize_says_when_its_output_is_up_to_date(tmp_path, capsys):
    """The same command again keeps the folder and says so; the first run says it wrote it."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: the looped model reads it again.\n")
    argv = ["tokenize", corpus, tmp_path / "tok", "--holdout", "0.5"]
    rc, out, err = run_main(argv, capsys)
    assert rc == 0, err
    assert out.startswith(f"wrote {tmp_path / 'tok'} in ")
    rc, out, err = run_main(argv, capsys)
    assert rc == 0, err
    assert out.startswith(f"up to date (same source, tokenizer, holdout and seed): {tmp_path / 'tok'}\n")


@pytest.mark.parametrize("host", ["::1", "127.0.0.1"])
def test_serve_banner_names_the_run_and_brackets_an_ipv6_host(random_run, monkeypatch, capsys, host):
    """`looplm serve` up to the point it would serve (uvicorn's run is stubbed): port 0 is allowed (any free
    port), the banner names the run folder of a checkpoint given by its step folder and puts an IPv6 host in
    brackets; a loopback host (IPv6's too) gets no warning about exposure."""
    pytest.importorskip("uvicorn")
    import socket

    import uvicorn

    if host == "::1":  # the command binds the host's socket itself: a machine may lack IPv6
        try:
            with socket.socket(socket.AF_INET6) as probe:
                probe.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback on this machine")
    served = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: served.append(self.config.port))
    step = ckpt.resolve(random_run)
    rc, out, err = run_main(["serve", step, "--host", host, "--port", 0, "--device", "cpu"], capsys)
    assert rc == 0, err
    (port,) = served
    shown = "[::1]" if host == "::1" else host
    assert out.startswith(f"serving 'run' on http://{shown}:{port}/v1 ("), out
    assert port != 0 and "warning" not in err, err


def test_serve_refuses_connections_until_it_is_ready(random_run, monkeypatch, capsys):
    """The port is taken before the model loads (a busy port fails at once), but until the engine is ready
    (loaded, and with --compile warmed up for minutes) a client's connection is refused, so a health-check
    loop retries instead of hanging on a server that answers nothing; uvicorn gets a listening socket."""
    pytest.importorskip("uvicorn")
    import socket

    import uvicorn

    import looplm.cli as cli
    from looplm.checkpoint import load_model

    seen = {}
    real_listen = cli._listen
    monkeypatch.setattr(cli, "_listen", lambda host, port: seen.setdefault("socket", real_listen(host, port)))

    def loading(*args, **kwargs):  # while the model loads: connect to the port taken
        port = seen["socket"].getsockname()[1]
        with socket.socket() as client:
            client.settimeout(2)
            seen["while_loading"] = client.connect_ex(("127.0.0.1", port))
        return load_model(*args, **kwargs)

    def run(self, sockets=None):
        with socket.socket() as client:
            client.settimeout(2)
            seen["serving"] = client.connect_ex(("127.0.0.1", sockets[0].getsockname()[1]))

    monkeypatch.setattr("looplm.checkpoint.load_model", loading)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    rc, _, err = run_main(["serve", random_run, "--port", 0, "--device", "cpu"], capsys)
    assert rc == 0, err
    assert seen["while_loading"] != 0  # refused (ECONNREFUSED), not accepted into a queue nobody reads
    assert seen["serving"] == 0


@pytest.mark.parametrize(
    ("argv", "kept"),
    [
        (["train", "tiny", "--train.out-dir", "old", "--train.steps", "3"], ["train", "tiny", "--train.steps", "3"]),
        (
            ["train", "tiny", "--train.out_dir=old", "--train.no_resume", "--seed", "1"],
            ["train", "tiny", "--seed", "1"],
        ),
        (["train", "S", "--train.no-resume", "--train.out_dir", "old"], ["train", "S"]),
    ],
)
def test_the_resume_command_replaces_out_dir_and_resume_however_spelt(monkeypatch, tmp_path, argv, kept):
    """--train.out-dir (with its value, or `=value`) and --train.resume / --train.no-resume, in either
    spelling of `_`/`-`, are dropped from the command line and the resuming pair appended."""
    import shlex

    import looplm.cli as cli

    monkeypatch.setattr(cli, "_ARGS", argv)
    assert shlex.split(cli._resume_command(tmp_path / "run")) == [
        "looplm",
        *kept,
        "--train.resume",
        "--train.out-dir",
        str(tmp_path / "run"),
    ]


def test_a_resumed_run_at_its_last_step_says_there_is_nothing_to_train(tmp_path, cache, capsys):
    flags = tiny_flags(tmp_path, "run", cache=cache, train__steps=2, eval__depths=())
    rc, out, _ = run_main(["train", "tiny", *flags], capsys)
    assert rc == 0
    rc, out, _ = run_main(["train", "tiny", *flags, "--train.resume"], capsys)
    assert rc == 0
    assert "\nno steps to train: the run is at step 2 (of 2)\n" in out and "trained steps" not in out, out


def test_debug_switches_and_a_bare_interrupt(tmp_path, monkeypatch, capsys):
    """LOOPLM_DEBUG=0 is off (no traceback); --debug shows a user error's traceback above its one line; a
    KeyboardInterrupt without a message says `interrupted` (exit 130)."""
    import looplm.checkpoint

    from looplm.errors import UserError

    def broken(*args, **kwargs):
        raise ValueError("shapes do not broadcast")

    monkeypatch.setattr(looplm.checkpoint, "load_model", broken)
    monkeypatch.setenv("LOOPLM_DEBUG", "0")
    rc, _, err = run_main(["eval", tmp_path, "--device", "cpu"], capsys)
    assert rc == 1 and "Traceback" not in err and "--debug" in err, err
    monkeypatch.delenv("LOOPLM_DEBUG")

    def refused(*args, **kwargs):
        raise UserError("the checkpoint says no")

    monkeypatch.setattr(looplm.checkpoint, "load_model", refused)
    rc, _, err = run_main(["--debug", "eval", tmp_path, "--device", "cpu"], capsys)
    assert rc == 2 and "Traceback" in err and err.rstrip().splitlines()[-1] == "error: the checkpoint says no", err

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(looplm.checkpoint, "load_model", interrupted)
    rc, _, err = run_main(["eval", tmp_path, "--device", "cpu"], capsys)
    assert rc == 130 and err == "interrupted\n", err


def test_consolidate_and_convert_pass_their_options_and_say_what_they_wrote(tmp_path, monkeypatch, capsys):
    """The command bodies around looplm.checkpoint.consolidate and the converters (stubbed: the conversions
    themselves are their modules' tests): --weights-only reaches consolidate; a converted student's line
    names the teacher to generate with and the student for --student."""
    import looplm.checkpoint
    import looplm.convert

    calls = []
    monkeypatch.setattr(
        looplm.checkpoint, "consolidate", lambda src, out, **kw: calls.append(kw) or Path(out) / "checkpoints"
    )
    for flags, weights_only in (([], False), (["--weights-only"], True)):
        rc, out, err = run_main(["consolidate", tmp_path / "sharded", tmp_path / "out", *flags], capsys)
        assert rc == 0, err
        assert calls[-1] == {"weights_only": weights_only} and out == f"wrote {tmp_path / 'out' / 'checkpoints'}\n"
    monkeypatch.setitem(looplm.convert.CONVERTERS, "xllm-loop", lambda src, out, **kw: calls.append(kw) or Path(out))
    teacher, student = tmp_path / "teacher", tmp_path / "student"
    rc, out, err = run_main(["convert", tmp_path / "src", student, "--from", "xllm-loop", "--teacher", teacher], capsys)
    assert rc == 0, err
    assert calls[-1] == {"dtype": "fp32", "data": None, "teacher": teacher}
    assert out == f"wrote {student}\nuse it with: looplm generate {teacher} --prefill student --student {student}\n"
    rc, out, err = run_main(["convert", tmp_path / "src", teacher, "--from", "xllm-loop", "--dtype", "bf16"], capsys)
    assert rc == 0, err
    assert calls[-1] == {"dtype": "bf16", "data": None}
    assert out == f"wrote {teacher}\nevaluate it with: looplm eval {teacher}\n"
