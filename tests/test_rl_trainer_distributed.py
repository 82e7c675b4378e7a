"""Data-parallel RL on CPU (gloo): `looplm rl` under torchrun with 2 ranks x 2 prompts equals one
process x 4 prompts with every estimator: the same rollouts (each prompt samples from its own
seeded generator), the same reduced metrics and held-out evaluation, and the same final weights;
rank 0 alone writes the checkpoint and prints."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
from _jobs import one_thread, read_metrics, step_records, subprocess_env, torchrun_cmd, write_random_run

from looplm import checkpoint as ckpt
from looplm.cli import main
from looplm.rl import REWARDS, register_reward
from looplm.rl import trainer as rl_trainer
from looplm.rl.config import RLConfig
from looplm.rl.trainer import RLTrainer
from looplm.train.distributed import DistEnv

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread

# One rank: run the CLI once per argument list, recording the training rollouts this rank sampled
# (by example id), the checkpoints it wrote and its shutdown calls. One launch runs every estimator
# (starting torchrun and its ranks costs most of the time), so the group is kept between the runs:
# a gloo group created again in the same launch can read its predecessor's stale address.
RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys

    import torch

    from looplm import checkpoint as ckpt
    from looplm.cli import main
    from looplm.rl import register_reward
    from looplm.rl import trainer as T
    from looplm.train import distributed as D

    torch.set_num_threads(1)
    register_reward("length", lambda ref, text: float(len(text)))
    report, runs = sys.argv[1], json.loads(open(sys.argv[2]).read())
    rank = int(os.environ["RANK"])
    rollout, save_step, init, shutdown = T.rollout, ckpt.save_step, T.RLTrainer.__init__, D.shutdown
    for name, args in runs.items():
        rows, writes, envs, shutdowns = {}, [], [], []

        def recording_rollout(*a, **k):
            ro = rollout(*a, **k)
            if k["first_example_id"] < 10**9:  # training rollouts (evaluation ids start at 1e9)
                rows.update({str(k["first_example_id"] + i): c for i, c in enumerate(ro.completions)})
            return ro

        def recording_save_step(root, step, *a, **k):
            writes.append(step)
            return save_step(root, step, *a, **k)

        def recording_init(self, *a, **k):
            init(self, *a, **k)
            envs.append([self.env.world_size, self.env.distributed])

        T.rollout, ckpt.save_step, T.RLTrainer.__init__ = recording_rollout, recording_save_step, recording_init
        D.shutdown = lambda env: shutdowns.append(env.distributed)
        rc = main(args)
        with open(os.path.join(report, f"{name}-rank{rank}.json"), "w") as f:
            json.dump({"rc": rc, "env": envs, "rows": rows, "writes": writes, "shutdowns": shutdowns}, f)
    shutdown(D.init_distributed("cpu"))
""")

TORCHRUN_TIMEOUT = 300
STEPS = 3
RUNS = {  # name: extra flags; evaluation (40 problems: chunks of 32 and 8, one per rank) once, a KL penalty once
    "bptt": ("--estimator", "bptt"),
    "recompute": ("--estimator", "recompute", "--kl-coef", "0.05"),
    "reuse": ("--estimator", "reuse", "--eval-every", str(STEPS), "--eval-examples", "40", "--eval-samples", "2"),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A run folder holding one checkpoint of a random tiny byte-level model."""
    root = tmp_path_factory.mktemp("rl-dp") / "pretrain"
    return write_random_run(root)


def rl_args(source: Path, out: Path, extra) -> list[str]:
    # a random model never answers correctly: reward the completion length so that groups differ
    return [
        "rl",
        str(source),
        "--out-dir",
        str(out),
        "--steps",
        str(STEPS),
        "--prompts-per-step",
        "4",
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
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(source, tmp_path_factory):
    """{name: (one process's rollout rows, {rank: report})} and the torchrun output."""
    root = tmp_path_factory.mktemp("rl-runs")
    single: dict[str, dict] = {}
    register_reward("length", lambda ref, text: float(len(text)))
    rollout = rl_trainer.rollout
    try:
        for name, extra in RUNS.items():
            rows = single[name] = {}

            def recording_rollout(*a, _rows=rows, **k):
                ro = rollout(*a, **k)
                if k["first_example_id"] < 10**9:
                    _rows.update({str(k["first_example_id"] + i): c for i, c in enumerate(ro.completions)})
                return ro

            rl_trainer.rollout = recording_rollout
            with one_thread():
                assert main(rl_args(source, root / f"single-{name}", extra)) == 0
    finally:
        rl_trainer.rollout = rollout
        REWARDS.pop("length")
    (root / "rank.py").write_text(RANK_SCRIPT)
    (root / "runs.json").write_text(
        json.dumps({name: rl_args(source, root / f"ranks-{name}", extra) for name, extra in RUNS.items()})
    )
    reports = root / "reports"
    reports.mkdir()
    cmd = torchrun_cmd(2, root / "rank.py", reports, root / "runs.json")
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT, cwd=root)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    got = {name: {r: json.loads((reports / f"{name}-rank{r}.json").read_text()) for r in range(2)} for name in RUNS}
    return root, single, got, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_two_ranks_match_one_process(runs, source, name):
    root, single, ranks, stdout = runs
    reports = ranks[name]
    assert all(r["rc"] == 0 and r["env"] == [[2, True]] and r["shutdowns"] == [True] for r in reports.values())
    # the same rollouts: every prompt's group sampled on one rank, identical to one process's
    n_rows = STEPS * 4 * 3
    assert len(single[name]) == n_rows
    assert len(reports[0]["rows"]) == len(reports[1]["rows"]) == n_rows // 2
    assert {**reports[0]["rows"], **reports[1]["rows"]} == single[name]
    # the reduced metrics are one process's
    ref, got = step_records(root / f"single-{name}"), step_records(root / f"ranks-{name}")
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for s in ref:
        for key in (
            "reward",
            "pass@1",
            "pass@3",
            "completion_len",
            "completion_len_max",
            "stopped_frac",
            "uniform_group_frac",
        ):
            assert got[s][key] == pytest.approx(ref[s][key], rel=1e-12), (s, key)
        # (recompute's endpoint residual also averages over padding, so it depends on the batch layout)
        for key in ("loss", "grad_norm", "clip_frac", "logp_gap", "kl", *(("endpoint_residual",) * (name == "reuse"))):
            if key in ref[s]:
                assert got[s][key] == pytest.approx(ref[s][key], rel=1e-5, abs=1e-6), (s, key)
    assert ("kl" in ref[1]) == (name == "recompute") and ("endpoint_residual" in ref[1]) == (name != "bptt")

    def evals(out):
        return [{k: v for k, v in r.items() if k.startswith("eval")} for r in read_metrics(out) if "eval_reward" in r]

    assert evals(root / f"ranks-{name}") == evals(root / f"single-{name}")
    assert len(evals(root / f"single-{name}")) == (2 if name == "reuse" else 0)  # before step 1 and after the last
    # rank 0 alone wrote the checkpoint and printed; the weights are one process's
    assert reports[0]["writes"] == [STEPS] and reports[1]["writes"] == []
    assert sorted(p.name for p in (root / f"ranks-{name}" / "checkpoints").iterdir()) == ["latest", f"step_{STEPS:07d}"]
    assert stdout.count(f"{STEPS} RL steps ({name})") == 1
    # the weights are one process's up to reduction order: 2 ranks sum the gradients in another order
    # than one process, and Adam divides by sqrt(v), so an entry whose gradient is near zero can move
    # by up to lr per step either way. The tolerance is therefore relative to what the run changed:
    # each tensor's update (final - initial) agrees in norm to 1%, while a wrong gradient scale or a
    # missed reduction moves whole updates (a 2x gradient error changes Adam's update little, which
    # the reduced grad_norm above catches).
    a = ckpt.load_tensors(ckpt.resolve(root / f"single-{name}"), "model.safetensors")
    b = ckpt.load_tensors(ckpt.resolve(root / f"ranks-{name}"), "model.safetensors")
    init = ckpt.load_tensors(ckpt.resolve(source), "model.safetensors")
    assert a.keys() == b.keys() == init.keys()
    for k in a:
        update = (a[k] - init[k]).norm()
        assert update > 0 or k.endswith("ve_gate.weight"), f"{k}: the run did not change it"
        assert (b[k] - a[k]).norm() <= 1e-2 * update + 1e-7, (k, float((b[k] - a[k]).norm()), float(update))


def test_prompts_must_split_over_the_ranks(source, tmp_path):
    cfg = RLConfig(out_dir=tmp_path / "rl", prompts_per_step=4, device="cpu", progress=False)
    with pytest.raises(ValueError, match="divisible by the number of ranks, 3"):
        RLTrainer(source, cfg, env=DistEnv(world_size=3))
