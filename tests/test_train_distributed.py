"""Data parallelism on CPU (gloo): 2 ranks x micro_batch 2 == 1 process x micro_batch 4.

All three runs use the learned depth prior with no warmup and a large prior learning rate, so its
logits move every step: the ranks draw identical depths only if every rank's prior sees the same
globally reduced, token-weighted microbatch losses. Gradient clipping is off: these runs' gradient
norms exceed 1, so a clipped update (and Adam, which is nearly invariant to the gradient's scale)
would hide a wrongly scaled gradient; the logged grad_norm and the first step's gradients show it.

The FSDP2 and HSDP runs write sharded checkpoints (HSDP asynchronously) at steps 3 and 6 with no
full-state gather; step 3 resumes on 1 process and on 4 ranks onto the uninterrupted run, and the
readers load the shards consolidated."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from _jobs import one_thread, shared_cache, step_records, subprocess_env, tiny_job, torchrun_cmd

from looplm.checkpoint import CheckpointError, file_sha256, is_sharded, load_tensors, load_weights, read_json, verify
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

    import looplm
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

    def record_first_gradients(trainer):
        # {parameter name: gradient} as the first optimizer step sees it (FSDP shards gathered whole)
        grads = {}
        step = trainer.optimizer.step

        def recording(*args, **kwargs):
            if not grads:
                for n, p in trainer.model.named_parameters():
                    if p.grad is not None:
                        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                        grads[n] = g.detach().clone()
            return step(*args, **kwargs)

        trainer.optimizer.step = recording
        return grads

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

    # Gathering a sharded DTensor whole (what a full state dict does) is noted while a checkpoint is saved.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    saving, gathers = [False], []

    def noting_gathers(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if saving[0]:
                gathers.append(name)
            return fn(*args, **kwargs)
        return wrapper

    DTensor.full_tensor = noting_gathers("full_tensor", DTensor.full_tensor)
    DTensor.redistribute = noting_gathers("redistribute", DTensor.redistribute)

    for name in job_files:
        job = job_from_dict(json.loads(open(name).read()))
        trainer = Trainer(job)
        env = trainer.env
        assert env.world_size == int(os.environ["WORLD_SIZE"]) and env.distributed, env
        grads = record_first_gradients(trainer)
        drawn = []
        train_step = trainer.train_step

        def recording_step():
            res = train_step()
            drawn.append(res.depths)
            return res

        trainer.train_step = recording_step
        save = trainer.save

        def noting_save():
            saving[0] = True
            try:
                return save()
            finally:
                saving[0] = False

        trainer.save = noting_save
        summary = trainer.fit()
        gathers_in_save = list(gathers)
        saving[0] = True  # the guard does see a full gather: a full state dict of the sharded model
        get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        saving[0] = False
        # looplm's own calls: made from the package's real location (a clone or venv in a folder named
        # "looplm" also holds torch's FSDP internals, so a substring test would count them)
        package = os.path.dirname(os.path.abspath(looplm.__file__)) + os.sep
        looplm_calls = [c for c in calls if os.path.abspath(c["caller"]).startswith(package)]
        if env.rank == 0:
            torch.save(grads, os.path.join(reports, f"{os.path.basename(job.train.out_dir)}-grads.pt"))
        with open(os.path.join(reports, f"{os.path.basename(job.train.out_dir)}-rank{env.rank}.json"), "w") as f:
            json.dump({"depths": drawn, "step": summary["step"], "world_size": env.world_size,
                       "wrapped": type(trainer.wrapped).__name__, "prior": trainer.sampler.state_dict(),
                       "comm_device": str(env.comm_device), "looplm_calls": looplm_calls, "n_calls": len(calls),
                       "sharded": trainer.checkpointer.sharded, "async": trainer.checkpointer.async_save,
                       "gathers_in_save": gathers_in_save,
                       "guard_caught": len(gathers) - len(gathers_in_save), "micro_reduce_scatters": micro}, f)
        calls.clear()
        gathers.clear()
        micro.clear()
    D.shutdown(env)
""")

TORCHRUN_TIMEOUT = 300
STEPS = 6
SAVED = 3  # the FSDP2/HSDP runs (and the single process) also checkpoint here; the resumes start from it
LEARNED_PRIOR = dict(
    depth__sampler="learned", depth__learned__warmup_updates=0, depth__learned__lr=0.5, train__grad_clip=0.0
)  # clipping off: see the module docstring


def torchrun(tmp_path, jobs, nproc=2) -> dict[str, list[dict]]:
    """Train `jobs` in turn under torchrun with `nproc` gloo ranks; {run folder name: per-rank reports},
    rank 0's report with the first step's gradients (gathered whole) under "grads"."""
    files = []
    for job in jobs:
        files.append(tmp_path / f"{job.train.out_dir.name}.json")
        files[-1].write_text(json.dumps(job.to_dict()))
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    reports = tmp_path / "reports"
    reports.mkdir(exist_ok=True)
    cmd = torchrun_cmd(nproc, tmp_path / "rank.py", reports, *files)
    proc = subprocess.run(
        cmd, env=subprocess_env(), capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT, cwd=tmp_path
    )
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = {
        job.train.out_dir.name: [
            json.loads((reports / f"{job.train.out_dir.name}-rank{r}.json").read_text()) for r in range(nproc)
        ]
        for job in jobs
    }
    for job in jobs:
        out[job.train.out_dir.name][0]["grads"] = torch.load(reports / f"{job.train.out_dir.name}-grads.pt")
    return out


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The reference: one process, micro_batch 4 x grad_accum 2 (an FSDP2 job: nothing to wrap on one
    process, a single-file checkpoint that the 2-rank launch resumes sharded)."""
    root = tmp_path_factory.mktemp("single")
    job = tiny_job(
        root,
        "single",
        cache=shared_cache(tmp_path_factory),
        train__steps=STEPS,
        train__checkpoint_every=SAVED,
        train__parallel="fsdp",
        **LEARNED_PRIOR,
    )
    with one_thread():
        trainer = Trainer(job)
        step, trainer.first_grads = trainer.optimizer.step, {}

        def recording(*args, **kwargs):  # the first step's gradients, as the rank script records them
            if not trainer.first_grads:
                trainer.first_grads.update(
                    {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
                )
            return step(*args, **kwargs)

        trainer.optimizer.step = recording
        trainer.fit()
    return trainer


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, single_process):
    """The same global batch on 2 gloo ranks x micro_batch 2, with DDP, FSDP2 and HSDP; the sharded runs
    checkpoint at step SAVED too, HSDP asynchronously. In the same launch, the single process's
    one-file checkpoint of step SAVED resumes on the 2 ranks with FSDP2 (run "from-single")."""
    root = tmp_path_factory.mktemp("torchrun")
    sharded = {"fsdp": {}, "hsdp": {"train__async_checkpoint": True}}
    jobs = [
        tiny_job(
            root,
            parallel,
            cache=shared_cache(tmp_path_factory),
            train__steps=STEPS,
            train__checkpoint_every=SAVED if parallel in sharded else 100,
            train__micro_batch=2,
            train__parallel=parallel,
            **sharded.get(parallel, {}),
            **LEARNED_PRIOR,
        )
        for parallel in ("ddp", "fsdp", "hsdp")
    ]
    jobs.append(resumed_in(single_process.job, copy_at(single_process.out_dir, root / "from-single")))
    return {job.train.out_dir.name: job for job in jobs}, torchrun(root, jobs)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("parallel", "wrapper"), [("ddp", "DistributedDataParallel"), ("fsdp", "FSDP"), ("hsdp", "FSDP")]
)
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
    # same global batch -> the same loss curve and gradient norms (up to float reduction order)
    for s in ref:
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-5), s
        assert got[s]["grad_norm"] == pytest.approx(ref[s]["grad_norm"], rel=1e-4), s
        assert got[s]["tokens"] == ref[s]["tokens"]
    # and the same gradient of every parameter at the first step (averaged over ranks, not summed)
    want, grads = single_process.first_grads, reports[0]["grads"]
    assert sorted(grads) == sorted(want) and len(want) == len(list(single_process.model.parameters()))
    for name, g in want.items():
        assert (grads[name] - g).norm() <= 1e-4 * g.norm() + 1e-9, name
    # the checkpoint (one file from rank 0 for DDP, shards for FSDP2/HSDP) holds weights close to the single process's
    saved = (
        ["latest", f"step_{STEPS:07d}"] if parallel == "ddp" else ["latest", f"step_{SAVED:07d}", f"step_{STEPS:07d}"]
    )
    assert sorted(p.name for p in (job.train.out_dir / "checkpoints").iterdir()) == saved
    final = job.train.out_dir / "checkpoints" / f"step_{STEPS:07d}"
    assert is_sharded(final) == (parallel != "ddp") and all(r["sharded"] == (parallel != "ddp") for r in reports)
    a = load_tensors(single_process.latest_checkpoint(), "model.safetensors")
    b = load_weights(final)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)


# -- sharded checkpoints: no full gather, resume on other numbers of ranks, readers ---------------------
SHARDED = ("fsdp", "hsdp")


def step_dir(run: Path, step: int) -> Path:
    return Path(run) / "checkpoints" / f"step_{step:07d}"


def copy_at(run: Path, dst: Path, step: int = SAVED) -> Path:
    """A copy of run folder `run` as it stood when checkpoint `step` was its latest."""
    shutil.copytree(run, dst)
    for p in (dst / "checkpoints").glob("step_*"):
        if p.name != f"step_{step:07d}":
            shutil.rmtree(p)
    (dst / "checkpoints" / "latest").write_text(f"step_{step:07d}")
    return dst


def resumed_in(job, run: Path, **train):
    return dataclasses.replace(job, train=dataclasses.replace(job.train, out_dir=run, resume=True, **train))


def assert_follows(run: Path, reference: Path, steps) -> float:
    """The resumed steps draw the same depths and tokens as the reference run and their losses agree
    to float reduction order (measured: identical for 2 ranks -> 1 process, 8e-8 relative for 1 -> 2
    ranks; noise drawn for the wrong rows moves them by ~1e-5); returns the largest relative difference."""
    got, ref = step_records(run), step_records(reference)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for s in steps:
        assert (got[s]["depths"], got[s]["tokens"]) == (ref[s]["depths"], ref[s]["tokens"]), s
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-6), s
    return max(abs(got[s]["loss"] - ref[s]["loss"]) / ref[s]["loss"] for s in steps)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", SHARDED)
def test_sharded_checkpoints_have_no_full_gather(two_ranks, parallel):
    """Every rank writes its own shards (HSDP in the background); no DTensor is gathered whole while
    saving, though the same recorder sees the gather of a full state dict; the manifest covers the shards."""
    jobs, all_reports = two_ranks
    for r in all_reports[parallel]:
        assert r["sharded"] and r["async"] == (parallel == "hsdp")
        assert r["gathers_in_save"] == [], r["gathers_in_save"]
        assert r["guard_caught"] > 0
    for step in (SAVED, STEPS):
        path = step_dir(jobs[parallel].train.out_dir, step)
        names = set(verify(path)["sha256"])
        shards = sorted((path / "state").glob("*.distcp"))
        assert [p.name for p in shards] == ["__0_0.distcp", "__1_0.distcp"]
        assert {
            *(f"state/{p.name}" for p in shards),
            "state/.metadata",
            "rng/rank_00000.json",
            "rng/rank_00001.json",
            "trainer_state.json",
            "config.json",
        } <= names
        assert not (path / "model.safetensors").exists() and not (path / "optimizer.safetensors").exists()
        sizes = [p.stat().st_size for p in shards]
        assert max(sizes) < 0.7 * sum(sizes), sizes  # each rank holds about half of the state, not all of it
        state = read_json(path, "trainer_state.json")
        assert (state["step"], state["world_size"], state["global_micro_batch"]) == (step, 2, 4)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", SHARDED)
def test_sharded_checkpoint_resumes_on_one_process(two_ranks, parallel, tmp_path):
    """2 ranks x 2 sequences -> 1 process running each microbatch of 4 as 2 forwards of 2: the same
    data, depths, noise and learned-prior trajectory as the uninterrupted 2-rank run."""
    jobs, all_reports = two_ranks
    job = jobs[parallel]
    run = copy_at(job.train.out_dir, tmp_path / "run")
    # a recognisable RNG state for rank 0 (the saved one equals what a fresh process has after the model init)
    planted = torch.Generator().manual_seed(1234).get_state().tolist()
    rng = step_dir(run, SAVED) / "rng" / "rank_00000.json"
    rng.write_text(json.dumps({"torch": planted, "cuda": None}))
    manifest = json.loads((step_dir(run, SAVED) / "manifest.json").read_text())
    manifest["sha256"]["rng/rank_00000.json"] = file_sha256(rng)
    (step_dir(run, SAVED) / "manifest.json").write_text(json.dumps(manifest))
    t = Trainer(resumed_in(job, run))
    assert t.step == SAVED and not t.env.distributed
    assert torch.get_rng_state().tolist() == planted
    assert (t.layout.global_rows, [len(f) for f in t.layout.forwards()]) == (4, [2, 2])
    t.fit()
    assert_follows(t.out_dir, job.train.out_dir, range(SAVED + 1, STEPS + 1))
    np.testing.assert_allclose(
        t.sampler.state_dict()["logits"], all_reports[parallel][0]["prior"]["logits"], rtol=1e-5, atol=1e-8
    )
    final = t.latest_checkpoint()  # one process writes the single-file form
    assert final.name == f"step_{STEPS:07d}" and not is_sharded(final)
    a, b = load_weights(step_dir(job.train.out_dir, STEPS)), load_tensors(final, "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.slow
def test_damaged_shard_stops_a_resume(two_ranks, tmp_path):
    job = two_ranks[0]["fsdp"]
    run = copy_at(job.train.out_dir, tmp_path / "run")
    shard = step_dir(run, SAVED) / "state" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="__1_0.distcp is corrupt"):
        Trainer(resumed_in(job, run))


@pytest.mark.slow
def test_single_file_checkpoint_resumes_on_two_ranks(two_ranks, single_process):
    """1 process x 4 sequences -> 2 FSDP2 ranks x 2: the single-file checkpoint loads into the shards,
    the run follows the uninterrupted single process and then saves sharded."""
    jobs, all_reports = two_ranks
    reports = all_reports["from-single"]
    assert [r["world_size"] for r in reports] == [2, 2] and all(r["step"] == STEPS for r in reports)
    assert reports[0]["depths"] == reports[1]["depths"]
    assert_follows(jobs["from-single"].train.out_dir, single_process.out_dir, range(SAVED + 1, STEPS + 1))
    final = step_dir(jobs["from-single"].train.out_dir, STEPS)
    verify(final)
    assert len(list((final / "state").glob("*.distcp"))) == 2
    assert all(r["gathers_in_save"] == [] for r in reports)


@pytest.fixture(scope="module")
def consolidated_resumes(tmp_path_factory, two_ranks):
    """The 2-rank FSDP2 run's sharded step-SAVED checkpoint, consolidated (`looplm consolidate`), then
    resumed with --train.parallel ddp on 2 gloo ranks and on one process."""
    from looplm.checkpoint import consolidate

    fsdp = two_ranks[0]["fsdp"]
    root = tmp_path_factory.mktemp("consolidated")
    sharded = copy_at(fsdp.train.out_dir, root / "sharded")
    for name in ("ddp", "one"):
        consolidate(sharded, root / name)
        shutil.copy(sharded / "metrics.jsonl", root / name / "metrics.jsonl")  # steps 1-SAVED, for assert_follows
    ddp = resumed_in(fsdp, root / "ddp", parallel="ddp")
    reports = torchrun(root, [ddp])["ddp"]
    with one_thread():
        one = Trainer(resumed_in(fsdp, root / "one", parallel="ddp"))
        one.fit()
    return fsdp, ddp.train.out_dir, reports, one


@pytest.mark.slow
def test_consolidated_fsdp_checkpoint_resumes_with_ddp(consolidated_resumes):
    """2 FSDP2 ranks -> consolidate -> 2 DDP ranks, and -> 1 process: both follow the uninterrupted
    FSDP2 run (same depths, tokens, losses) to weights equal to its final ones."""
    fsdp, ddp_run, reports, one = consolidated_resumes
    assert [r["wrapped"] for r in reports] == ["DistributedDataParallel"] * 2
    assert [(r["step"], r["sharded"]) for r in reports] == [(STEPS, False)] * 2
    want = load_weights(step_dir(fsdp.train.out_dir, STEPS))
    for run in (ddp_run, one.out_dir):
        assert_follows(run, fsdp.train.out_dir, range(SAVED + 1, STEPS + 1))
        final = step_dir(run, STEPS)
        verify(final)
        assert not is_sharded(final) and read_json(final, "config.json")["train"]["parallel"] == "ddp"
        got = load_tensors(final, "model.safetensors")
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=k)


def test_sharded_checkpoint_into_ddp_ranks_is_refused(tmp_path):
    """DDP ranks read the single-file form: a sharded checkpoint is refused before any collective,
    naming `looplm consolidate`."""
    fsdp = tiny_job(tmp_path, "run", train__steps=2, train__parallel="fsdp")
    step = tmp_path / "run" / "checkpoints" / "step_0000001"
    (step / "state").mkdir(parents=True)
    (step / "state" / ".metadata").write_bytes(b"")
    (tmp_path / "run" / "checkpoints" / "latest").write_text(step.name)
    job = resumed_in(fsdp, tmp_path / "run", parallel="ddp")
    with pytest.raises(CheckpointError, match=r"sharded \(FSDP2/HSDP\).*looplm consolidate .* --train.out-dir"):
        Trainer(job, env=DistEnv(world_size=2, joined=True))


@pytest.mark.slow
def test_readers_load_sharded_checkpoints(two_ranks, tmp_path):
    """load_model (under eval, generate, analyze, export, distill, rl and serve) consolidates the shards
    exactly as torch's own converter does; `looplm consolidate` writes the single-file form; eval and
    export run on the sharded run."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from looplm.checkpoint import load_model, resolve, unflatten_optimizer_state
    from looplm.cli import main

    run = two_ranks[0]["fsdp"].train.out_dir
    dcp_to_torch_save(step_dir(run, STEPS) / "state", tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)

    def assert_model_equal(weights):
        assert weights.keys() == whole["model"].keys()
        for k, v in whole["model"].items():
            assert torch.equal(weights[k], v), k

    model, _, job = load_model(run)
    assert_model_equal(model.state_dict())
    assert job["train"]["parallel"] == "fsdp"

    assert main(["consolidate", run, tmp_path / "single"]) == 0
    single = resolve(tmp_path / "single")
    verify(single)
    assert single.name == f"step_{STEPS:07d}" and not is_sharded(single)
    assert_model_equal(load_tensors(single, "model.safetensors"))
    state = read_json(single, "trainer_state.json")
    optim = unflatten_optimizer_state(load_tensors(single, "optimizer.safetensors"), state["optimizer"])
    assert optim["state"].keys() == whole["optimizer"]["state"].keys()
    for fqn, entries in whole["optimizer"]["state"].items():
        for name, value in entries.items():
            assert torch.equal(optim["state"][fqn][name], value), (fqn, name)
    assert main(["consolidate", run, tmp_path / "single"]) == 2  # refuses to write into a non-empty folder

    out = tmp_path / "eval.json"
    assert (
        main(
            [
                "eval",
                run,
                "--depths",
                "1",
                "2",
                "--max-sequences",
                "4",
                "--task-examples",
                "4",
                "--sharing-sequences",
                "0",
                "--output",
                out,
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())
    pytest.importorskip("transformers")
    from looplm.checkpoint import load_hf_folder
    from looplm.hf import export

    export(run, tmp_path / "hf")
    assert_model_equal(load_hf_folder(tmp_path / "hf")[2])


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
    assert D.process_group_options(gpu) == {
        "backend": "nccl",
        "device_id": gpu,
        "timeout": timedelta(seconds=D.DEFAULT_TIMEOUT_S),
    }
    assert D.process_group_options(torch.device("cpu")) == {
        "backend": "gloo",
        "timeout": timedelta(seconds=D.DEFAULT_TIMEOUT_S),
    }
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


COLLECTIVE = re.compile(
    r"(all_reduce|broadcast|all_gather|reduce_scatter|all_to_all|barrier|reduce|send|recv|isend|"
    r"irecv|gather|scatter)\w*"
)


def collective_uses(path: Path) -> list[str]:
    """'line: torch.distributed.op' for each reference to a torch.distributed collective in `path`,
    however torch.distributed is reached: `torch.distributed.op`, `import torch.distributed as d`,
    `from torch import distributed`, `from torch.distributed import op [as name]` (at any scope)."""
    tree = ast.parse(path.read_text())
    alias: dict[str, str] = {}  # local name -> the dotted torch name it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"

    def dotted(node) -> str | None:
        if isinstance(node, ast.Name):
            return alias.get(node.id)
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = dotted(node)
            if name and name.startswith("torch.distributed.") and COLLECTIVE.fullmatch(name.rsplit(".", 1)[1]):
                out.append(f"{node.lineno}: {name}")
    return sorted(set(out))


def test_no_module_calls_collectives_directly():
    """One place owns every collective: no other module of the package uses torch.distributed's."""
    src = Path(__file__).resolve().parents[1] / "src" / "looplm"
    offenders = [
        f"{p.relative_to(src)}:{use}"
        for p in src.rglob("*.py")
        if p != src / "train" / "distributed.py"
        for use in collective_uses(p)
    ]
    assert not offenders, offenders
    assert collective_uses(src / "train" / "distributed.py")  # the scan does see the real calls


def test_collectives_scan_sees_every_spelling(tmp_path):
    forms = {
        "plain": "import torch\ndef f(t):\n    torch.distributed.all_reduce(t)\n",
        "module alias": "import torch.distributed as d\nd.broadcast(t, 0)\n",
        "from torch": "from torch import distributed\ndistributed.barrier()\n",
        "from torch as": "from torch import distributed as xd\nxd.all_gather_into_tensor(a, b)\n",
        "imported op": "def f(t):\n    from torch.distributed import all_reduce\n    all_reduce(t)\n",
        "renamed op": "from torch.distributed import reduce_scatter_tensor as rs\nrs(a, b)\n",
        "passed along": "import torch.distributed as dist\nops = [dist.send]\n",
    }
    for name, code in forms.items():
        (tmp_path / "m.py").write_text(code)
        assert collective_uses(tmp_path / "m.py"), name
    (tmp_path / "m.py").write_text(
        "import torch.distributed as dist\nimport torch\n"
        "dist.get_rank(); dist.is_initialized(); torch.distributed.get_world_size()\n"
        "def all_reduce(x):\n    return x\nall_reduce(1)\n"
    )
    assert collective_uses(tmp_path / "m.py") == []  # queries and a local namesake are not collectives


# -- rank shares, per-parameter gradient reduction, the local world size -------------------------------
# rank_share lost its divisibility check (rows silently dropped)
def test_rank_share_splits_evenly_or_refuses():
    from looplm.errors import UserError

    assert D.rank_share(8, DistEnv(world_size=2), "rows") == 4 and D.rank_share(8, DistEnv(), "rows") == 8
    with pytest.raises(
        UserError, match="rows 7 \\(per step over all ranks\\) must be divisible by the number of ranks, 2"
    ):
        D.rank_share(7, DistEnv(world_size=2), "rows")


# all_reduce_gradients did not advance its offset (every parameter got the first one's values)
@pytest.mark.parametrize("group", ["gloo"], indirect=True)
def test_all_reduce_gradients_hands_each_parameter_its_own_gradient(group):
    env = DistEnv(device=torch.device("cpu"), comm_device=torch.device("cpu"), joined=True)
    a, b, c = (torch.nn.Parameter(torch.zeros(s)) for s in ((3,), (2, 2), (2,)))
    a.grad = torch.tensor([1.0, 2.0, 3.0])
    b.grad = torch.tensor([[4.0, 5.0], [6.0, 7.0]])
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    D.all_reduce_gradients([a, frozen, b, c], env)  # c has no gradient on this rank: zeros
    assert torch.equal(a.grad, torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(b.grad, torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
    assert torch.equal(c.grad, torch.zeros(2)) and frozen.grad is None


# init_distributed defaulted LOCAL_WORLD_SIZE to 1 (HSDP's shard group: every rank its own node)
def test_local_world_size_defaults_to_the_world(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(D, "served_device_types", lambda group=None: {"cpu"})
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for var, value in (("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(var, value)
    env = D.init_distributed("cpu")
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 4, 1, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert D.init_distributed("cpu").local_world_size == 2
