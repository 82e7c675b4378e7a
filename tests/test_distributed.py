"""Data parallelism on CPU (gloo): 2 ranks x micro_batch 2 == 1 process x micro_batch 4.

All three runs use the learned depth prior with no warmup and a large prior learning rate, so its
logits move every step: the ranks draw identical depths only if every rank's prior sees the same
globally reduced, token-weighted microbatch losses."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from _jobs import free_port, one_thread, shared_cache, step_records, subprocess_env, tiny_job

from looplm.checkpoint import load_tensors
from looplm.depth.pln import pln_pmf
from looplm.train import distributed as D
from looplm.train.distributed import CollectiveDeviceError, DistEnv, init_distributed
from looplm.train.parallelize import wrap_model
from looplm.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread

# Runs one rank: for each job file, rebuild the job, train it, record the depths this rank drew.
# One launch trains several jobs because starting torchrun and its ranks costs most of the time.
# Every torch.distributed collective (looplm's and the DDP/FSDP2 internals that go through the
# Python API) is wrapped by a recorder that checks each tensor argument lies on a device the
# group's backend serves and on the env's comm_device, and notes who called it.
RANK_SCRIPT = textwrap.dedent("""
    import contextlib, functools, json, os, sys

    import torch
    import torch.distributed as dist

    from looplm.train import distributed as D
    from looplm.train import parallelize as P
    from looplm.train.config import job_from_dict
    from looplm.train.trainer import Trainer

    torch.set_num_threads(1)
    reports, job_files = sys.argv[1], sys.argv[2:]
    calls = []

    def recording(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            served = D.served_device_types()
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            caller = sys._getframe(1).f_code.co_filename
            for t in tensors:
                assert t.device.type in served, (name, t.device, served, caller)
            calls.append({"op": name, "caller": caller, "devices": sorted({str(t.device) for t in tensors})})
            return fn(*args, **kwargs)
        return wrapper

    for op in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "broadcast_object_list", "all_gather_object", "reduce", "barrier",
               "all_gather_single", "reduce_scatter_single"):  # the last two: FSDP2's in newer torch
        if hasattr(dist, op):
            setattr(dist, op, recording(op, getattr(dist, op)))

    # reduce-scatters issued inside each microbatch's forward and backward, with the sync flag it ran under
    micro = []
    real_sync = P.gradient_sync

    @contextlib.contextmanager
    def counting_sync(model, env, parallel, sync):
        before = sum(c["op"].startswith("reduce_scatter") for c in calls)
        with real_sync(model, env, parallel, sync):
            yield
        micro.append([sync, sum(c["op"].startswith("reduce_scatter") for c in calls) - before])

    P.gradient_sync = counting_sync

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
        looplm_calls = [c for c in calls if "looplm" in c["caller"]]
        with open(os.path.join(reports, f"{job.train.parallel}-rank{env.rank}.json"), "w") as f:
            json.dump({"depths": drawn, "step": summary["step"], "world_size": env.world_size,
                       "wrapped": type(trainer.wrapped).__name__, "prior": trainer.sampler.state_dict(),
                       "comm_device": str(env.comm_device), "looplm_calls": looplm_calls, "n_calls": len(calls),
                       "micro_reduce_scatters": micro}, f)
        calls.clear()
        micro.clear()
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
            for parallel in ("ddp", "fsdp", "hsdp")]
    return {job.train.parallel: job for job in jobs}, torchrun(root, jobs)


@pytest.mark.slow
@pytest.mark.parametrize(("parallel", "wrapper"), [("ddp", "DistributedDataParallel"), ("fsdp", "FSDP"), ("hsdp", "FSDP")])
def test_two_ranks_match_one_process(single_process, two_ranks, parallel, wrapper):
    jobs, all_reports = two_ranks
    job, reports = jobs[parallel], all_reports[parallel]
    assert [r["world_size"] for r in reports] == [2, 2]
    assert wrapper in reports[0]["wrapped"]
    # every collective looplm issued came from the one module that owns them, on the comm device
    for r in reports:
        assert r["comm_device"] == "cpu"
        assert r["looplm_calls"], "no collective recorded: the recorder is not wired in"
        assert {Path(c["caller"]).name for c in r["looplm_calls"]} == {"distributed.py"}, r["looplm_calls"]
        assert all(c["caller"].endswith("looplm/train/distributed.py") for c in r["looplm_calls"])
        assert all(d == "cpu" for c in r["looplm_calls"] for d in c["devices"])
        assert {"all_reduce", "barrier"} <= {c["op"] for c in r["looplm_calls"]}
    assert all(r["step"] == STEPS for r in reports)
    # gradients are reduced in the last microbatch of a step only (grad_accum 2): FSDP2 reduce-scatters
    # nothing in the first, and the reference below shows the step still averages both microbatches
    assert job.train.grad_accum == 2
    for r in reports:
        assert [sync for sync, _ in r["micro_reduce_scatters"]] == [False, True] * STEPS
        n = [count for _, count in r["micro_reduce_scatters"]]
        assert (n[0::2], min(n[1::2]) > 0) == ([0] * STEPS, parallel != "ddp"), n  # DDP's reducer is C++
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
    # rtol 1e-5: the prior's advantages are CE differences centred on the step's own mean (design §4), so the
    # ~1e-7 relative differences of the CE sums (float reduction order across ranks) grow ~10x in the logits
    np.testing.assert_allclose(priors[0]["logits"], single_process.sampler.state_dict()["logits"], rtol=1e-5, atol=1e-8)
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


def test_process_group_options(monkeypatch):
    """nccl is bound to this rank's GPU (device_id) and every backend gets a timeout, so a missing peer
    ends the run with an error instead of a hang."""
    from datetime import timedelta

    monkeypatch.delenv("LOOPLM_DIST_TIMEOUT_S", raising=False)
    gpu = torch.device("cuda", 3)
    assert D.process_group_options(gpu) == {"backend": "nccl", "device_id": gpu,
                                            "timeout": timedelta(seconds=D.DEFAULT_TIMEOUT_S)}
    assert D.process_group_options(torch.device("cpu")) == {"backend": "gloo",
                                                             "timeout": timedelta(seconds=D.DEFAULT_TIMEOUT_S)}
    monkeypatch.setenv("LOOPLM_DIST_TIMEOUT_S", "90")
    assert D.process_group_options(gpu)["timeout"] == timedelta(seconds=90)
    # init_distributed passes them on
    import torch.distributed as dist

    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(D, "served_device_types", lambda group=None: {"cpu"})
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(var, value)
    D.init_distributed("cpu")
    assert seen == {"backend": "gloo", "timeout": timedelta(seconds=90)}


# -- collectives on the device the backend serves ------------------------------------------------
@pytest.fixture
def group(request):
    """A one-rank process group with the given backend string; destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group(backend=request.param, store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("group", ["cuda:gloo"], indirect=True)
def test_nccl_like_group_rejects_cpu_tensors(group, monkeypatch):
    """`cuda:gloo` is a group with no CPU backend, like NCCL: the crash of multi-GPU runs
    (trainer statistics all-reduced as CPU tensors) reproduced on a CPU machine."""
    import torch.distributed as dist

    assert D.served_device_types() == {"cuda"}
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.zeros(2))  # what the trainer did before collectives moved their tensors
    with pytest.raises(CollectiveDeviceError, match="cpu tensor.*serves only cuda"):
        D.check_served(torch.zeros(2))
    # the helpers pick the device the group serves, and refuse a model device it cannot serve
    assert D.comm_device_for(torch.device("cuda", 3), D.served_device_types()) == torch.device("cuda", 3)
    with pytest.raises(CollectiveDeviceError, match="computes on cpu"):
        D.comm_device_for(torch.device("cpu"), D.served_device_types())
    # so a trainer launched with such a group fails at start-up, naming the mismatch
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(CollectiveDeviceError, match="cuda:gloo"):
        init_distributed("cpu")
    # and a helper handed a wrong comm device raises before the collective is issued
    wrong = DistEnv(device=torch.device("cpu"), comm_device=torch.device("cpu"), joined=True)
    with pytest.raises(CollectiveDeviceError):
        D.all_reduce_sum(torch.ones(2), wrong)


@pytest.mark.parametrize("group", ["gloo"], indirect=True)
def test_helpers_reduce_on_comm_device_and_return_on_callers(group, monkeypatch):
    import torch.distributed as dist

    seen = []
    real = dist.all_reduce

    def recording(t, *args, **kwargs):
        seen.append((t.device, t.dtype))
        return real(t, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", recording)
    env = DistEnv(device=torch.device("cpu"), comm_device=torch.device("cpu"), joined=True)
    x = torch.tensor([1.5, 2.0], dtype=torch.float64)
    y = D.all_reduce_sum(x, env)
    assert y is not x and torch.equal(y, x) and y.device == x.device  # one rank: the sum is the value
    assert D.all_reduce_int(7, env) == 7 and D.all_reduce_sums([0.25, 3.0], env) == [0.25, 3.0]
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 4.0)
    D.all_reduce_gradients([p], env)
    assert torch.equal(p.grad, torch.full((3,), 4.0))
    assert seen and all(d == torch.device("cpu") for d, _ in seen)
    # without a group nothing is issued
    seen.clear()
    assert D.all_reduce_int(3, DistEnv()) == 3 and not seen


def test_no_module_calls_collectives_directly():
    """One place owns every collective: no other module of the package calls torch.distributed's."""
    src = Path(__file__).resolve().parents[1] / "src" / "looplm"
    ops = r"\b(?:dist|torch\.distributed)\.(all_reduce|broadcast|all_gather|reduce_scatter|barrier|reduce|send|recv|gather|scatter)\w*\("
    offenders = [f"{p.relative_to(src)}:{i}" for p in src.rglob("*.py") if p.name != "distributed.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(ops, line)]
    assert not offenders, offenders
    assert re.search(ops, (src / "train" / "distributed.py").read_text())  # the pattern does match real calls
