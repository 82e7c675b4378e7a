"""`looplm distill`: the loss falls on a toy teacher, E is calibrated once, resume reproduces a run, and
`--prefill` / `--student` in generate and eval (design §9)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _jobs import one_thread, read_metrics, shared_cache, tiny_job

from looplm import checkpoint as ckpt
from looplm.cli import main
from looplm.distill import load_student
from looplm.distill.config import DistillConfig
from looplm.distill.trainer import DistillTrainer, calibration_rows, teacher_targets
from looplm.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A 32-wide 1/2/1 teacher trained 8 steps on the task generator (the shrunken tiny job)."""
    tmp = tmp_path_factory.mktemp("teacher")
    with one_thread():
        Trainer(tiny_job(tmp, "teacher", cache=shared_cache(tmp_path_factory))).fit()
    return ckpt.resolve(tmp / "teacher")


def _cfg(tmp_path, name="distill", **kw) -> DistillConfig:
    base = dict(
        out_dir=tmp_path / name,
        depth=3,
        steps=30,
        micro_batch=4,
        calibration_rows=8,
        val_rows=8,
        val_every=0,
        log_every=1,
        checkpoint_every=1000,
        progress=False,
        device="cpu",
        report_rows=0,
        report_examples=0,
    )
    return DistillConfig(**{**base, **kw})


def expected_lr(step: int, steps: int, warmup: int, peak: float) -> float:
    """design §9 schedule in closed form, for the update after `step` steps (u = step + 1 updates done):
    linear warm-up u / W to the peak, reached exactly at u = W; then a cosine from the peak at u = W
    to 0.1x at u = steps over the remaining steps."""
    u = step + 1
    if u <= warmup:
        return peak * u / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (u - warmup) / (steps - warmup))))


def test_loss_falls_on_a_toy_teacher_and_energy_is_calibrated_in_fp64(teacher, tmp_path):
    tr = DistillTrainer(teacher, _cfg(tmp_path, init="random", lr=3e-3))
    # E against a direct fp64 computation over 8 evenly spaced training rows
    n = len(tr.train_data)
    t = teacher_targets(tr.teacher, tr.train_data.get_batch([i * n // 8 for i in range(8)]), 3)
    assert math.isclose(tr.energy, t.endpoint.double().pow(2).mean().item(), rel_tol=1e-9)
    before = tr.validate()
    summary = tr.fit()
    records = [r for r in read_metrics(tmp_path / "distill") if "loss" in r]
    losses = [r["loss"] for r in records]
    assert len(losses) == 30
    # metrics step s logs the lr of the s-th update: the peak at step 8 (the default warm-up), 0.1x at 30
    assert [r["lr"] for r in records] == pytest.approx(
        [expected_lr(s - 1, 30, 8, 3e-3) for s in range(1, 31)], rel=1e-12
    )
    assert records[7]["lr"] == 3e-3 and records[-1]["lr"] == pytest.approx(3e-4, rel=1e-12)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:3]) / 3, losses
    assert summary["val_rel_err"] < 0.7 * before["val_rel_err"], (before, summary)
    assert summary["val_loss"] < before["val_loss"]
    # the checkpoint records the energy and refuses nothing for its own teacher
    state = ckpt.read_json(ckpt.resolve(tmp_path / "distill"), "distill_state.json")
    assert state["energy"] == tr.energy and state["step"] == 30
    student, meta = load_student(tmp_path / "distill", tr.teacher)
    assert meta["depth"] == 3 and meta["init"] == "random"


def test_energy_is_calibrated_on_training_rows_not_held_out_rows(teacher, tmp_path):
    """Paper §3.2: the teacher-state energy is calibrated on training data. The rows are spread evenly
    over the training split (row i * n // k), the same on every rank."""
    tr = DistillTrainer(teacher, _cfg(tmp_path, calibration_rows=5, val_rows=4))
    n = len(tr.train_data)
    assert n >= 10  # the spread rows are not simply the first five
    rows = [i * n // 5 for i in range(5)]
    t = teacher_targets(tr.teacher, tr.train_data.get_batch(rows), 3)
    want = float(t.endpoint.double().pow(2).sum() / t.endpoint.numel())
    assert math.isclose(tr.energy, want, rel_tol=1e-9)
    held_out = teacher_targets(tr.teacher, tr.val_data.get_batch(list(range(5))), 3).endpoint.double().pow(2).mean()
    assert not math.isclose(tr.energy, float(held_out), rel_tol=1e-6)  # the split matters
    assert tr.val_rows == [0, 1, 2, 3]  # validation stays on held-out rows


@pytest.mark.parametrize("steps, warmup", [(30, 8), (12, 3), (10, 1), (6, 0), (4, 8)])
def test_lr_warms_up_to_the_peak_then_cosine_decays_to_a_tenth(teacher, tmp_path, steps, warmup):
    tr = DistillTrainer(teacher, _cfg(tmp_path, steps=steps, warmup=warmup, lr=2e-3, calibration_rows=1))
    got = [tr.lr_at(t) for t in range(steps)]
    assert got == pytest.approx([expected_lr(t, steps, warmup, 2e-3) for t in range(steps)], rel=1e-12, abs=0)
    if 0 < warmup <= steps:
        assert got[warmup - 1] == 2e-3  # exactly the peak at the end of warm-up, and never above it
        assert got[:warmup] == sorted(got[:warmup]) and got[0] == pytest.approx(2e-3 / warmup, rel=1e-12)
    if warmup < steps:
        assert got[warmup:] == sorted(got[warmup:], reverse=True) and max(got) <= 2e-3
        assert got[-1] == pytest.approx(2e-4, rel=1e-12)  # the last update runs at 0.1x


def test_weight_decay_spares_the_students_norm_gains_and_validation_needs_rows(teacher, tmp_path):
    tr = DistillTrainer(teacher, _cfg(tmp_path, weight_decay=0.1))
    decayed = {id(p) for g in tr.optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    names = {n for n, p in tr.student.named_parameters() if id(p) in decayed}
    assert names == {n for n, p in tr.student.named_parameters() if p.ndim >= 2}  # matrices only (design §12)
    assert any("norm" in n for n, _ in tr.student.named_parameters())
    with pytest.raises(ValueError, match="val_rows must be >= 1"):  # it reported a perfect 0.0000 before
        DistillTrainer(teacher, _cfg(tmp_path, "none", val_rows=0))


def test_teacher_init_starts_closer_than_random_init(teacher, tmp_path):
    """Near a fixed point the one-recurrence state from zero is already a fair guess of z^R."""
    errs = {
        init: DistillTrainer(teacher, _cfg(tmp_path, init, init=init)).validate()["val_rel_err"]
        for init in ("teacher", "random")
    }
    assert errs["teacher"] < errs["random"], errs


def test_resume_reproduces_an_uninterrupted_run(teacher, tmp_path):
    full = DistillTrainer(teacher, _cfg(tmp_path, "full", steps=6))
    full.fit()
    part = DistillTrainer(teacher, _cfg(tmp_path, "part", steps=6))
    for _ in range(3):
        part.train_step()
    part.save()
    with pytest.raises(ValueError, match="--resume"):
        DistillTrainer(teacher, _cfg(tmp_path, "part", steps=6))
    with pytest.raises(ckpt.CheckpointError, match="different config"):
        DistillTrainer(teacher, _cfg(tmp_path, "part", steps=6, lr=2e-3, resume=True))
    resumed = DistillTrainer(teacher, _cfg(tmp_path, "part", steps=6, resume=True))
    assert resumed.step == 3 and resumed.energy == full.energy
    resumed.fit()
    for (k, a), b in zip(full.student.state_dict().items(), resumed.student.state_dict().values()):
        assert torch.equal(a, b), k
    tail = lambda name: [r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r][-3:]  # noqa: E731
    assert tail("full") == tail("part")


def test_cli_distill_then_generate_and_eval_with_each_prefill_arm(teacher, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(
        [
            "distill",
            str(teacher),
            "--out-dir",
            str(out),
            "--depth",
            "2",
            "--steps",
            "4",
            "--micro-batch",
            "2",
            "--calibration-rows",
            "4",
            "--val-rows",
            "4",
            "--no-progress",
            "--device",
            "cpu",
            "--report-rows",
            "4",
            "--report-examples",
            "8",
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads((out / "report.json").read_text())
    assert set(report["prefill"]) == {"teacher", "student", "r1", "r2"}
    assert (
        report["prefill"]["student"]["2"]["block_passes"] == 6
        and report["prefill"]["teacher"]["2"]["block_passes"] == 6
    )
    for arm in ("teacher", "student", "r1", "r2"):
        assert arm in printed
    # generate with the student's prefill; and the arms table from looplm eval
    assert (
        main(
            [
                "generate",
                str(teacher),
                "--prompt",
                "+12,34=",
                "--depth",
                "2",
                "--prefill",
                "student",
                "--student",
                str(out),
                "--max-new-tokens",
                "4",
            ]
        )
        == 0
    )
    eval_json = tmp_path / "eval.json"
    assert (
        main(
            [
                "eval",
                str(teacher),
                "--depths",
                "2",
                "--prefill",
                "teacher",
                "student",
                "r1",
                "--student",
                str(out),
                "--max-sequences",
                "4",
                "--task-examples",
                "8",
                "--sharing-sequences",
                "4",
                "--output",
                str(eval_json),
            ]
        )
        == 0
    )
    table = json.loads(eval_json.read_text())["prefill"]
    assert list(table) == ["teacher", "student", "r1"] and 0 < table["student"]["2"]["n"] <= 8  # seen prompts dropped
    assert "prefill arms" in capsys.readouterr().out


def test_cli_refuses_a_student_of_another_teacher_and_a_missing_student(teacher, tmp_path, tmp_path_factory, capsys):
    other = tmp_path / "other"
    Trainer(tiny_job(tmp_path, "other", cache=shared_cache(tmp_path_factory), train__seed=1, train__steps=2)).fit()
    out = tmp_path / "s"
    assert (
        main(
            [
                "distill",
                str(other),
                "--out-dir",
                str(out),
                "--steps",
                "1",
                "--micro-batch",
                "2",
                "--calibration-rows",
                "2",
                "--val-rows",
                "2",
                "--no-progress",
                "--device",
                "cpu",
                "--report-rows",
                "0",
                "--report-examples",
                "0",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["generate", str(teacher), "--prefill", "student", "--student", str(out)]) == 2
    assert "another teacher" in capsys.readouterr().err
    assert main(["generate", str(teacher), "--prefill", "student"]) == 2
    assert "--student" in capsys.readouterr().err
    # the student given as the model (an easy slip): one line naming it, not "[Errno 2] ... config.json"
    for command in (["generate", str(out), "--prompt", "x"], ["eval", str(out)], ["export", str(out), tmp_path / "h"]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is a distilled prefill student, not a looped model" in err[0], err
    # a file as --out-dir: one line before any work (was "[Errno 17] File exists")
    (tmp_path / "f.txt").write_text("x")
    assert main(["distill", str(teacher), "--out-dir", str(tmp_path / "f.txt"), "--steps", "1", "--no-progress"]) == 2
    assert "is a file, not a folder: choose another --out-dir" in capsys.readouterr().err


def test_start_up_line_resume_line_and_session_summary(teacher, tmp_path, capsys):
    """distill says what it trains before the first step, where a resume starts, and counts a resumed
    session's steps as the run numbers them."""
    args = [
        "distill",
        str(teacher),
        "--out-dir",
        str(tmp_path / "d"),
        "--depth",
        "2",
        "--micro-batch",
        "2",
        "--calibration-rows",
        "4",
        "--val-rows",
        "4",
        "--no-progress",
        "--device",
        "cpu",
        "--report-rows",
        "0",
        "--report-examples",
        "0",
        "--checkpoint-every",
        "2",
    ]
    assert main([*args, "--steps", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    (line,) = [x for x in out if x.startswith("teacher: ")]
    assert ", vocab 258 (byte), context 64, student " in line and " at R 2, device cpu, fp32" in line, line
    assert any(x.startswith("distilled 2 steps in ") for x in out), out
    part = DistillTrainer(
        teacher,
        DistillConfig(
            out_dir=tmp_path / "p",
            depth=2,
            micro_batch=2,
            calibration_rows=4,
            val_rows=4,
            progress=False,
            device="cpu",
            report_rows=0,
            report_examples=0,
            checkpoint_every=2,
            steps=3,
        ),
    )
    for _ in range(2):
        part.train_step()
    part.save()
    capsys.readouterr()
    assert main([*args, "--out-dir", str(tmp_path / "p"), "--steps", "3", "--resume"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"resuming {tmp_path / 'p'} from step 2 (of 3)" in out
    assert any(x.startswith("distilled steps 3..3 (1 this session) in ") for x in out), out


def test_calibration_rows_are_spread_evenly_and_never_repeat():
    assert calibration_rows(12, 5) == [0, 2, 4, 7, 9]  # i * n // k, not i * (n // k)
    assert calibration_rows(3, 5) == [0, 1, 2]  # more rows asked than the split has: each row once
    assert calibration_rows(4, 4) == [0, 1, 2, 3]


def test_distill_defaults_are_the_designs():
    """Design §9: AdamW (0.9, 0.95), no weight decay, clip 1.0, warm-up 8, beta = 1, teacher init, R = 5."""
    cfg = DistillConfig()
    assert (cfg.beta1, cfg.beta2, cfg.weight_decay, cfg.grad_clip) == (0.9, 0.95, 0.0, 1.0)
    assert (cfg.warmup, cfg.kl_weight, cfg.init, cfg.depth) == (8, 1.0, "teacher", 5)


def test_grad_clip_zero_disables_clipping(teacher, tmp_path):
    """--grad-clip 0 means no clipping (the same steps as an unreachable clip), not a clip to norm 0."""
    students = []
    for name, clip in (("off", 0.0), ("huge", 1e9)):
        tr = DistillTrainer(teacher, _cfg(tmp_path, name, grad_clip=clip, steps=2, warmup=0))
        before = {k: v.clone() for k, v in tr.student.state_dict().items()}
        tr.train_step()
        tr.train_step()
        students.append(tr.student.state_dict())
    assert any(not torch.equal(before[k], students[0][k]) for k in before)
    for k in students[0]:
        assert torch.equal(students[0][k], students[1][k]), k


def test_validation_is_a_token_mean_against_a_direct_computation(teacher, tmp_path):
    """val_rel_err = mean over held-out tokens of |z_hat - z^R| / |z^R|, val_rel_err_next the same after
    one teacher recurrence (z^{R+1} of the native forward on the target side), val_mse_norm the MSE / E;
    over 8 rows scored in two microbatches of 4."""
    tr = DistillTrainer(teacher, _cfg(tmp_path, init="random"))
    got = tr.validate()
    b = tr.val_data.get_batch(list(range(8)))
    t = teacher_targets(tr.teacher, b, 3)
    kw = dict(init="seeded", example_ids=b.example_ids, doc_ids=b.doc_ids, positions=b.positions)
    with torch.no_grad():
        z_r = tr.teacher(b.inputs, 3, **kw).endpoint.double()
        z_next = tr.teacher(b.inputs, 4, **kw).endpoint.double()
        z_hat = tr.student(t.prelude, t.rope, t.mask, values=t.ctx.core_values)
        z_hat_next = tr.teacher.recurrence(z_hat, t.ctx).double()
    z_hat = z_hat.double()
    rel = ((z_hat - z_r).norm(dim=-1) / z_r.norm(dim=-1)).mean()
    rel_next = ((z_hat_next - z_next).norm(dim=-1) / z_next.norm(dim=-1)).mean()
    assert got["val_rel_err"] == pytest.approx(float(rel), rel=1e-4)
    assert got["val_rel_err_next"] == pytest.approx(float(rel_next), rel=1e-4)
    assert got["val_mse_norm"] == pytest.approx(float((z_hat - z_r).pow(2).mean() / tr.energy), rel=1e-4)


def test_the_last_step_is_logged_and_validated_off_the_periods(teacher, tmp_path):
    DistillTrainer(teacher, _cfg(tmp_path, steps=6, log_every=4, val_every=0)).fit()
    records = read_metrics(tmp_path / "distill")
    assert [r["step"] for r in records if "loss" in r] == [4, 6]
    assert [r["step"] for r in records if "val_rel_err" in r] == [6]


def test_random_init_is_a_function_of_the_seed(teacher, tmp_path):
    """The random-init ablation is reproducible: the same seed gives the same student, whatever the
    global RNG did before; another seed another student."""
    a = DistillTrainer(teacher, _cfg(tmp_path, "a", init="random", seed=3)).student.state_dict()
    torch.randn(100)
    b = DistillTrainer(teacher, _cfg(tmp_path, "b", init="random", seed=3)).student.state_dict()
    c = DistillTrainer(teacher, _cfg(tmp_path, "c", init="random", seed=4)).student.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["in_proj.weight"], c["in_proj.weight"])


def test_resume_may_change_the_validation_period(teacher, tmp_path):
    part = DistillTrainer(teacher, _cfg(tmp_path, "part", steps=4))
    part.train_step()
    part.save()
    resumed = DistillTrainer(teacher, _cfg(tmp_path, "part", steps=4, val_every=2, log_every=3, resume=True))
    assert resumed.step == 1


def test_the_seed_picks_the_data_order(teacher, tmp_path):
    """Teacher init makes the same student whatever the seed, so the first step's loss differs between
    seeds only through the rows the seed draws: the same seed the same loss, another seed another."""
    losses = [
        DistillTrainer(teacher, _cfg(tmp_path, name, seed=seed, steps=1, warmup=0)).train_step()["loss"]
        for name, seed in (("a", 3), ("b", 3), ("c", 4))
    ]
    assert losses[0] == losses[1] and losses[0] != losses[2], losses


def test_a_value_embedding_teacher_distils(tmp_path, tmp_path_factory):
    """A teacher with value embeddings: the training step and validation hand the student the core's
    value embeddings (the student refuses to run without them)."""
    Trainer(
        tiny_job(tmp_path, "ve", cache=shared_cache(tmp_path_factory), model__value_embeds="odd", train__steps=1)
    ).fit()
    tr = DistillTrainer(ckpt.resolve(tmp_path / "ve"), _cfg(tmp_path, steps=2, val_rows=2, calibration_rows=2))
    assert tr.teacher.cfg.value_embeds == "odd"
    assert math.isfinite(tr.train_step()["loss"]) and math.isfinite(tr.validate()["val_loss"])


def test_depth_outside_the_teachers_range_is_refused(teacher, tmp_path):
    """R must be a depth the teacher runs: 1..max_depth (0 would regress the student to the noise s^0)."""
    max_depth = ckpt.load_model(teacher, "cpu")[0].cfg.max_depth
    for depth in (0, max_depth + 1):
        with pytest.raises(ValueError, match=r"depth must be in 1\.\."):
            DistillTrainer(teacher, _cfg(tmp_path, f"d{depth}", depth=depth))


@pytest.mark.parametrize("change", [dict(depth=2), dict(seed=5)])
def test_resume_refuses_another_depth_or_seed(teacher, tmp_path, change):
    """The target depth and the seed (init and data order) define the run: a resume may not change them."""
    part = DistillTrainer(teacher, _cfg(tmp_path, "part", steps=4))
    part.train_step()
    part.save()
    with pytest.raises(ckpt.CheckpointError, match="different config"):
        DistillTrainer(teacher, _cfg(tmp_path, "part", steps=4, resume=True, **change))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("lr", 0.0, "lr must be > 0"),
        ("student_blocks", 0, "student_blocks must be >= 1"),  # 0 would silently mean the core's count
        ("kl_weight", -0.5, "kl_weight must be >= 0"),
        ("beta2", 1.0, r"beta2 must be in \[0, 1\)"),
        ("lr", float("nan"), "lr must be a finite number"),  # NaN passed `lr <= 0`
        ("kl_weight", float("nan"), "kl_weight must be a finite number"),
        ("grad_clip", float("nan"), "grad_clip must be a finite number"),
    ],
)
def test_distill_config_refuses_out_of_range_settings(field, value, message):
    with pytest.raises(ValueError, match=message):
        DistillConfig(**{field: value}).validate()


def test_the_arms_report_compares_all_four_arms_on_evals_held_out_examples(teacher, monkeypatch):
    """arms_after_distill: teacher, student, r1 and r2 at the distilled depth, on the generator examples
    `looplm eval` scores (drawn with its task seed), none when n_examples = 0."""
    from looplm.distill import evaluate
    from looplm.eval.report import EvalConfig

    seen = {}

    def fake(model, tokenizer, val, examples, arms, depths, **kw):
        seen.update(examples=examples, arms=[a.arm for a in arms], depths=depths, **kw)
        return {}

    monkeypatch.setattr(evaluate, "prefill_table", fake)
    data = ckpt.load_data(teacher)
    student = object()
    evaluate.arms_after_distill(None, None, data, [], student, 3, rows=2, n_examples=6)
    assert seen["arms"] == ["teacher", "student", "r1", "r2"] and seen["depths"] == (3,) and seen["rows"] == 2
    want = data.held_out_examples(6, EvalConfig().task_seed)
    assert seen["examples"] == want and want
    evaluate.arms_after_distill(None, None, data, [], student, 3, rows=2, n_examples=0)
    assert seen["examples"] == []


def test_cli_distill_reports_the_arms_with_task_examples_alone(teacher, tmp_path, capsys):
    """--report-rows 0 with --report-examples N still compares the prefill arms (on generator tasks
    alone): the report holds every arm and the table is printed (guards `report_rows or report_examples`)."""
    out = tmp_path / "examples-only"
    argv = ["distill", teacher, "--out-dir", out, "--depth", 2, "--steps", 1, "--micro-batch", 2]
    argv += ["--calibration-rows", 2, "--val-rows", 2, "--no-progress", "--device", "cpu"]
    assert main([*map(str, argv), "--report-rows", "0", "--report-examples", "2"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert set(report["prefill"]) == {"teacher", "student", "r1", "r2"}, report.keys()
    assert "prefill arms at R = 2" in printed
