"""Checkpoint format: safetensors weights, JSON state, a SHA-256 manifest, atomic writes.

A checkpoint is a folder:
  model.safetensors      model weights (full, unsharded)
  optimizer.safetensors  optimizer tensors (training checkpoints only)
  trainer_state.json     step, schedule, sampler counters, optimizer param groups, RNG, ...
  config.json            the job configuration (model/depth/data/train)
  data.json              the data record (looplm.data.record): what eval, analyze, distill and rl read back
  tokenizer*.json        the tokenizer (see looplm.data.tokenizer)
  manifest.json          SHA-256 of every other file (subfolders included); verified at load
It is written into a temporary sibling folder and renamed into place, so a crash never leaves a
damaged checkpoint under the final name.

A sharded checkpoint (FSDP2/HSDP training, `looplm.train.checkpointing`) holds, instead of the two
safetensors files, `state/`: a torch.distributed.checkpoint folder (one `__<rank>_<i>.distcp` per
writing rank and `.metadata`) with the model under "model.*" and the optimizer under
"optimizer.*", and `rng/rank_<rank>.json`, each rank's RNG state. `load_weights` (every reader
goes through it) consolidates the model in one process; `consolidate` writes the single-file form.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from looplm.errors import UserError

MANIFEST = "manifest.json"
FORMAT = "looplm-checkpoint-v1"
DATA_RECORD = "data.json"
CONVERSION = "conversion.json"  # written by `looplm convert`: where the weights came from


class CheckpointError(UserError):
    """A checkpoint that is missing, corrupt, or does not fit what it is loaded into."""


def file_sha256(path: Path) -> str:
    """SHA-256 hex digest of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fresh_folder(path: Path) -> Path:
    """An empty folder at `path` (whatever was there is removed)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def commit(tmp: Path, target: Path, digests: dict[str, str] | None = None) -> Path:
    """Add the manifest to the finished temporary folder `tmp` and rename it to `target`.

    The manifest lists every file under `tmp` by its path relative to it; `digests` are SHA-256
    sums already computed by the processes that wrote those files (the shards of the other ranks;
    those processes flushed them), the rest are hashed and flushed here."""
    digests = dict(digests or {})
    for p in sorted(tmp.rglob("*")):
        name = p.relative_to(tmp).as_posix()
        if p.is_file() and name not in digests:
            digests[name] = file_sha256(p)
            with open(p, "rb") as f:  # flush file contents before the rename makes them visible
                os.fsync(f.fileno())
    with open(tmp / MANIFEST, "w") as f:
        f.write(json.dumps({"format": FORMAT, "sha256": dict(sorted(digests.items()))}, indent=1))
        f.flush()
        os.fsync(f.fileno())
    if target.exists():
        old = target.parent / f".old-{target.name}-{os.getpid()}"
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)
    return target


def write_atomic(target: Path, populate: Callable[[Path], None]) -> Path:
    """Create folder `target` by letting `populate(tmp)` write files into a temporary folder,
    adding the manifest, then renaming it into place."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = fresh_folder(target.parent / f".tmp-{target.name}-{os.getpid()}")
    try:
        populate(tmp)
        return commit(tmp, target)
    except BaseException:  # leave no half-written folder behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def step_name(step: int) -> str:
    return f"step_{step:07d}"


def point_latest(root: Path, name: str, keep: int) -> None:
    """Point `root/latest` at checkpoint `root/name` and delete all but the `keep` newest step folders up
    to it. Step folders past `name`, and temporary folders of saves, are what a killed run left (a step
    renamed into place before `latest` moved on to it, a half-written save): resumed from an earlier
    step, the run has abandoned them, so they are deleted too."""
    root = Path(root)
    tmp_latest = root / ".latest.tmp"
    tmp_latest.write_text(name)
    tmp_latest.replace(root / "latest")
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    kept = [p for p in steps if p.name <= name][-max(1, keep) :]
    for old in [p for p in steps if p not in kept] + [p for p in root.glob(".tmp-step_*") if p.is_dir()]:
        shutil.rmtree(old, ignore_errors=True)


def save_step(root: Path, step: int, populate: Callable[[Path], None], keep: int) -> Path:
    """Write checkpoint `root/step_<step>` atomically (see `write_atomic`), point `root/latest` at it
    and delete all but the `keep` newest step folders."""
    target = write_atomic(Path(root) / step_name(step), populate)
    point_latest(root, target.name, keep)
    return target


def save_model(root: Path, model: torch.nn.Module, job: dict, tokenizer, step: int = 1) -> Path:
    """A run folder `root` whose `checkpoints/step_<step>` holds `model`'s weights, the training job
    `job` (a `TrainJob.to_dict()`) and `tokenizer`, as `looplm train` writes them (no optimizer
    state: it loads for inference, not to resume)."""
    from looplm.data.record import DataRecord

    def populate(tmp: Path) -> None:
        save_tensors(tmp, "model.safetensors", model.state_dict())
        write_json(tmp, "config.json", job)
        write_data_record(tmp, DataRecord.from_job(job))
        tokenizer.save(tmp)

    return save_step(Path(root) / "checkpoints", step, populate, keep=1)


def write_data_record(path: Path, record) -> None:
    """Store the data record (`looplm.data.record.DataRecord`) in the checkpoint folder being written."""
    write_json(path, DATA_RECORD, record.to_dict())


def load_data(path: Path):
    """The data record (`looplm.data.record.DataRecord`) of a checkpoint, run or exported folder: its
    data.json; for a checkpoint written before data.json existed, read off the job in config.json (a
    converted one that recorded the task generator, the old default, gets the built-in text instead:
    no released model was trained on it). Raises CheckpointError when the folder records no data."""
    from looplm.data import DataError
    from looplm.data.record import BUILTIN_TEXT, DataRecord

    path = resolve(path)
    try:
        if is_hf_folder(path):
            info = read_json(path, HF_EXPORT_INFO) if (path / HF_EXPORT_INFO).is_file() else {}
            if isinstance(info.get("data"), dict):
                return DataRecord.from_dict(info["data"])
            if isinstance(info.get("job"), dict):
                return DataRecord.from_job(info["job"])
            raise CheckpointError(
                f"{path}: this Hugging Face folder does not record the training job (no "
                f"{HF_EXPORT_INFO} with it), so there is no held-out data of its own; give --data, "
                "re-export the looplm checkpoint with `looplm export`, or evaluate the checkpoint itself"
            )
        if (path / DATA_RECORD).is_file():
            return DataRecord.from_dict(read_json(path, DATA_RECORD))
        converted = (path / CONVERSION).is_file()
        record = DataRecord.from_job(read_json(path, "config.json"), origin="converted" if converted else "trained")
    except (OSError, ValueError) as err:
        if isinstance(err, CheckpointError):
            raise
        detail = str(err) if isinstance(err, DataError) else f"{type(err).__name__}: {err}"
        raise CheckpointError(f"{path}: unreadable data record ({detail})") from None
    if converted and record.is_tasks:
        record = record.with_source(BUILTIN_TEXT)
    return record


def verify(path: Path, share: tuple[int, int] = (0, 1)) -> dict:
    """Check the manifest's SHA-256 sums; return the manifest. Raises CheckpointError.

    `share=(k, n)` checks only every n-th file from the k-th (n processes split a large checkpoint)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint folder at {path}")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {MANIFEST}: not a looplm checkpoint or an interrupted write") from None
    except json.JSONDecodeError:
        raise CheckpointError(f"{path}/{MANIFEST} is not valid JSON") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {manifest.get('format')!r}")
    listed = manifest.get("sha256")
    if not isinstance(listed, dict):
        raise CheckpointError(f"{path}/{MANIFEST} has no sha256 table")
    unlisted = sorted(f.name for f in path.glob("*.safetensors") if f.name not in listed)
    if unlisted:  # weights nothing vouches for would load unchecked
        raise CheckpointError(f"{path}: {', '.join(unlisted)} not in the manifest (a file put there by hand?)")
    for name, digest in sorted(listed.items())[share[0] :: share[1]]:
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: file {name} listed in the manifest is missing")
        if file_sha256(f) != digest:
            raise CheckpointError(f"{path}: {name} is corrupt (SHA-256 mismatch)")
    return manifest


def read_json(path: Path, name: str) -> dict:
    return json.loads((Path(path) / name).read_text())


def write_json(path: Path, name: str, data: dict) -> None:
    (Path(path) / name).write_text(json.dumps(data, indent=1, sort_keys=True))


def save_tensors(path: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(Path(path) / name))
    follow_umask(Path(path) / name)


def current_umask() -> int:
    """The process's umask, read from /proc where it can be (setting it to read it back is not
    thread-safe: another thread's files would be created meanwhile with mode 0666)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(*files: Path) -> None:
    """Give `files` the mode a plain `open` would (0666 less the umask): safetensors' `save_file`
    creates them owner-only (0600), which makes a checkpoint or export unreadable to other accounts."""
    mode = 0o666 & ~current_umask()
    for f in files:
        os.chmod(f, mode)


def load_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / name))


# -- sharded checkpoints (torch.distributed.checkpoint) ---------------------------------------------
SHARDS = "state"  # the torch.distributed.checkpoint folder of a sharded checkpoint
RNG = "rng"  # rng/rank_<rank>.json: each rank's RNG state in a sharded checkpoint


def is_sharded(path: Path) -> bool:
    return (Path(path) / SHARDS / ".metadata").is_file()


def read_sharded(path: Path, section: str) -> dict:
    """Section `section` ("model" or "optimizer") of a sharded checkpoint, read whole into this process
    (as a state dict: FQN -> tensor for the model, {"state", "param_groups"} for the optimizer).
    Needs no process group; reads only that section's shards."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(Path(path) / SHARDS))
    metadata = reader.read_metadata()
    template: dict = {}
    for key, where in metadata.planner_data.items():  # flat key -> its path in the saved nested dict
        if where[0] != section:
            continue
        meta = metadata.state_dict_metadata[key]
        node = template
        for part in where[:-1]:  # list indices as string keys, as DCP's own flattening names them
            node = node.setdefault(str(part), {})
        node[str(where[-1])] = (
            torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) else None
        )  # None: a pickled value, set by the load
    if section not in template:
        raise CheckpointError(f"{path}: the sharded checkpoint holds no {section!r} state")
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(template, storage_reader=reader, no_dist=True)
    return _lists(template[section])


def _lists(node):
    """`read_sharded`'s nested dicts with the lists restored (dicts keyed "0", "1", ...)."""
    if not isinstance(node, dict):
        return node
    if node and all(k.isdigit() for k in node):
        return [_lists(node[str(i)]) for i in range(len(node))]
    return {k: _lists(v) for k, v in node.items()}


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The full model weights of a checkpoint folder: its model.safetensors, or the model shards of a
    sharded checkpoint consolidated in this process. Every reader of checkpoints loads through here."""
    if is_sharded(path):
        return read_sharded(path, "model")
    return load_tensors(path, "model.safetensors")


def read_rng(path: Path, rank: int) -> dict | None:
    """The RNG state rank `rank` saved in a sharded checkpoint ({"torch": [...], "cuda": [...] or None}),
    that of rank `rank` modulo the ranks that saved it when it ran on more ranks; None in the single-file form."""
    files = sorted((Path(path) / RNG).glob("rank_*.json"))
    return json.loads(files[rank % len(files)].read_text()) if files else None


def consolidate(src: Path, out: Path, *, weights_only: bool = False) -> Path:
    """Write the sharded checkpoint `src` (a checkpoint or run folder) in the single-file form as the
    run folder `out` (`out/checkpoints/step_<N>`, with `latest`): model.safetensors and, unless
    `weights_only`, optimizer.safetensors, so DDP or one process can resume from it. Reads the
    whole model (and optimizer state) into this process."""
    path, out = resolve(src), Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} is not empty; consolidate into a new (or empty) folder")
    verify(path)
    if not is_sharded(path):
        raise CheckpointError(f"{path} is already a single-file checkpoint (model.safetensors); nothing to consolidate")
    state = read_json(path, "trainer_state.json")
    weights = read_sharded(path, "model")
    rng = read_rng(path, 0)

    def populate(tmp: Path) -> None:
        save_tensors(tmp, "model.safetensors", weights)
        saved = {k: v for k, v in state.items() if k != "optimizer"}
        if not weights_only:
            tensors, saved["optimizer"] = flatten_optimizer_state(read_sharded(path, "optimizer"))
            save_tensors(tmp, "optimizer.safetensors", tensors)
        if rng is not None:
            saved["torch_rng"] = rng["torch"]
        write_json(tmp, "trainer_state.json", saved)
        for f in path.iterdir():  # config.json and the tokenizer files
            if f.is_file() and f.name not in (MANIFEST, "trainer_state.json"):
                shutil.copyfile(f, tmp / f.name)

    return save_step(Path(out) / "checkpoints", int(state["step"]), populate, keep=1)


# -- optimizer state <-> flat tensors + JSON ------------------------------------------------------
def flatten_optimizer_state(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split a (full, FQN-keyed) optimizer state dict into safetensors-able tensors and JSON."""
    tensors, scalars = {}, {}
    for key, per_param in state["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{key}::{name}"] = value
            else:
                scalars[f"{key}::{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict = {}
    for flat, value in list(tensors.items()) + list(meta["scalars"].items()):
        key, name = flat.rsplit("::", 1)
        state.setdefault(key, {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def check_model_shapes(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], where: Path) -> None:
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"{where}: weights do not match the model (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    for k, v in expected.items():
        if tuple(found[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{where}: {k} has shape {tuple(found[k].shape)}, the model expects {tuple(v.shape)}")


def resolve(path: Path) -> Path:
    """Accept a checkpoint folder, a run folder (uses its latest checkpoint) or `checkpoints/`."""
    path = Path(path)
    for base in (path, path / "checkpoints"):
        latest = base / "latest"
        if latest.is_file():
            return base / latest.read_text().strip()
    return path


def refuse_overlap(source: Path, out_dir: Path, option: str = "--out-dir") -> None:
    """A command that starts a new run from checkpoint `source` (distill, rl) writes beside its source run,
    never into it: a UserError when `out_dir` lies inside the source's run folder, or holds the source."""
    source = Path(source).resolve()
    run = source.parent.parent if source.parent.name == "checkpoints" else source
    out = Path(out_dir).resolve()
    if out == run or run in out.parents or out in source.parents:
        raise UserError(f"{option} {out_dir} overlaps the source run {run}; choose a folder outside it")


def refuse_file_out_dir(out_dir: Path, option: str) -> None:
    """A UserError, before any work, when `out_dir` or the first of its parents that exists is a file (the run
    could not create its folder there)."""
    out = Path(out_dir)
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                raise UserError(f"{option} {out}: {p} is a file, not a folder: choose another {option}")
            return


# -- folders written by `looplm export` (read with json + safetensors only: no transformers here) ------
HF_EXPORT_INFO = "looplm_export.json"  # {"source", "tokenizer", "job"}: what `looplm export` adds
HF_LOOPLM_TOKENIZER = "looplm_tokenizer"  # looplm's own tokenizer files (HF's names collide with them)
_BYTE_PROBE = "hello wörld\t\n 日本 🎉 <>"  # no literal specials: raw `tokenizers` would match them


def is_hf_folder(path: Path) -> bool:
    """True for a transformers folder of a looplm model (config.json with model_type "looplm")."""
    path = Path(path)
    if (path / MANIFEST).is_file() or not (path / "config.json").is_file():
        return False
    try:
        return json.loads((path / "config.json").read_text()).get("model_type") == "looplm"
    except (OSError, ValueError, AttributeError):
        return False


class _JobWithoutData(dict):
    """The job dict of an HF folder that does not say what the model was trained on: reading a
    missing section (data, train, ...) is a one-line CheckpointError instead of a KeyError."""

    def __init__(self, path: Path, model: dict):
        super().__init__(model=model)
        self._path = path

    def __missing__(self, key):
        raise CheckpointError(
            f"{self._path}: this Hugging Face folder does not record the training job (no "
            f"{HF_EXPORT_INFO} with a job), so there is no held-out data for '{key}'; re-export "
            "the looplm checkpoint with `looplm export`, or evaluate the checkpoint itself"
        )


def _hf_tokenizer(path: Path):
    """looplm's tokenizer of an HF folder: the copy `looplm export` wrote, else rebuilt from tokenizer.json."""
    from tokenizers import Tokenizer as HFTokenizer

    from looplm.data import BPETokenizer, ByteTokenizer, load_tokenizer
    from looplm.data.tokenizer import bos_policy

    if (path / HF_LOOPLM_TOKENIZER).is_dir():
        return load_tokenizer(path / HF_LOOPLM_TOKENIZER)
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"{path}: no tokenizer.json (nor {HF_LOOPLM_TOKENIZER}/) in the Hugging Face folder")
    hf_cfg = (
        json.loads((path / "tokenizer_config.json").read_text()) if (path / "tokenizer_config.json").is_file() else {}
    )
    names = [hf_cfg.get(k) for k in ("eos_token", "pad_token")]
    names = [n.get("content") if isinstance(n, dict) else n for n in names]
    backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
    byte = ByteTokenizer()
    if (
        backend.get_vocab_size(with_added_tokens=True) == byte.vocab_size
        and names in ([None, None], ["<eos>", "<pad>"])
        and backend.token_to_id("<eos>") == byte.eos_id
        and backend.token_to_id("<pad>") == byte.pad_id
        and backend.encode(_BYTE_PROBE, add_special_tokens=False).ids == byte.encode(_BYTE_PROBE)
    ):
        return byte  # the byte tokenizer as `looplm.hf.byte_tokenizer` writes it
    if None in names:
        raise CheckpointError(f"{path}: tokenizer_config.json does not name eos_token and pad_token")
    return BPETokenizer.from_file(path / "tokenizer.json", *names, bos_policy(backend, hf_cfg))


def _hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """The LoopedLM state dict of an HF folder (model.safetensors or a sharded index; keys 'model.*')."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path}: no model.safetensors in the Hugging Face folder")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_tensors(path, name))
    return {k[len("model.") :] if k.startswith("model.") else k: v for k, v in weights.items()}


def load_hf_folder(path: Path):
    """(model config, tokenizer, weights, job dict) of a folder written by `looplm export`."""
    import dataclasses

    from looplm.config import ModelConfig

    path = Path(path)
    try:
        hf_config = json.loads((path / "config.json").read_text())
        names = {f.name for f in dataclasses.fields(ModelConfig)}
        model_cfg = ModelConfig(**{k: v for k, v in hf_config.items() if k in names})
        model_cfg.validate()
        tokenizer = _hf_tokenizer(path)
        info = json.loads((path / HF_EXPORT_INFO).read_text()) if (path / HF_EXPORT_INFO).is_file() else {}
    except (KeyError, TypeError, ValueError, OSError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"{path}: unreadable Hugging Face config or tokenizer ({err})") from None
    job = info.get("job")
    job = {**job, "model": model_cfg.to_dict()} if isinstance(job, dict) else _JobWithoutData(path, model_cfg.to_dict())
    return model_cfg, tokenizer, _hf_weights(path), job


def _check_vocab(path: Path, tokenizer, model_cfg) -> None:
    """Every token id has an embedding row; more rows than tokens is a padded vocabulary (released models)."""
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise CheckpointError(
            f"{path}: tokenizer has {tokenizer.vocab_size} tokens, the model only {model_cfg.vocab_size}"
        )


def load_model(path: Path, device: str | torch.device = "cpu"):
    """(model, tokenizer, job config dict) from a verified checkpoint, in eval mode. A folder
    written by `looplm export` (a transformers folder) loads too; its job dict is the exported
    checkpoint's, or, when the folder does not record one, just the model config."""
    from looplm.config import ModelConfig
    from looplm.data import load_tokenizer
    from looplm.model import LoopedLM

    path = resolve(path)
    if is_hf_folder(path):
        model_cfg, tokenizer, weights, job = load_hf_folder(path)
        _check_vocab(path, tokenizer, model_cfg)
        model = LoopedLM(model_cfg)
        check_model_shapes(model.state_dict(), weights, path)
        model.load_state_dict(weights)
        return model.to(device).eval(), tokenizer, job
    verify(path)
    if not (path / "config.json").is_file() and (path / "student.json").is_file():
        raise CheckpointError(
            f"{path} is a distilled prefill student, not a looped model: give its teacher's checkpoint, "
            f"with --prefill student --student {path} where the command takes them"
        )
    config = read_json(path, "config.json")
    try:
        model_cfg = ModelConfig.from_dict(config["model"])
        tokenizer = load_tokenizer(path)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable config or tokenizer ({err})") from None
    _check_vocab(path, tokenizer, model_cfg)
    model = LoopedLM(model_cfg)
    weights = load_weights(path)
    check_model_shapes(model.state_dict(), weights, path)
    model.load_state_dict(weights)
    return model.to(device).eval(), tokenizer, config


def resolve_device(pref: str) -> torch.device:
    """The device of a --device option: auto (CUDA when available, else the CPU), cpu, cuda, cuda:N, ...;
    a malformed name, or a CUDA device this machine does not have, is a UserError."""
    if pref == "auto":
        pref = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(pref)
    except RuntimeError:
        raise UserError(f"unknown device {pref!r}: use auto, cpu, cuda, cuda:N, ...") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {pref!r} requested but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(
                f"device {pref!r} requested but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return device
