"""The trainer's checkpoints: the single-file form and the sharded form (layouts in `looplm.checkpoint`).

- Single file (one process, DDP): the state is whole on every rank; rank 0 writes
  model.safetensors and optimizer.safetensors.
- Sharded (FSDP2, HSDP): every rank writes its own shards of the model and optimizer state with
  torch.distributed.checkpoint (`state/`) and its RNG state (`rng/rank_<rank>.json`); no rank
  gathers the full state. torch.distributed.checkpoint reshards on load, so the shards load onto
  any number of ranks, or into one process.

Both are written into a temporary folder that rank 0 renames into place once every file is there,
with a manifest whose SHA-256 sums each rank computed for the files it wrote. With `async_save`
(sharded only) the state is copied to host memory and the main thread goes on training while a
background thread writes the shards (its collectives on a gloo group of their own, `side_group`);
the checkpoint is committed (manifest, rename, `latest`) at the first step at which every rank's
write has finished, and at the latest before the next save or when training ends.
"""

from __future__ import annotations

import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from looplm import checkpoint as ckpt
from looplm.train import distributed as D


def is_sharded_run(env: D.DistEnv, parallel: str) -> bool:
    """FSDP2 and HSDP runs under a process group write sharded checkpoints; the others one file."""
    return env.distributed and parallel in ("fsdp", "hsdp")


def verify(path: Path, env: D.DistEnv) -> None:
    """Check the manifest of `path`, each rank hashing its share of the files; raises the same
    CheckpointError on every rank when any file is missing or corrupt."""
    try:
        ckpt.verify(path, share=(env.rank, env.world_size))
        error = None
    except ckpt.CheckpointError as err:
        error = str(err)
    errors = [e for e in D.all_gather_object(error, env) if e]
    if errors:
        raise ckpt.CheckpointError(errors[0])


def rng_state(device: torch.device) -> dict:
    return {
        "torch": torch.get_rng_state().tolist(),
        "cuda": torch.cuda.get_rng_state(device).tolist() if device.type == "cuda" else None,
    }


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8), device)


@dataclass
class _Pending:
    """A sharded save whose shards are being written: `tmp` is renamed to `target` once `digests`
    (this rank's {file: SHA-256}) is done on every rank."""

    tmp: Path
    target: Path
    digests: Future


class Checkpointer:
    """Saves and loads the model, optimizer and RNG state of a training run; every rank calls every method."""

    def __init__(
        self,
        root: Path,
        env: D.DistEnv,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        sharded: bool,
        async_save: bool = False,
        keep: int = 2,
    ):
        self.root, self.env, self.model, self.optimizer = Path(root), env, model, optimizer
        self.sharded, self.async_save, self.keep = sharded, async_save and sharded, keep
        self._pending: _Pending | None = None
        self._group = None  # the background writes' gloo group, made at the first asynchronous save
        self._hasher: ThreadPoolExecutor | None = None

    # -- save -----------------------------------------------------------------------------------
    def save(self, step: int, state: dict, write_files: Callable[[Path], None]) -> Path:
        """Write checkpoint `root/step_<step>`: the model and optimizer, trainer state `state` (a
        JSON dict) and, on rank 0, whatever `write_files(folder)` adds (config, tokenizer). Returns
        its final path (where an asynchronous save appears once committed)."""
        self.wait()
        if self.sharded:
            return self._save_sharded(step, state, write_files)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(self.model, options=opts)
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        target = self.root / ckpt.step_name(step)
        if self.env.is_main:
            tensors, optim_meta = ckpt.flatten_optimizer_state(optim_sd)
            full = {**state, "optimizer": optim_meta, "torch_rng": torch.get_rng_state().tolist()}

            def populate(tmp: Path) -> None:
                ckpt.save_tensors(tmp, "model.safetensors", model_sd)
                ckpt.save_tensors(tmp, "optimizer.safetensors", tensors)
                ckpt.write_json(tmp, "trainer_state.json", full)
                write_files(tmp)

            ckpt.save_step(self.root, step, populate, self.keep)
        D.barrier(self.env)
        return target

    def _save_sharded(self, step: int, state: dict, write_files: Callable[[Path], None]) -> Path:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        env = self.env
        target = self.root / ckpt.step_name(step)
        tmp = self.root / f".tmp-{target.name}"  # one name for every rank (a crashed attempt's is replaced)
        if env.is_main:
            ckpt.fresh_folder(tmp)
        D.barrier(env)
        (tmp / ckpt.RNG).mkdir(exist_ok=True)
        rng_file = tmp / ckpt.RNG / f"rank_{env.rank:05d}.json"
        ckpt.write_json(rng_file.parent, rng_file.name, rng_state(env.device))
        if env.is_main:
            ckpt.write_json(tmp, "trainer_state.json", state)
            write_files(tmp)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)  # this rank's shards (DTensors)
        writer = dcp.FileSystemWriter(str(tmp / ckpt.SHARDS))
        shards = {"model": model_sd, "optimizer": optim_sd}
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized" on one process: the intent
            warnings.simplefilter("ignore", UserWarning)
            digests = self._write_shards(shards, writer, tmp, rng_file)
        self._pending = _Pending(tmp, target, digests)
        if not self.async_save:
            self._commit()
        return target

    def _write_shards(self, shards: dict, writer, tmp: Path, rng_file: Path) -> Future:
        """Write this rank's shards (in the background when asynchronous); the future's result is
        the SHA-256 sums of the files this rank wrote."""
        import torch.distributed.checkpoint as dcp

        if self.async_save:
            if self._group is None:
                self._group = D.side_group(self.env)
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="looplm-checkpoint")
            written = dcp.async_save(shards, storage_writer=writer, process_group=self._group)
            written = getattr(written, "upload_completion", written)  # AsyncSaveResponse or a Future

            def written_then_hashed() -> dict[str, str]:
                written.result()
                return self._own_digests(tmp, rng_file)

            return self._hasher.submit(written_then_hashed)
        dcp.save(shards, storage_writer=writer)
        digests: Future = Future()
        digests.set_result(self._own_digests(tmp, rng_file))
        return digests

    def _own_digests(self, tmp: Path, rng_file: Path) -> dict[str, str]:
        """SHA-256 of the files this rank wrote: its shard files and its RNG state."""
        mine = [*sorted((tmp / ckpt.SHARDS).glob(f"__{self.env.rank}_*.distcp")), rng_file]
        return {p.relative_to(tmp).as_posix(): ckpt.file_sha256(p) for p in mine}

    def poll(self) -> None:
        """Commit a pending asynchronous save once every rank's write has finished (call after each step)."""
        if self._pending is None:
            return
        if D.all_reduce_int(int(self._pending.digests.done()), self.env) == self.env.world_size:
            self._commit()

    def wait(self) -> None:
        """Finish and commit a pending save."""
        if self._pending is not None:
            self._commit()

    def _commit(self) -> None:
        pending, self._pending = self._pending, None
        try:
            digests, error = pending.digests.result(), None
        except Exception as err:  # reported on every rank below, instead of a hang in the gather
            digests, error = {}, f"rank {self.env.rank}: {err!r}"
        gathered = D.all_gather_object((digests, error), self.env)
        errors = [e for _, e in gathered if e]
        if errors:
            if self.env.is_main:
                shutil.rmtree(pending.tmp, ignore_errors=True)
            raise ckpt.CheckpointError(f"writing checkpoint {pending.target} failed: {errors[0]}")
        if self.env.is_main:
            ckpt.commit(pending.tmp, pending.target, {k: v for d, _ in gathered for k, v in d.items()})
            ckpt.point_latest(self.root, pending.target.name, self.keep)
        D.barrier(self.env)

    # -- load -----------------------------------------------------------------------------------
    def load(self, path: Path) -> dict:
        """Restore the model, optimizer and this rank's RNG from checkpoint `path` (either form,
        saved on any number of ranks); returns its trainer state."""
        state = ckpt.read_json(path, "trainer_state.json")
        if ckpt.is_sharded(path):
            self._load_sharded(path)
            rng = ckpt.read_rng(path, self.env.rank)
            if rng is not None:
                set_rng_state(rng, self.env.device)
            return state
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if not (path / "optimizer.safetensors").is_file() or "optimizer" not in state:
            raise ckpt.CheckpointError(
                f"{path} holds no optimizer state (written for inference, e.g. by `looplm "
                "consolidate --weights-only`); a run cannot resume from it"
            )
        model_sd = ckpt.load_tensors(path, "model.safetensors")
        ckpt.check_model_shapes(self.model.state_dict(), model_sd, path)
        optim_sd = ckpt.unflatten_optimizer_state(ckpt.load_tensors(path, "optimizer.safetensors"), state["optimizer"])
        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, model_sd, options=opts)
        set_optimizer_state_dict(self.model, self.optimizer, optim_sd, options=opts)
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        return state

    def _load_sharded(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        # templates of this rank's shards (the optimizer's state is created by a zero-lr step if empty),
        # filled in place by reading the parts of the saved shards they cover
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        shards = {"model": model_sd, "optimizer": optim_sd}
        try:
            with warnings.catch_warnings():  # "torch.distributed is ... uninitialized" on one process: the intent
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(
                    shards,
                    storage_reader=dcp.FileSystemReader(str(path / ckpt.SHARDS)),
                    no_dist=not self.env.distributed,
                )
        except Exception as err:  # DCP's CheckpointException wraps each rank's error
            raise ckpt.CheckpointError(f"{path}: the sharded state does not load into this model ({err})") from None
        set_state_dict(
            self.model, self.optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"]
        )
