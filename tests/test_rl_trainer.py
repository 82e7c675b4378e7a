"""`looplm rl` end to end on a tiny checkpoint: metrics, checkpoints, resume, every estimator, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _jobs import read_metrics, write_random_run

from looplm import checkpoint as ckpt
from looplm.cli import main
from looplm.rl import REWARDS, register_reward

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A run folder holding one checkpoint of a random tiny model, as `looplm train` writes it."""
    root = tmp_path_factory.mktemp("rl") / "pretrain"
    return write_random_run(root)


@pytest.fixture(autouse=True)
def length_reward():
    # a random model never answers correctly; reward the completion length so groups differ
    register_reward("length", lambda ref, text: float(len(text)))
    yield
    REWARDS.pop("length")


def rl_args(source: Path, out: Path, *extra) -> list[str]:
    return [
        "rl",
        str(source),
        "--out-dir",
        str(out),
        "--steps",
        "2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "3",
        "--depth",
        "2",
        "--max-new-tokens",
        "4",
        "--eval-every",
        "0",
        "--reward",
        "length",
        "--lr",
        "1e-3",
        "--device",
        "cpu",
        "--no-progress",
        *map(str, extra),
    ]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return ckpt.load_tensors(ckpt.resolve(path), "model.safetensors")


@pytest.mark.parametrize("estimator", ["bptt", "recompute", "reuse"])
def test_rl_run_writes_metrics_and_a_loadable_checkpoint(source, tmp_path, capsys, estimator):
    out = tmp_path / estimator
    assert main(rl_args(source, out, "--estimator", estimator, "--eval-every", "2", "--eval-examples", "4")) == 0
    printed = capsys.readouterr().out
    assert "step 0: eval_reward" in printed and "eval_greedy_pass@1" in printed
    assert f"2 RL steps ({estimator})" in printed
    records = read_metrics(out)
    steps = [r for r in records if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in ("reward", "pass@1", "pass@3", "completion_len", "rollout_s", "update_s", "rollout_frac", "grad_norm"):
        assert all(key in r for r in steps), key
    assert ("endpoint_residual" in steps[0]) == (estimator != "bptt")
    assert [r["step"] for r in records if "eval_reward" in r] == [0, 2]
    assert [r["step"] for r in records if "eval_greedy_pass@1" in r] == [0, 2]
    model, _, config = ckpt.load_model(out)  # `looplm eval` / `generate` read it like a training checkpoint
    assert config["rl"]["config"]["estimator"] == estimator
    before, after = weights(source), weights(out)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the policy moved
    assert weights(source).keys() == before.keys()


def test_resume_continues_exactly(source, tmp_path):
    assert main(rl_args(source, tmp_path / "full", "--checkpoint-every", "1")) == 0
    assert main(rl_args(source, tmp_path / "split", "--steps", "1")) == 0
    assert main(rl_args(source, tmp_path / "split", "--resume")) == 0
    full, split = weights(tmp_path / "full"), weights(tmp_path / "split")
    for k in full:
        torch.testing.assert_close(split[k], full[k], rtol=0, atol=0, msg=k)
    rewards = lambda out: [r["reward"] for r in read_metrics(out) if "reward" in r]  # noqa: E731
    assert rewards(tmp_path / "split") == rewards(tmp_path / "full")


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--group-size", "1"), "group_size must be >= 2"),
        (("--depth", "0"), "depth must be in 1.."),
        (("--neumann", "-1"), "neumann must be >= 0"),
        (("--source", "nowhere.jsonl"), "neither 'tasks' nor a GSM8K-format JSONL"),
        (("--reward", "nope"), "unknown reward"),
        (("--checkpoint-every", "0"), "checkpoint_every must be >= 1"),  # failed after a step
        (("--kl-coef", "-1"), "kl_coef must be >= 0"),  # rewarded moving away from the start
        (("--beta2", "1.5"), r"beta2 must be in [0, 1)"),
        (("--min-difficulty", "0"), "difficulty"),  # was replaced by the checkpoint's, silently
    ],
)
def test_user_errors_are_one_line(source, tmp_path, capsys, extra, message):
    assert main(rl_args(source, tmp_path / "bad", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_never_writes_into_the_source_run_or_over_a_run(source, tmp_path, capsys):
    assert main(rl_args(source, source / "rl")) == 2
    assert "overlaps the source run" in capsys.readouterr().err
    assert main(rl_args(source, tmp_path / "once", "--steps", "1")) == 0
    assert main(rl_args(source, tmp_path / "once", "--steps", "1")) == 2
    assert "already holds RL checkpoints" in capsys.readouterr().err
    assert main(rl_args(source, tmp_path / "once", "--resume", "--lr", "5e-3")) == 2  # a changed setting
    assert "different RL config" in capsys.readouterr().err
    assert json.loads((ckpt.resolve(source) / "config.json").read_text()).get("rl") is None


def test_gsm8k_jsonl_source_with_a_kl_penalty(source, tmp_path):
    data = tmp_path / "gsm.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) for i in range(6)))
    out = tmp_path / "gsm"
    args = rl_args(
        source,
        out,
        "--source",
        data,
        "--eval-jsonl",
        data,
        "--eval-every",
        "1",
        "--eval-examples",
        "3",
        "--eval-samples",
        "2",
        "--kl-coef",
        "0.05",
        "--prompt-template",
        "Q:{question}\nA:",
        "--estimator",
        "bptt",
    )
    assert main(args) == 0
    records = [r for r in read_metrics(out) if "reward" in r]
    assert len(records) == 2 and all(r["kl"] >= 0 for r in records)
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the first step scores the starting model itself
    assert all("eval_reward" in r for r in records)


@pytest.mark.parametrize("estimator", ["bptt", "recompute", "reuse"])
def test_kl_is_zero_while_the_policy_is_the_reference_with_every_estimator(source, tmp_path, estimator):
    """The reference is scored along the estimator's own path (native depth R; one recurrence from
    rebuilt or saved endpoints), so the first step, which scores the starting model itself, logs a KL
    of 0; once the parameters move the KL is positive."""
    out = tmp_path / estimator
    assert main(rl_args(source, out, "--estimator", estimator, "--kl-coef", "0.05")) == 0
    kl = [r["kl"] for r in read_metrics(out) if "reward" in r]
    assert len(kl) == 2
    assert 0 <= kl[0] < 1e-7, kl
    assert kl[1] > 1e-6, kl


def test_start_up_line_resume_line_and_session_summary(source, tmp_path, capsys):
    out = tmp_path / "rl"
    assert main(rl_args(source, out, "--steps", "1")) == 0
    printed = capsys.readouterr().out.splitlines()
    (line,) = [x for x in printed if x.startswith("model: ")]
    assert ", vocab 258 (byte), context 64, estimator reuse at depth 2, device cpu, fp32" in line, line
    assert any(x.startswith("1 RL steps (reuse) in ") for x in printed), printed
    assert main(rl_args(source, out, "--resume")) == 0
    printed = capsys.readouterr().out.splitlines()
    assert f"resuming {out} from step 1 (of 2)" in printed
    assert any(x.startswith("RL steps 2..2 (1 this session, reuse) in ") for x in printed), printed


def test_each_completion_is_scored_against_its_own_problems_reference(source, tmp_path):
    """Row i*G + j is completion j of problem i: its reward reads problem i's reference. A reward
    that ignores the reference (the length reward above) could not tell a wrong pairing apart."""
    seen: list[str] = []
    register_reward("ref_seen", lambda ref, text: seen.append(ref) or 0.0)
    try:
        args = rl_args(source, tmp_path / "rl")
        args[args.index("length")] = "ref_seen"
        assert main(args) == 0
    finally:
        REWARDS.pop("ref_seen")
    G, P = 3, 2
    groups = [seen[i : i + G] for i in range(0, len(seen), G)]
    assert len(groups) == 2 * P  # two steps of P problems
    assert all(len(set(g)) == 1 for g in groups), groups  # a group's completions share one reference
    assert any(groups[2 * s][0] != groups[2 * s + 1][0] for s in range(2))  # problems that differ: the check bites
