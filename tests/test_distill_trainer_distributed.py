"""Data-parallel distillation on CPU (gloo): `looplm distill` under torchrun with 2 ranks x 2 rows
equals one process x 4 rows (the same global batch): the energy, the loss curve, validation and the
final student; rank 0 alone writes the checkpoint, the metrics and the summary."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest
import torch
from _jobs import one_thread, read_metrics, shared_cache, step_records, subprocess_env, tiny_job, torchrun_cmd

from looplm import checkpoint as ckpt
from looplm.cli import main
from looplm.distill.config import DistillConfig
from looplm.distill.trainer import DistillTrainer
from looplm.train.distributed import DistEnv
from looplm.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread

# One rank: run the CLI, recording every validation this rank computed, every checkpoint it wrote and
# its shutdown of the process group.
RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys

    import torch

    from looplm import checkpoint as ckpt
    from looplm.cli import main
    from looplm.distill.trainer import DistillTrainer
    from looplm.train import distributed as D

    torch.set_num_threads(1)
    report, args = sys.argv[1], sys.argv[2:]
    seen, vals, writes, shutdowns = {}, [], [], []
    fit, validate, save_step, shutdown = DistillTrainer.fit, DistillTrainer.validate, ckpt.save_step, D.shutdown

    def recording_fit(self):
        seen["trainer"] = self
        return fit(self)

    def recording_validate(self):
        vals.append(validate(self))
        return vals[-1]

    def recording_save_step(root, step, *a, **k):
        writes.append(step)
        return save_step(root, step, *a, **k)

    def recording_shutdown(env):
        shutdowns.append(env.distributed)
        shutdown(env)

    DistillTrainer.fit, DistillTrainer.validate, ckpt.save_step = recording_fit, recording_validate, recording_save_step
    D.shutdown = recording_shutdown
    rc = main(args)
    tr = seen["trainer"]
    with open(os.path.join(report, f"rank{tr.env.rank}.json"), "w") as f:
        json.dump({"rc": rc, "world_size": tr.env.world_size, "distributed": tr.env.distributed,
                   "step": tr.step, "energy": tr.energy, "vals": vals, "writes": writes, "shutdowns": shutdowns}, f)
""")

TORCHRUN_TIMEOUT = 300
STEPS = 4


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A 32-wide 1/2/1 teacher trained 4 steps on the task generator."""
    tmp = tmp_path_factory.mktemp("teacher")
    with one_thread():
        Trainer(tiny_job(tmp, "teacher", cache=shared_cache(tmp_path_factory), train__steps=4)).fit()
    return ckpt.resolve(tmp / "teacher")


def distill_args(teacher, out) -> list[str]:
    # 5 validation rows split 3 + 2 over the ranks, so the reduced means must weight the ranks by their tokens
    return [
        "distill",
        str(teacher),
        "--out-dir",
        str(out),
        "--depth",
        "2",
        "--steps",
        str(STEPS),
        "--micro-batch",
        "4",
        "--calibration-rows",
        "6",
        "--val-rows",
        "5",
        "--val-every",
        "2",
        "--log-every",
        "1",
        "--checkpoint-every",
        "100",
        "--init",
        "random",
        "--lr",
        "3e-3",
        "--warmup",
        "1",
        "--no-progress",
        "--device",
        "cpu",
        "--report-rows",
        "0",
        "--report-examples",
        "0",
    ]


@pytest.fixture(scope="module")
def runs(teacher, tmp_path_factory):
    """(one process, {rank: report}, torchrun output) of the same distillation."""
    root = tmp_path_factory.mktemp("distill-dp")
    with one_thread():
        assert main(distill_args(teacher, root / "single")) == 0
    (root / "rank.py").write_text(RANK_SCRIPT)
    reports = root / "reports"
    reports.mkdir()
    cmd = torchrun_cmd(2, root / "rank.py", reports, *distill_args(teacher, root / "ranks"))
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT, cwd=root)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return root, {r: json.loads((reports / f"rank{r}.json").read_text()) for r in range(2)}, proc.stdout


@pytest.mark.slow
def test_two_ranks_match_one_process(runs):
    root, reports, stdout = runs
    assert all(
        r["rc"] == 0 and r["world_size"] == 2 and r["distributed"] and r["step"] == STEPS and r["shutdowns"] == [True]
        for r in reports.values()
    )
    single = ckpt.resolve(root / "single")
    ref_state = ckpt.read_json(single, "distill_state.json")
    # every rank calibrated the same E (the calibration rows were split over the ranks), close to one process's
    assert reports[0]["energy"] == reports[1]["energy"]
    assert reports[0]["energy"] == pytest.approx(ref_state["energy"], rel=1e-6)
    # the same loss curve as one process on the same global batch
    ref, got = step_records(root / "single"), step_records(root / "ranks")
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for s in ref:
        for key in ("loss", "mse_norm", "kl", "grad_norm"):
            assert got[s][key] == pytest.approx(ref[s][key], rel=1e-5, abs=1e-8), (s, key)
        assert got[s]["lr"] == ref[s]["lr"]
    # validation (steps 2 and 4): identical on the ranks, and one process's numbers
    assert len(reports[0]["vals"]) == 2 and reports[0]["vals"] == reports[1]["vals"]
    ref_vals = [r for r in read_metrics(root / "single") if "val_loss" in r]
    got_vals = [r for r in read_metrics(root / "ranks") if "val_loss" in r]
    assert [r["step"] for r in got_vals] == [r["step"] for r in ref_vals] == [2, 4]
    for a, b in zip(got_vals, ref_vals):
        for key in ("val_loss", "val_mse_norm", "val_kl", "val_rel_err", "val_rel_err_next"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
    # rank 0 alone wrote the checkpoint, the metrics and the summary; the student is one process's
    assert reports[0]["writes"] == [STEPS] and reports[1]["writes"] == []
    assert sorted(p.name for p in (root / "ranks" / "checkpoints").iterdir()) == ["latest", f"step_{STEPS:07d}"]
    assert stdout.count(f"distilled {STEPS} steps") == 1
    state = ckpt.read_json(ckpt.resolve(root / "ranks"), "distill_state.json")
    assert state["step"] == STEPS and state["energy"] == reports[0]["energy"]
    a = ckpt.load_tensors(single, "student.safetensors")
    b = ckpt.load_tensors(ckpt.resolve(root / "ranks"), "student.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6, msg=k)


def test_global_batch_must_split_over_the_ranks(teacher, tmp_path):
    cfg = DistillConfig(out_dir=tmp_path / "d", micro_batch=4, device="cpu", progress=False)
    with pytest.raises(ValueError, match="divisible by the number of ranks, 3"):
        DistillTrainer(teacher, cfg, env=DistEnv(world_size=3))
