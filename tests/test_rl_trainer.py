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
        (("--eval-samples", "0"), "eval_samples must be >= 1"),
        (("--beta1", "1"), r"beta1 must be in [0, 1)"),
        (("--clip-eps", "0"), "clip_eps must be > 0"),
        (("--grad-clip", "-1"), "grad_clip must be >= 0"),  # a negative clip disabled clipping silently
        (("--grad-clip", "nan"), "grad_clip must be a finite number"),  # so did NaN
        (("--kl-coef", "nan"), "kl_coef must be a finite number"),  # failed at step 1 as "lower --lr"
        (("--clip-eps", "nan"), "clip_eps must be a finite number"),
        (("--temperature", "nan"), "temperature must be a finite number"),  # an internal error in sampling
        (("--temperature", "inf"), "temperature must be a finite number"),  # uniform samples, no gradient
        (("--lr", "nan"), "lr must be a finite number"),  # an internal error from AdamW
        (("--eval-every", "1", "--eval-examples", "-1"), "eval_examples must be >= 0"),  # evaluated nothing silently
    ],
)
def test_user_errors_are_one_line(source, tmp_path, capsys, extra, message):
    assert main(rl_args(source, tmp_path / "bad", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_never_writes_into_the_source_run_or_over_a_run(source, tmp_path, capsys):
    assert main(rl_args(source, source / "rl")) == 2
    assert "overlaps the source run" in capsys.readouterr().err
    (tmp_path / "f.txt").write_text("x")  # a file as --out-dir: was "[Errno 17] File exists"
    assert main(rl_args(source, tmp_path / "f.txt")) == 2
    assert "is a file, not a folder: choose another --out-dir" in capsys.readouterr().err
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


def _trainer(src: Path, out: Path, **kw):
    from looplm.rl.config import RLConfig
    from looplm.rl.trainer import RLTrainer

    base = dict(
        out_dir=out,
        steps=2,
        prompts_per_step=2,
        group_size=3,
        depth=2,
        max_new_tokens=4,
        eval_every=0,
        reward="length",
        lr=1e-3,
        device="cpu",
        progress=False,
    )
    return RLTrainer(src, RLConfig(**{**base, **kw}))


def test_rl_defaults_are_the_designs():
    """Design §10: the reuse estimator with the paper's Neumann-4 update at depth 6, G = 8."""
    from looplm.rl.config import RLConfig

    cfg = RLConfig()
    assert (cfg.estimator, cfg.neumann, cfg.depth, cfg.group_size) == ("reuse", 4, 6, 8)
    assert (cfg.grad_clip, cfg.clip_eps, cfg.kl_coef, cfg.temperature) == (1.0, 0.2, 0.0, 1.0)


def test_grad_clip_zero_disables_clipping(source, tmp_path):
    """--grad-clip 0 means no clipping (the same step as an unreachable clip), not a clip to norm 0."""
    moved = []
    for name, clip in (("off", 0.0), ("huge", 1e9)):
        tr = _trainer(source, tmp_path / name, grad_clip=clip, steps=1)
        tr.train_step()
        moved.append({k: v.clone() for k, v in tr.model.state_dict().items()})
    before = weights(source)
    assert any(not torch.equal(before[k], moved[0][k]) for k in before)
    for k in moved[0]:
        torch.testing.assert_close(moved[0][k], moved[1][k], rtol=0, atol=0, msg=k)


def test_step_metrics_against_the_rollouts_and_rewards(source, tmp_path, monkeypatch):
    """Each step's reward, pass@1, pass@G, uniform-group fraction, completion lengths and stop fraction
    against the rollout the step sampled and a reward that marks exactly the first completion of
    every group correct (1.0): pass@1 = 1/G, pass@G = 1, no group is uniform."""
    from looplm.rl import trainer as T
    from looplm.rl.rollout import rollout

    seen = []

    def recording(*a, **k):
        seen.append(rollout(*a, **k))
        return seen[-1]

    monkeypatch.setattr(T, "rollout", recording)
    calls = []
    register_reward("first", lambda ref, text: calls.append(text) or float(len(calls) % 3 == 1))
    try:
        # stop at any digit or sign, so that some rows stop and others run to max_new_tokens
        tr = _trainer(source, tmp_path / "rl", reward="first", stop=tuple("0123456789+=,- "), max_new_tokens=6)
        records = [tr.train_step() for _ in range(2)]
    finally:
        REWARDS.pop("first")
    assert len(seen) == 2
    for rec, ro in zip(records, seen):
        lengths = ro.completion_lengths
        assert rec["reward"] == pytest.approx(1 / 3) and rec["pass@1"] == pytest.approx(1 / 3)
        assert rec["pass@3"] == 1.0 and rec["uniform_group_frac"] == 0.0
        assert rec["completion_len"] == pytest.approx(sum(lengths) / len(lengths))
        assert rec["completion_len_max"] == max(lengths)
        assert rec["stopped_frac"] == pytest.approx(sum(ro.stopped) / len(ro.stopped))
    assert any(0 < r["stopped_frac"] < 1 for r in records)
    assert any(max(ro.completion_lengths) != ro.completion_lengths[-1] for ro in seen)  # the max bites


def test_kl_is_zero_at_the_start_at_a_temperature(source, tmp_path):
    """The policy and the reference are both scored at the sampling temperature: the first step, where
    policy == reference, has KL 0 (every other KL test runs at temperature 1)."""
    tr = _trainer(source, tmp_path / "rl", kl_coef=0.05, temperature=0.6, steps=1)
    rec = tr.train_step()
    assert 0 <= rec["kl"] < 1e-7, rec


def test_greedy_pass_counts_a_reward_of_one_as_solved(source, tmp_path):
    """Held-out greedy pass@1 counts completions with reward >= 1 (exactly 1 is correct)."""
    register_reward("one", lambda ref, text: 1.0)
    try:
        tr = _trainer(source, tmp_path / "rl", reward="one", eval_examples=2, eval_samples=2)
        ev = tr.evaluate()
        rec = tr.train_step()
    finally:
        REWARDS.pop("one")
    assert ev == {"eval_reward": 1.0, "eval_greedy_pass@1": 1.0}
    assert rec["pass@1"] == 1.0 and rec["pass@3"] == 1.0 and rec["uniform_group_frac"] == 1.0


def test_the_last_step_is_evaluated_even_off_the_eval_period(source, tmp_path):
    out = tmp_path / "rl"
    assert main(rl_args(source, out, "--eval-every", "3", "--eval-examples", "2", "--eval-samples", "2")) == 0
    assert [r["step"] for r in read_metrics(out) if "eval_reward" in r] == [0, 2]


def test_resume_refuses_another_source_checkpoint(source, tmp_path, capsys):
    other = write_random_run(tmp_path / "other")
    out = tmp_path / "rl"
    assert main(rl_args(source, out, "--steps", "1")) == 0
    capsys.readouterr()
    assert main(rl_args(other, out, "--resume")) == 2
    err = capsys.readouterr().err
    assert "different RL config" in err and "source:" in err


def test_task_options_override_the_checkpoints_tasks(source, tmp_path):
    """--task-kinds and --max-difficulty replace the checkpoint's training tasks; the default stop for
    generator tasks is a newline, for a GSM8K file a blank line and 'Question:'."""
    tr = _trainer(source, tmp_path / "rl", task_kinds=("add",), max_difficulty=2)
    problems = tr.problems.draw(0, 16)
    assert {p.reference.kind for p in problems} == {"add"}
    assert max(p.reference.difficulty for p in problems) == 2
    assert tr.stop == ("\n",)
    data = tmp_path / "gsm.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}))
    assert _trainer(source, tmp_path / "gsm", source=str(data)).stop == ("\n\n", "Question:")


def test_config_validation_bounds():
    """validate() refuses steps < 1, lr <= 0 and a negative eval period, and accepts the edge values that
    are meaningful: neumann 0 (plain one-recurrence backprop), beta1 = beta2 = 0."""
    from looplm.errors import UserError
    from looplm.rl.config import RLConfig

    for bad, message in (
        (dict(steps=0), "steps must be >= 1"),
        (dict(lr=0.0), "lr"),
        (dict(eval_every=-1), "eval_every must be >= 0"),
    ):
        with pytest.raises(UserError, match=message):
            RLConfig(**bad).validate(8)
    RLConfig(neumann=0, beta1=0.0, beta2=0.0, eval_every=0, grad_clip=0.0).validate(8)


def test_step_loss_is_the_token_mean_of_the_group_normalised_advantages(source, tmp_path, monkeypatch):
    """With one inner iteration the ratio is 1 and there is no KL: loss = -sum_i A_i n_i / sum_i n_i over the
    rows i (n_i action tokens), A normalised within each group of G = 3 consecutive rows, here the rewards
    1, 0, 0 of every group (so A = (2/3, -1/3, -1/3) / (sqrt(1/3) + 1e-4))."""
    from looplm.rl import trainer as T
    from looplm.rl.rollout import rollout

    seen = []
    monkeypatch.setattr(T, "rollout", lambda *a, **k: seen.append(rollout(*a, **k)) or seen[-1])
    calls = []
    register_reward("first", lambda ref, text: calls.append(text) or float(len(calls) % 3 == 1))
    try:
        # stop at any digit or sign, so that completions have several lengths
        tr = _trainer(source, tmp_path / "rl", reward="first", steps=1, stop=tuple("0123456789+=,- "), max_new_tokens=6)
        rec = tr.train_step()
    finally:
        REWARDS.pop("first")
    (ro,) = seen
    s = (1 / 3) ** 0.5 + 1e-4
    adv = [a / s for _ in range(2) for a in (2 / 3, -1 / 3, -1 / 3)]
    n = ro.completion_lengths
    assert len(set(n)) > 1  # rows of several lengths: the weighting bites
    assert rec["loss"] == pytest.approx(-sum(a * k for a, k in zip(adv, n)) / sum(n), rel=1e-5)


def test_logp_gap_compares_the_scored_and_sampling_policies_over_the_tokenizers_ids(tmp_path, monkeypatch):
    """logp_gap = the mean over action tokens of |log pi_scored - log pi_sampling|. With bptt the scored
    policy is the native forward, normalised (as the rollout samples) over the tokenizer's ids only, here
    on a model whose head is padded past them."""
    from _jobs import tiny_job

    from looplm.data import ByteTokenizer
    from looplm.model import LoopedLM
    from looplm.rl import trainer as T
    from looplm.rl.rollout import rollout

    root = tmp_path / "padded"
    job = tiny_job(tmp_path, "padded")
    job.model.vocab_size = ByteTokenizer().vocab_size + 14
    torch.manual_seed(0)
    ckpt.save_model(root, LoopedLM(job.model), job.to_dict(), ByteTokenizer())
    seen = []
    monkeypatch.setattr(T, "rollout", lambda *a, **k: seen.append(rollout(*a, **k)) or seen[-1])
    tr = _trainer(root, tmp_path / "rl", estimator="bptt", steps=1, temperature=0.8)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    model = LoopedLM(tr.model.cfg)
    model.load_state_dict(before)
    rec = tr.train_step()
    (ro,) = seen
    with torch.no_grad():
        logits = model(ro.tokens, 2, init="seeded", example_ids=ro.example_ids).logits[
            ..., : ByteTokenizer().vocab_size
        ]
    logp = torch.log_softmax(logits / 0.8, -1).gather(-1, ro.targets[..., None])[..., 0]
    want = float((logp - ro.logprobs).abs()[ro.mask].mean())
    assert rec["logp_gap"] == pytest.approx(want, rel=1e-3, abs=1e-6)


def test_rl_prints_no_eval_line_when_there_are_no_eval_problems(source, tmp_path, capsys):
    """--eval-every with --eval-examples 0 measures nothing: no empty `step N: ` lines, only the summary."""
    assert main(rl_args(source, tmp_path / "noeval", "--steps", "1", "--eval-every", "1", "--eval-examples", "0")) == 0
    printed = capsys.readouterr().out
    assert not [line for line in printed.splitlines() if line.startswith("step ")], printed
    assert "1 RL steps (" in printed
