"""Data parallelism on CPU (gloo): 2 ranks x micro_batch 2 == 1 process x micro_batch 4.

All three runs use the learned depth prior with no warmup and a large prior learning rate, so its
logits move every step: the ranks draw identical depths only if every rank's prior sees the same
globally reduced, token-weighted microbatch losses."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from _jobs import free_port, one_thread, shared_cache, step_records, subprocess_env, tiny_job

from looplm.checkpoint import load_tensors
from looplm.depth.pln import pln_pmf
from looplm.train.distributed import DistEnv, init_distributed
from looplm.train.parallelize import wrap_model
from looplm.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread

# Runs one rank: for each job file, rebuild the job, train it, record the depths this rank drew.
# One launch trains several jobs because starting torchrun and its ranks costs most of the time.
RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys

    import torch

    from looplm.train import distributed as D
    from looplm.train.config import job_from_dict
    from looplm.train.trainer import Trainer

    torch.set_num_threads(1)
    reports, job_files = sys.argv[1], sys.argv[2:]
    for name in job_files:
        job = job_from_dict(json.loads(open(name).read()))
        trainer = Trainer(job)
        env = trainer.env
        assert env.world_size == int(os.environ["WORLD_SIZE"]) and env.distributed, env
        drawn = []
        train_step = trainer.train_step

        def recording_step():
            res = train_step()
            drawn.append(res.depths)
            return res

        trainer.train_step = recording_step
        summary = trainer.fit()
        with open(os.path.join(reports, f"{job.train.parallel}-rank{env.rank}.json"), "w") as f:
            json.dump({"depths": drawn, "step": summary["step"], "world_size": env.world_size,
                       "wrapped": type(trainer.wrapped).__name__, "prior": trainer.sampler.state_dict()}, f)
    D.shutdown(env)
""")

TORCHRUN_TIMEOUT = 300
STEPS = 6
LEARNED_PRIOR = dict(depth__sampler="learned", depth__learned__warmup_updates=0, depth__learned__lr=0.5)


def torchrun(tmp_path, jobs, nproc=2) -> dict[str, list[dict]]:
    """Train `jobs` in turn under torchrun with `nproc` gloo ranks; {parallel: per-rank reports}."""
    files = []
    for job in jobs:
        files.append(tmp_path / f"{job.train.parallel}.json")
        files[-1].write_text(json.dumps(job.to_dict()))
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    reports = tmp_path / "reports"
    reports.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(tmp_path / "rank.py"), str(reports), *map(str, files)]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT,
                          cwd=tmp_path)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {job.train.parallel: [json.loads((reports / f"{job.train.parallel}-rank{r}.json").read_text())
                                 for r in range(nproc)] for job in jobs}


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The reference: one process, micro_batch 4 x grad_accum 2."""
    root = tmp_path_factory.mktemp("single")
    job = tiny_job(root, "single", cache=shared_cache(tmp_path_factory), train__steps=STEPS,
                   train__checkpoint_every=100, **LEARNED_PRIOR)
    with one_thread():
        trainer = Trainer(job)
        trainer.fit()
    return trainer


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The same global batch on 2 gloo ranks x micro_batch 2, once with DDP and once with FSDP2."""
    root = tmp_path_factory.mktemp("torchrun")
    jobs = [tiny_job(root, parallel, cache=shared_cache(tmp_path_factory), train__steps=STEPS,
                     train__checkpoint_every=100, train__micro_batch=2, train__parallel=parallel, **LEARNED_PRIOR)
            for parallel in ("ddp", "fsdp")]
    return {job.train.parallel: job for job in jobs}, torchrun(root, jobs)


@pytest.mark.slow
@pytest.mark.parametrize(("parallel", "wrapper"), [("ddp", "DistributedDataParallel"), ("fsdp", "FSDP")])
def test_two_ranks_match_one_process(single_process, two_ranks, parallel, wrapper):
    jobs, all_reports = two_ranks
    job, reports = jobs[parallel], all_reports[parallel]
    assert [r["world_size"] for r in reports] == [2, 2]
    assert wrapper in reports[0]["wrapped"]
    assert all(r["step"] == STEPS for r in reports)
    # every rank drew the same depth for every microbatch, and the same as one process
    assert reports[0]["depths"] == reports[1]["depths"]
    ref = step_records(single_process.out_dir)
    got = step_records(job.train.out_dir)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    assert reports[0]["depths"] == [ref[s]["depths"] for s in sorted(ref)]
    assert [got[s]["depths"] for s in sorted(got)] == [ref[s]["depths"] for s in sorted(ref)]
    # the learned prior took the same steps on every rank, and the same as one process
    priors = [r["prior"] for r in reports]
    assert priors[0]["n"] == STEPS and priors[0]["logits"] == priors[1]["logits"]
    np.testing.assert_allclose(priors[0]["logits"], single_process.sampler.state_dict()["logits"], rtol=1e-6, atol=1e-9)
    assert not np.allclose(priors[0]["logits"], np.log(pln_pmf(5.0, 0.5, 64)), atol=1e-3)  # the logits did move
    # same global batch -> the same loss curve (up to float reduction order)
    for s in ref:
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-5), s
        assert got[s]["tokens"] == ref[s]["tokens"]
    # rank 0 alone writes the checkpoint, with full (unsharded) weights close to the single process's
    assert sorted(p.name for p in (job.train.out_dir / "checkpoints").iterdir()) == ["latest", f"step_{STEPS:07d}"]
    a = load_tensors(single_process.latest_checkpoint(), "model.safetensors")
    b = load_tensors(job.train.out_dir / "checkpoints" / f"step_{STEPS:07d}", "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)


def test_single_process_environment(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    env = init_distributed("cpu")
    assert env == DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    assert env.is_main and not env.distributed
    model = torch.nn.Linear(2, 2)
    assert wrap_model(model, env, "ddp") is model  # nothing to wrap on one process

