"""Checkpoint format: atomic writes, SHA-256 manifest, optimizer state, loading guards."""

from __future__ import annotations

import hashlib
import os
import stat
import json
import shutil
import warnings

import pytest
import torch
from _jobs import one_thread, shared_cache, tiny_job

from looplm import checkpoint as ckpt
from looplm.model import LoopedLM
from looplm.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run folder holding the checkpoint of a 2-step tiny run."""
    root = tmp_path_factory.mktemp("trained")
    with one_thread():
        Trainer(tiny_job(root, "run", cache=shared_cache(tmp_path_factory), train__steps=2)).fit()
    return root / "run"


@pytest.fixture
def run_dir(trained, tmp_path):
    """A private copy of the trained run."""
    return shutil.copytree(trained, tmp_path / "run", symlinks=True)


@pytest.fixture
def checkpoint(run_dir):
    return ckpt.resolve(run_dir)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rewrite_manifest(path) -> None:
    """Recompute the manifest after a deliberate edit (a consistent but unfitting checkpoint)."""
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["sha256"] = {name: sha256(path / name) for name in manifest["sha256"]}
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))


def edit_config(path, **model_fields) -> None:
    config = ckpt.read_json(path, "config.json")
    config["model"].update(model_fields)
    ckpt.write_json(path, "config.json", config)
    rewrite_manifest(path)


def leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# -- write_atomic and the manifest ----------------------------------------------------------------
def populate_ab(tmp):
    (tmp / "a.json").write_text('{"x": 1}')
    (tmp / "b.bin").write_bytes(bytes(range(256)))


def test_write_atomic_creates_manifest_of_every_file(tmp_path):
    target = ckpt.write_atomic(tmp_path / "ck" / "step_1", populate_ab)
    assert target == tmp_path / "ck" / "step_1"
    assert sorted(p.name for p in target.iterdir()) == ["a.json", "b.bin", "manifest.json"]
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["format"] == ckpt.FORMAT
    assert manifest["sha256"] == {"a.json": sha256(target / "a.json"), "b.bin": sha256(target / "b.bin")}
    assert ckpt.verify(target) == manifest
    assert leftovers(tmp_path / "ck") == []


def test_write_atomic_replaces_an_existing_folder(tmp_path):
    target = tmp_path / "step_1"
    ckpt.write_atomic(target, populate_ab)
    ckpt.write_atomic(target, lambda tmp: (tmp / "c.txt").write_text("new"))
    assert sorted(p.name for p in target.iterdir()) == ["c.txt", "manifest.json"]
    ckpt.verify(target)
    assert leftovers(tmp_path) == []


def test_failing_populate_leaves_no_folder_and_keeps_the_old_one(tmp_path):
    def boom(tmp):
        (tmp / "model.safetensors").write_bytes(b"half a file")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        ckpt.write_atomic(tmp_path / "step_2", boom)
    assert not (tmp_path / "step_2").exists()

    old = ckpt.write_atomic(tmp_path / "step_1", populate_ab)
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    with pytest.raises(RuntimeError, match="disk full"):
        ckpt.write_atomic(old, boom)
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    ckpt.verify(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]  # no temporary folder left over


def test_trainer_checkpoint_manifest_covers_all_files(checkpoint):
    names = sorted(p.name for p in checkpoint.iterdir())
    for required in (
        "model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
        "config.json",
        "manifest.json",
    ):
        assert required in names
    manifest = ckpt.verify(checkpoint)
    assert sorted(manifest["sha256"]) == [n for n in names if n != "manifest.json"]
    assert (checkpoint.parent / "latest").read_text().strip() == checkpoint.name == "step_0000002"


# -- corruption ---------------------------------------------------------------------------------
def test_flipped_byte_is_detected(checkpoint, run_dir):
    f = checkpoint / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"model\.safetensors is corrupt"):
        ckpt.verify(checkpoint)
    with pytest.raises(ckpt.CheckpointError, match=r"model\.safetensors"):
        ckpt.load_model(checkpoint)
    with pytest.raises(ckpt.CheckpointError, match=r"model\.safetensors"):
        ckpt.load_model(run_dir)  # through the run folder's `latest`


def test_flipped_byte_stops_a_resume(checkpoint, run_dir, tmp_path_factory):
    f = checkpoint / "optimizer.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    job = tiny_job(run_dir.parent, "run", cache=shared_cache(tmp_path_factory), train__steps=4, train__resume=True)
    with pytest.raises(ckpt.CheckpointError, match=r"optimizer\.safetensors"):
        Trainer(job)


def test_missing_manifest(checkpoint):
    (checkpoint / "manifest.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match="manifest.json"):
        ckpt.verify(checkpoint)
    with pytest.raises(ckpt.CheckpointError, match="manifest.json"):
        ckpt.load_model(checkpoint)


def _unlist_the_weights(path):
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["sha256"]["model.safetensors"]
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda p: (p / "manifest.json").write_text("{not json"), "not valid JSON"),
        (
            lambda p: (p / "manifest.json").write_text(json.dumps({"format": "other", "sha256": {}})),
            "unknown checkpoint format",
        ),
        (lambda p: (p / "config.json").unlink(), "config.json listed in the manifest is missing"),
        # a manifest without its table was a KeyError (an internal error at the command line)
        (lambda p: (p / "manifest.json").write_text(json.dumps({"format": ckpt.FORMAT})), "has no sha256 table"),
        # weights the manifest does not list loaded unchecked
        (_unlist_the_weights, "model.safetensors not in the manifest"),
    ],
)
def test_damaged_manifest_or_missing_file(checkpoint, edit, match):
    edit(checkpoint)
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.verify(checkpoint)


def test_missing_folder(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint folder"):
        ckpt.load_model(tmp_path / "nowhere")


# -- loading ------------------------------------------------------------------------------------
def test_resolve_accepts_run_checkpoints_and_checkpoint_folders(run_dir, checkpoint):
    assert ckpt.resolve(run_dir) == checkpoint
    assert ckpt.resolve(run_dir / "checkpoints") == checkpoint
    assert ckpt.resolve(checkpoint) == checkpoint


def test_load_model_round_trip(checkpoint):
    model, tokenizer, config = ckpt.load_model(checkpoint)
    assert not model.training
    assert model.cfg.d_model == 32 and model.cfg.vocab_size == tokenizer.vocab_size
    assert config["train"]["steps"] == 2
    saved = ckpt.load_tensors(checkpoint, "model.safetensors")
    state = model.state_dict()
    assert saved.keys() == state.keys()
    for k in saved:
        assert torch.equal(saved[k], state[k]), k


def test_tokenizer_vocab_mismatch(checkpoint):
    _, tokenizer, _ = ckpt.load_model(checkpoint)
    edit_config(checkpoint, vocab_size=tokenizer.vocab_size - 10)  # token ids without an embedding row
    ckpt.verify(checkpoint)  # consistent files, but they do not fit together
    with pytest.raises(ckpt.CheckpointError, match=f"tokenizer has {tokenizer.vocab_size} tokens"):
        ckpt.load_model(checkpoint)


def test_unreadable_model_config(checkpoint):
    edit_config(checkpoint, no_such_field=1)
    with pytest.raises(ckpt.CheckpointError, match="unreadable config"):
        ckpt.load_model(checkpoint)


def test_weights_of_another_shape_name_the_tensor(checkpoint):
    edit_config(checkpoint, ffn_dim=96)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load_model(checkpoint)
    msg = str(err.value)
    saved = ckpt.load_tensors(checkpoint, "model.safetensors")
    cfg = ckpt.read_json(checkpoint, "config.json")["model"]
    from looplm.config import ModelConfig

    expected = LoopedLM(ModelConfig.from_dict(cfg)).state_dict()
    mismatched = [k for k in expected if expected[k].shape != saved[k].shape]
    assert mismatched  # the feed-forward matrices
    first = mismatched[0]
    assert f"{first} has shape {tuple(saved[first].shape)}, the model expects {tuple(expected[first].shape)}" in msg


def test_check_model_shapes_reports_missing_and_unexpected(tmp_path):
    a = {"x": torch.zeros(2), "y": torch.zeros(3)}
    with pytest.raises(ckpt.CheckpointError, match=r"missing \['y'\], unexpected \['z'\]"):
        ckpt.check_model_shapes(a, {"x": torch.zeros(2), "z": torch.zeros(3)}, tmp_path)
    with pytest.raises(ckpt.CheckpointError, match=r"y has shape \(4,\), the model expects \(3,\)"):
        ckpt.check_model_shapes(a, {"x": torch.zeros(2), "y": torch.zeros(4)}, tmp_path)
    ckpt.check_model_shapes(a, dict(a), tmp_path)


# -- the backprop window in config.json (design §3) --------------------------------------------------
def record_depth(checkpoint, run_dir, **depth_fields) -> None:
    """Rewrite the checkpoint's depth settings (as an older or hand-written config.json would hold
    them) for a resume from `run_dir`."""
    config = ckpt.read_json(checkpoint, "config.json")
    config["depth"].update(depth_fields)
    config["train"]["out_dir"] = str(run_dir)
    ckpt.write_json(checkpoint, "config.json", config)
    rewrite_manifest(checkpoint)


def resume(run_dir, tmp_path_factory, **overrides) -> Trainer:
    return Trainer(
        tiny_job(
            run_dir.parent, "run", cache=shared_cache(tmp_path_factory), train__steps=2, train__resume=True, **overrides
        )
    )


def test_config_records_the_resolved_window(checkpoint):
    depth = ckpt.read_json(checkpoint, "config.json")["depth"]
    assert (depth["sampler"], depth["bptt_window"]) == ("pln", 10)  # the tiny preset: 'auto' is 10 for PLN


@pytest.mark.parametrize("recorded", [10, "auto"])
def test_explicit_or_auto_window_resumes_into_the_default(checkpoint, run_dir, tmp_path_factory, recorded):
    record_depth(checkpoint, run_dir, bptt_window=recorded)
    t = resume(run_dir, tmp_path_factory)
    assert t.step == 2 and t.job.depth.bptt_window == 10


def test_other_explicit_window_resumes_only_with_that_window(checkpoint, run_dir, tmp_path_factory):
    record_depth(checkpoint, run_dir, bptt_window=4)
    with pytest.raises(ckpt.CheckpointError, match="depth.bptt_window: 4 -> 10"):
        resume(run_dir, tmp_path_factory)
    t = resume(run_dir, tmp_path_factory, depth__bptt_window=4)
    assert t.step == 2 and t.job.depth.bptt_window == 4


def test_old_fixed_depth_checkpoint_keeps_its_explicit_window(checkpoint, run_dir, tmp_path_factory):
    """Before the window depended on the sampler, a fixed depth recorded b = 10. Such a run resumes
    with that explicit window; the new default (full BPTT) would train differently and is refused."""
    record_depth(checkpoint, run_dir, sampler="fixed", depth=12.0, bptt_window=10)
    with pytest.raises(ckpt.CheckpointError, match="depth.bptt_window: 10 -> None"):
        resume(run_dir, tmp_path_factory, depth__sampler="fixed", depth__depth=12.0)
    t = resume(run_dir, tmp_path_factory, depth__sampler="fixed", depth__depth=12.0, depth__bptt_window=10)
    assert t.step == 2 and t.job.depth.bptt_window == 10


# -- optimizer state ----------------------------------------------------------------------------
def test_optimizer_state_flatten_round_trip(tmp_path):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.98))
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    opts = StateDictOptions(full_state_dict=True)
    state = get_optimizer_state_dict(model, opt, options=opts)
    state["state"]["0.weight"]["custom_scalar"] = 3  # non-tensor per-parameter entries go to JSON

    tensors, meta = ckpt.flatten_optimizer_state(state)
    assert all(isinstance(v, torch.Tensor) for v in tensors.values())
    assert meta["scalars"] == {"0.weight::custom_scalar": 3}
    assert set(tensors) >= {"0.weight::exp_avg", "0.weight::exp_avg_sq", "0.weight::step", "1.bias::exp_avg"}

    # through the files a checkpoint uses
    ckpt.save_tensors(tmp_path, "optimizer.safetensors", tensors)
    ckpt.write_json(tmp_path, "meta.json", meta)
    back = ckpt.unflatten_optimizer_state(
        ckpt.load_tensors(tmp_path, "optimizer.safetensors"), ckpt.read_json(tmp_path, "meta.json")
    )
    assert back["state"].keys() == state["state"].keys()
    for key, per_param in state["state"].items():
        assert back["state"][key].keys() == per_param.keys()
        for name, value in per_param.items():
            got = back["state"][key][name]
            if isinstance(value, torch.Tensor):
                assert torch.equal(got, value), (key, name)
            else:
                assert got == value
    assert json.loads(json.dumps(state["param_groups"])) == back["param_groups"]

    # and the restored state drives a fresh optimizer exactly like the original
    del back["state"]["0.weight"]["custom_scalar"], state["state"]["0.weight"]["custom_scalar"]
    twin = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    twin.load_state_dict(model.state_dict())
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1.0)
    set_optimizer_state_dict(twin, twin_opt, back, options=opts)
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (twin, twin_opt)):
        m(x).square().sum().backward()
        o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


# -- the manifest over subfolders, split verification ----------------------------------------------
def populate_nested(tmp):
    populate_ab(tmp)
    (tmp / "state").mkdir()
    (tmp / "state" / "__0_0.distcp").write_bytes(b"shard zero")
    (tmp / "state" / ".metadata").write_bytes(b"meta")


def test_manifest_covers_files_in_subfolders(tmp_path):
    target = ckpt.write_atomic(tmp_path / "step_1", populate_nested)
    manifest = ckpt.verify(target)
    assert sorted(manifest["sha256"]) == ["a.json", "b.bin", "state/.metadata", "state/__0_0.distcp"]
    assert manifest["sha256"]["state/__0_0.distcp"] == sha256(target / "state" / "__0_0.distcp")
    (target / "state" / "__0_0.distcp").write_bytes(b"shard 0ero")
    with pytest.raises(ckpt.CheckpointError, match="state/__0_0.distcp is corrupt"):
        ckpt.verify(target)


def test_commit_takes_digests_from_the_writers_and_hashes_the_rest(tmp_path):
    tmp = ckpt.fresh_folder(tmp_path / ".tmp-step_1")
    populate_nested(tmp)
    target = ckpt.commit(tmp, tmp_path / "step_1", {"state/__0_0.distcp": sha256(tmp / "state" / "__0_0.distcp")})
    assert not tmp.exists() and len(ckpt.verify(target)["sha256"]) == 4


def test_processes_verify_shares_that_cover_every_file(tmp_path):
    target = ckpt.write_atomic(tmp_path / "step_1", populate_nested)
    (target / "b.bin").write_bytes(b"damaged")
    failing = []
    for k in range(3):
        try:
            ckpt.verify(target, share=(k, 3))
        except ckpt.CheckpointError as err:
            failing.append((k, str(err)))
    assert len(failing) == 1 and "b.bin is corrupt" in failing[0][1]


# -- the sharded form in one process (the torchrun tests in test_train_distributed.py run it on ranks) ----
def sharded_trainer(tmp_path_factory, root, name, **overrides) -> Trainer:
    """A tiny trainer that writes sharded checkpoints (as FSDP2 ranks do) in one process."""
    from looplm.train.checkpointing import Checkpointer

    t = Trainer(tiny_job(root, name, cache=shared_cache(tmp_path_factory), **overrides))
    t.checkpointer = Checkpointer(
        t.ckpt_root,
        t.env,
        t.model,
        t.optimizer,
        sharded=True,
        async_save=t.job.train.async_checkpoint,
        keep=t.job.train.keep_checkpoints,
    )
    return t


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """4 steps with single-file checkpoints; the same stopped at step 2 with sharded ones, and again
    with asynchronous sharded saves."""
    root = tmp_path_factory.mktemp("sharded")
    with one_thread():
        full = Trainer(tiny_job(root, "full", cache=shared_cache(tmp_path_factory), train__steps=4))
        full.fit()
        for name, extra in (("sync", {}), ("async", {"train__async_checkpoint": True})):
            sharded_trainer(tmp_path_factory, root, name, train__steps=4, train__stop_after=2, **extra).fit()
    return root


@pytest.mark.parametrize("name", ["sync", "async"])
def test_sharded_checkpoint_resumes_exactly(sharded_runs, tmp_path, tmp_path_factory, name):
    from _jobs import losses

    run = shutil.copytree(sharded_runs / name, tmp_path / name)
    path = ckpt.resolve(run)
    assert ckpt.is_sharded(path) and not (path / "model.safetensors").exists()
    assert {"state/__0_0.distcp", "state/.metadata", "rng/rank_00000.json"} <= set(ckpt.verify(path)["sha256"])
    t = Trainer(tiny_job(tmp_path, name, cache=shared_cache(tmp_path_factory), train__steps=4, train__resume=True))
    assert t.step == 2
    t.fit()
    assert losses(run) == losses(sharded_runs / "full")  # one process: the same sums, exactly
    a, b = final_weights(sharded_runs / "full"), ckpt.load_weights(ckpt.resolve(run))
    assert all(torch.equal(a[k], b[k]) for k in a)


def final_weights(run) -> dict:
    return ckpt.load_tensors(ckpt.resolve(run), "model.safetensors")


def test_read_sharded_returns_the_saved_state(tmp_path):
    """`read_sharded` rebuilds what was saved (nested dicts, lists, pickled values) from the files alone."""
    import torch.distributed.checkpoint as dcp

    model = {"w": torch.randn(3, 4), "b": torch.arange(5.0)}
    optim = {
        "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4)}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.98), "params": ["w"]}, {"lr": 0.2, "params": ["b"]}],
    }
    (tmp_path / ckpt.SHARDS).mkdir()
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": model, "optimizer": optim}, checkpoint_id=str(tmp_path / ckpt.SHARDS))
    got = ckpt.read_sharded(tmp_path, "model")
    assert got.keys() == model.keys() and all(torch.equal(got[k], model[k]) for k in model)
    opt = ckpt.read_sharded(tmp_path, "optimizer")
    assert opt["param_groups"] == optim["param_groups"]
    assert torch.equal(opt["state"]["w"]["exp_avg"], optim["state"]["w"]["exp_avg"])
    with pytest.raises(ckpt.CheckpointError, match="no 'rng' state"):
        ckpt.read_sharded(tmp_path, "rng")


def test_consolidated_weights_only_loads_but_does_not_resume(sharded_runs, tmp_path, tmp_path_factory):
    out = tmp_path / "single"
    path = ckpt.consolidate(sharded_runs / "sync", out, weights_only=True)
    assert path == out / "checkpoints" / "step_0000002" and not (path / "optimizer.safetensors").exists()
    model, _, _ = ckpt.load_model(out)
    a = ckpt.load_weights(ckpt.resolve(sharded_runs / "sync"))
    assert all(torch.equal(v, a[k]) for k, v in model.state_dict().items())
    with pytest.raises(ckpt.CheckpointError, match="holds no optimizer state"):
        Trainer(tiny_job(tmp_path, "single", cache=shared_cache(tmp_path_factory), train__steps=4, train__resume=True))
    with pytest.raises(ckpt.CheckpointError, match="already a single-file checkpoint"):
        ckpt.consolidate(sharded_runs / "full", tmp_path / "again")


# -- file modes -------------------------------------------------------------------------------------
@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_weights_follow_the_umask(umask_022, tmp_path, tmp_path_factory):
    """safetensors writes 0600 files; looplm's weights (training checkpoint, consolidated checkpoint,
    export) are readable as every other file is under umask 022: 0644."""
    t = sharded_trainer(tmp_path_factory, tmp_path, "run", train__steps=1)
    t.fit()
    sharded = ckpt.resolve(t.out_dir)
    single = ckpt.consolidate(t.out_dir, tmp_path / "single")
    Trainer(tiny_job(tmp_path, "plain", cache=shared_cache(tmp_path_factory), train__steps=1)).fit()
    plain = ckpt.resolve(tmp_path / "plain")
    files = [
        single / "model.safetensors",
        single / "optimizer.safetensors",
        plain / "model.safetensors",
        plain / "optimizer.safetensors",
        *sorted((sharded / ckpt.SHARDS).iterdir()),
    ]
    try:
        from looplm.hf import export
    except ImportError:
        export = None
    if export is not None:
        export(plain, tmp_path / "hf")
        files += sorted((tmp_path / "hf").glob("*.safetensors"))
    modes = {str(f.relative_to(tmp_path)): oct(stat.S_IMODE(f.stat().st_mode)) for f in files}
    assert modes == dict.fromkeys(modes, "0o644"), modes


def test_a_sharded_export_folder_loads_every_shard(tmp_path):
    """An HF export folder saved in
    shards (model.safetensors.index.json) loads every tensor, with the 'model.' prefix removed."""
    from _jobs import write_hf_weights

    from looplm.checkpoint import _hf_weights

    g = torch.Generator().manual_seed(0)
    state = {f"model.layer{i}.weight": torch.randn(3, 2, generator=g) for i in range(5)}
    write_hf_weights(tmp_path, state, shards=3)
    got = _hf_weights(tmp_path)
    assert sorted(got) == sorted(k[len("model.") :] for k in state)
    for k, v in state.items():
        assert torch.equal(got[k[len("model.") :]], v)


# -- pruning, sharded RNG state, failed asynchronous writes, consolidated resumes ----------------------
# checkpointing.py passed keep=2 to save_step (single file) / point_latest (sharded) instead of
# train.keep_checkpoints
@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded"])
def test_keep_checkpoints_prunes_to_the_newest(tmp_path, tmp_path_factory, sharded):
    kw = dict(train__steps=4, train__checkpoint_every=1, train__keep_checkpoints=3)
    if sharded:
        t = sharded_trainer(tmp_path_factory, tmp_path, "run", **kw)
    else:
        t = Trainer(tiny_job(tmp_path, "run", cache=shared_cache(tmp_path_factory), **kw))
    t.fit()
    assert sorted(p.name for p in t.ckpt_root.iterdir()) == ["latest", "step_0000002", "step_0000003", "step_0000004"]
    assert ckpt.resolve(t.out_dir).name == "step_0000004" and ckpt.is_sharded(ckpt.resolve(t.out_dir)) == sharded


# checkpointing.py `load` of a sharded checkpoint dropped `set_rng_state(rng, ...)` (the torchrun test
# checks it on ranks; this one in one process)
def test_a_sharded_resume_restores_the_saved_rng(sharded_runs, tmp_path, tmp_path_factory):
    run = shutil.copytree(sharded_runs / "sync", tmp_path / "sync")
    path = ckpt.resolve(run)
    planted = torch.Generator().manual_seed(1234).get_state().tolist()
    (path / "rng" / "rank_00000.json").write_text(json.dumps({"torch": planted, "cuda": None}))
    rewrite_manifest(path)
    torch.manual_seed(99)
    Trainer(tiny_job(tmp_path, "sync", cache=shared_cache(tmp_path_factory), train__steps=4, train__resume=True))
    assert torch.get_rng_state().tolist() == planted


# checkpointing.py `_commit` ignored a rank's failed write (committed a checkpoint missing its
# shards) or left the temporary folder behind
def test_a_failed_asynchronous_write_is_an_error_and_leaves_nothing(tmp_path, tmp_path_factory, monkeypatch):
    from looplm.train.checkpointing import Checkpointer

    t = sharded_trainer(tmp_path_factory, tmp_path, "run", train__steps=2, train__async_checkpoint=True)

    def failing(self, tmp, rng_file):
        raise OSError("disk full")

    monkeypatch.setattr(Checkpointer, "_own_digests", failing)
    t.train_step()
    t.save()
    with pytest.raises(
        ckpt.CheckpointError, match=r"writing checkpoint .*step_0000001 failed: rank 0: OSError\('disk full'\)"
    ):
        t.checkpointer.wait()
    assert sorted(p.name for p in t.ckpt_root.iterdir()) == []  # no step folder, no temporary one, no `latest`


# checkpoint.py read_rng `files[rank % len(files)]` -> `files[0]` (every rank took rank 0's RNG)
def test_read_rng_takes_the_ranks_own_state_modulo_the_saved_ranks(tmp_path):
    (tmp_path / ckpt.RNG).mkdir()
    for r in range(2):
        (tmp_path / ckpt.RNG / f"rank_{r:05d}.json").write_text(json.dumps({"torch": [r], "cuda": None}))
    assert [ckpt.read_rng(tmp_path, r)["torch"] for r in range(4)] == [[0], [1], [0], [1]]
    assert ckpt.read_rng(tmp_path / "single-file", 0) is None


# consolidate dropped the saved RNG (the consolidated checkpoint did not resume: no torch_rng), or
# wrote into a non-empty folder (the torchrun test checks this through the command)
def test_a_consolidated_checkpoint_resumes_with_rank_0s_rng(sharded_runs, tmp_path, tmp_path_factory):
    out = tmp_path / "single"
    path = ckpt.consolidate(sharded_runs / "sync", out)
    rng = json.loads((ckpt.resolve(sharded_runs / "sync") / "rng" / "rank_00000.json").read_text())
    assert ckpt.read_json(path, "trainer_state.json")["torch_rng"] == rng["torch"]
    torch.manual_seed(99)
    t = Trainer(tiny_job(tmp_path, "single", cache=shared_cache(tmp_path_factory), train__steps=4, train__resume=True))
    assert t.step == 2 and torch.get_rng_state().tolist() == rng["torch"]
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    with pytest.raises(ckpt.CheckpointError, match="is not empty; consolidate into a new"):
        ckpt.consolidate(sharded_runs / "sync", tmp_path / "used")
    assert sorted(p.name for p in (tmp_path / "used").iterdir()) == ["notes.txt"]


# checkpoint.py refuse_overlap lost `or out in source.parents` (an output folder holding a standalone
# checkpoint folder was accepted)
def test_refuse_overlap_refuses_a_folder_that_holds_the_source(tmp_path):
    from looplm.errors import UserError

    run_ckpt = tmp_path / "run" / "checkpoints" / "step_0000002"
    standalone = tmp_path / "exported" / "ck"
    for source, out in (
        (run_ckpt, tmp_path / "run"),
        (run_ckpt, tmp_path / "run" / "distilled"),
        (standalone, standalone),
        (standalone, tmp_path / "exported"),  # holds the source folder
        (standalone, tmp_path),
    ):
        with pytest.raises(UserError, match="overlaps the source run"):
            ckpt.refuse_overlap(source, out)
    for source, out in ((run_ckpt, tmp_path / "other"), (standalone, tmp_path / "exported-next")):
        ckpt.refuse_overlap(source, out)  # beside it: fine


# -- pruning, atomic writes, verification, dtypes, devices ---------------------------------------------
def _steps(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))


def test_point_latest_keeps_at_least_the_newest(tmp_path):
    """Guards against: `[: -max(1, keep)]` -> `[: -keep]` (keep=0 sliced `[:0]` and deleted nothing). keep 0 or below
    still keeps the checkpoint `latest` points at, and only it."""
    for step in (1, 2, 3):
        (tmp_path / ckpt.step_name(step)).mkdir()
    ckpt.point_latest(tmp_path, ckpt.step_name(3), keep=0)
    assert _steps(tmp_path) == ["step_0000003"]
    assert ckpt.resolve(tmp_path) == tmp_path / "step_0000003"


def test_pruning_keeps_the_checkpoint_just_saved_over_a_later_one_a_crashed_run_left(tmp_path):
    """A run killed after step_4 was renamed into place but before `latest` moved on leaves step_4 beside
    `latest` -> step_2; resumed from step_2, it saves step_3. step_4 belongs to the timeline that was
    abandoned: it is deleted, and the checkpoint just saved is kept, whatever `keep` says. Temporary
    folders a killed save left behind go too."""
    for step in (1, 2, 4):
        (tmp_path / ckpt.step_name(step)).mkdir()
    (tmp_path / f".tmp-{ckpt.step_name(2)}-99999").mkdir()  # a save killed mid-write
    (tmp_path / ckpt.step_name(3)).mkdir()
    ckpt.point_latest(tmp_path, ckpt.step_name(3), keep=2)
    assert _steps(tmp_path) == ["step_0000002", "step_0000003"]
    assert ckpt.resolve(tmp_path) == tmp_path / "step_0000003"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_an_interrupt_during_a_write_leaves_no_temporary_folder(tmp_path):
    """Guards against: write_atomic's `except BaseException` -> `except Exception` (Ctrl-C while the weights were
    written left a .tmp-* folder beside the checkpoints)."""

    def interrupted(tmp):
        (tmp / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ckpt.write_atomic(tmp_path / "step_1", interrupted)
    assert list(tmp_path.iterdir()) == []


def test_a_crashed_attempts_temporary_folder_is_replaced(tmp_path):
    """Guards against: fresh_folder kept what was in the folder (mkdir exist_ok instead of rmtree): a file left by a
    crashed attempt under the same temporary name went into the new checkpoint and its manifest."""
    stale = tmp_path / f".tmp-step_1-{os.getpid()}"
    stale.mkdir()
    (stale / "stale.bin").write_bytes(b"from the crashed attempt")
    target = ckpt.write_atomic(tmp_path / "step_1", populate_ab)
    assert sorted(p.name for p in target.iterdir()) == ["a.json", "b.bin", "manifest.json"]
    assert leftovers(tmp_path) == []


def test_unlisted_optimizer_weights_are_refused(checkpoint):
    """Guards against: verify looked only for an unlisted model.safetensors; an optimizer.safetensors the manifest does
    not vouch for would be loaded unchecked by a resume."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    del manifest["sha256"]["optimizer.safetensors"]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match="optimizer.safetensors not in the manifest"):
        ckpt.verify(checkpoint)


def test_read_sharded_keeps_the_saved_dtypes(tmp_path):
    """Guards against: read_sharded's templates were float32 whatever the saved dtype (bf16 weights and integer tensors
    came back cast)."""
    import torch.distributed.checkpoint as dcp

    model = {
        "w": torch.randn(3, 4).to(torch.bfloat16),
        "h": torch.randn(2, dtype=torch.float16),
        "n": torch.arange(5, dtype=torch.int64),
    }
    (tmp_path / ckpt.SHARDS).mkdir()
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": model}, checkpoint_id=str(tmp_path / ckpt.SHARDS))
    got = ckpt.read_sharded(tmp_path, "model")
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in model.items()}
    assert all(torch.equal(got[k], model[k]) for k in model)


def test_check_model_shapes_refuses_extra_or_transposed_weights(tmp_path):
    """Guards against: `if missing or extra` -> `if missing` (unexpected tensors alone passed), and the shape test by
    element count (a transposed matrix passed)."""
    a = {"x": torch.zeros(2, 3)}
    with pytest.raises(ckpt.CheckpointError, match=r"missing \[\], unexpected \['z'\]"):
        ckpt.check_model_shapes(a, {"x": torch.zeros(2, 3), "z": torch.zeros(1)}, tmp_path)
    with pytest.raises(ckpt.CheckpointError, match=r"x has shape \(3, 2\), the model expects \(2, 3\)"):
        ckpt.check_model_shapes(a, {"x": torch.zeros(3, 2)}, tmp_path)


def test_resolve_reads_a_latest_file_with_a_trailing_newline(run_dir, checkpoint):
    """Guards against: resolve dropped `.strip()` (a `latest` written by hand, `echo step_... > latest`, named a folder
    ending in a newline)."""
    (run_dir / "checkpoints" / "latest").write_text(checkpoint.name + "\n")
    assert ckpt.resolve(run_dir) == checkpoint
    assert ckpt.load_model(run_dir)[0].cfg.d_model == 32


def test_an_hf_folder_with_missing_weights_is_a_checkpoint_error(tmp_path):
    """Guards against: load_model of a Hugging Face folder skipped check_model_shapes (a missing tensor was a raw
    RuntimeError from load_state_dict, not a one-line CheckpointError)."""
    from looplm.config import ModelConfig
    from looplm.data import ByteTokenizer

    cfg = ModelConfig(vocab_size=258, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=32)
    state = {f"model.{k}": v.contiguous() for k, v in LoopedLM(cfg).state_dict().items()}
    dropped = sorted(state)[0]
    del state[dropped]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "looplm", **cfg.to_dict()}))
    ByteTokenizer().save(tmp_path / ckpt.HF_LOOPLM_TOKENIZER)
    ckpt.save_tensors(tmp_path, "model.safetensors", state)
    with pytest.raises(ckpt.CheckpointError, match=rf"missing \['{dropped[len('model.') :]}'\]"):
        ckpt.load_model(tmp_path)


def test_resolve_device_auto_and_device_index(monkeypatch):
    """Guards against: 'auto' resolved to the CPU whatever the machine, and `device.index >= device_count()` -> `>`
    (cuda:1 on a one-GPU machine was accepted). CUDA is faked: only the choice is under test."""
    from looplm.errors import UserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert ckpt.resolve_device("auto") == torch.device("cuda")
    assert ckpt.resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(UserError, match="has 1 CUDA device"):
        ckpt.resolve_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ckpt.resolve_device("auto") == torch.device("cpu")


def test_weights_follow_another_umask(tmp_path):
    """Guards against: follow_umask gave every file 0644 (right only under umask 022): under umask 027 the weights are
    0640, as every other file of the checkpoint."""
    old = os.umask(0o027)
    try:
        ckpt.save_tensors(tmp_path, "model.safetensors", {"x": torch.zeros(2)})
        (tmp_path / "plain.json").write_text("{}")
    finally:
        os.umask(old)
    modes = {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in tmp_path.iterdir()}
    assert modes == {"model.safetensors": "0o640", "plain.json": "0o640"}


def test_optimizer_state_keeps_its_tensor_dtypes(tmp_path):
    """Guards against: flatten_optimizer_state cast every tensor to float32 (a bf16 moment or an integer step came back
    in another dtype)."""
    state = {
        "state": {"w": {"step": torch.tensor(7), "exp_avg": torch.randn(3).to(torch.bfloat16)}},
        "param_groups": [{"lr": 0.1, "params": ["w"]}],
    }
    tensors, meta = ckpt.flatten_optimizer_state(state)
    ckpt.save_tensors(tmp_path, "optimizer.safetensors", tensors)
    back = ckpt.unflatten_optimizer_state(ckpt.load_tensors(tmp_path, "optimizer.safetensors"), meta)
    for name, value in state["state"]["w"].items():
        got = back["state"]["w"][name]
        assert got.dtype == value.dtype and torch.equal(got, value), name


# -- the trainer's Checkpointer (looplm.train.checkpointing): saves and resumes --------------------------
def test_each_rank_verifies_its_own_share(tmp_path):
    """Guards against: checkpointing.verify passed share=(0, world_size) on every rank (files outside rank 0's share
    were never hashed). Rank 1 of 2 is simulated: without a process group the gather is its own."""
    from looplm.train import checkpointing
    from looplm.train.distributed import DistEnv

    target = ckpt.write_atomic(tmp_path / "step_1", populate_ab)  # sorted: a.json (rank 0), b.bin (rank 1)
    (target / "b.bin").write_bytes(b"damaged")
    checkpointing.verify(target, DistEnv(rank=0, world_size=2))
    with pytest.raises(ckpt.CheckpointError, match="b.bin is corrupt"):
        checkpointing.verify(target, DistEnv(rank=1, world_size=2))


def test_a_second_asynchronous_save_commits_the_first(tmp_path, tmp_path_factory):
    """Guards against: Checkpointer.save no longer waited for the pending asynchronous save: the next save replaced it,
    so that checkpoint was never committed and its temporary folder was left behind."""
    t = sharded_trainer(tmp_path_factory, tmp_path, "run", train__steps=2, train__async_checkpoint=True)
    for _ in range(2):
        t.train_step()
        t.save()
    t.checkpointer.wait()
    assert sorted(p.name for p in t.ckpt_root.iterdir()) == ["latest", "step_0000001", "step_0000002"]
    assert ckpt.resolve(t.out_dir).name == "step_0000002"
    for name in ("step_0000001", "step_0000002"):
        ckpt.verify(t.ckpt_root / name)


def test_a_resume_without_optimizer_weights_is_refused(checkpoint, run_dir, tmp_path_factory):
    """Guards against: `not optimizer.safetensors or "optimizer" not in state` -> `and` (a checkpoint that lost its
    optimizer file but kept the state's optimizer entry failed inside safetensors, not with the one-line
    CheckpointError)."""
    (checkpoint / "optimizer.safetensors").unlink()
    manifest = json.loads((checkpoint / ckpt.MANIFEST).read_text())
    del manifest["sha256"]["optimizer.safetensors"]
    (checkpoint / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match="holds no optimizer state"):
        resume(run_dir, tmp_path_factory)


def test_a_resume_with_missing_weights_names_them(checkpoint, run_dir, tmp_path_factory):
    """Guards against: Checkpointer.load (single file) skipped check_model_shapes (a checkpoint missing a tensor was an
    internal error from set_model_state_dict instead of a CheckpointError naming it)."""
    weights = ckpt.load_tensors(checkpoint, "model.safetensors")
    dropped = sorted(weights)[-1]
    del weights[dropped]
    ckpt.save_tensors(checkpoint, "model.safetensors", weights)
    rewrite_manifest(checkpoint)
    with pytest.raises(ckpt.CheckpointError, match=rf"missing \['{dropped}'\]"):
        resume(run_dir, tmp_path_factory)


@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded"])
def test_checkpointer_restores_the_optimizer_param_groups(tmp_path, sharded):
    """Guards against: the sharded load gave set_state_dict the optimizer's own state instead of the one read from the
    shards (the moments, loaded in place, came back; the saved param groups did not). Both forms restore the saved
    hyperparameters and state into an optimizer built with others."""
    from looplm.train.checkpointing import Checkpointer
    from looplm.train.distributed import DistEnv

    def build(lr, wd):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=(0.8, 0.9))

    model, opt = build(0.1, 0.3)
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    saver = Checkpointer(tmp_path, DistEnv(), model, opt, sharded=sharded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        path = saver.save(3, {"step": 3}, lambda tmp: None)
    twin, twin_opt = build(0.5, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert Checkpointer(tmp_path, DistEnv(), twin, twin_opt, sharded=sharded).load(path)["step"] == 3
    assert [(g["lr"], g["weight_decay"]) for g in twin_opt.param_groups] == [(0.1, 0.3)]
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        for name, value in opt.state[p].items():
            assert torch.equal(twin_opt.state[q][name], value), name
