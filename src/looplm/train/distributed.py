"""Process group setup and data-parallel wrapping, applied from outside the model (torchrun).

A single process needs no launcher. Under `torchrun` the environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT) selects gloo on CPU and nccl on GPU; the model is wrapped in DDP,
or sharded with FSDP2 (`fully_shard` on every block, then on the root).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def resolve_device(pref: str) -> torch.device:
    if pref == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    if pref == "auto":
        pref = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(pref)


def init_distributed(device_pref: str = "auto") -> DistEnv:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1); else a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(device_pref)
    if world <= 1:
        return DistEnv(device=device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device)


def wrap_model(model: nn.Module, env: DistEnv, parallel: str) -> nn.Module:
    """DDP or FSDP2 around a single-device model; the model itself is returned on one process."""
    if not env.distributed:
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for stack in ("prelude", "core", "coda"):
            for block in getattr(model, stack):
                fully_shard(block)
        fully_shard(model)
        return model
    raise ValueError(f"unknown parallel mode {parallel!r}; choose ddp or fsdp")


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def broadcast_object(obj, env: DistEnv):
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def shutdown(env: DistEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()
