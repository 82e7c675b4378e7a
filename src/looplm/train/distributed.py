"""The process group and every collective looplm issues (one place owns them all).

A single process needs no launcher. Under `torchrun` (RANK and WORLD_SIZE in the environment,
even for one process) the process joins a group: nccl when training on CUDA, gloo on CPU.
Wrapping the model for data parallelism lives in `looplm.train.parallelize`.

Why one module: a backend serves some device types only. NCCL has no CPU backend, so an
`all_reduce` of a CPU tensor in an NCCL group fails ("No backend type associated with device type
cpu"). The helpers here move every tensor to `DistEnv.comm_device` (the device the group serves),
check it with `check_served`, reduce, and hand the result back on the caller's device. The
trainer, evaluation, the learned depth prior's feedback, RL and distillation reduce through them;
`tests/test_train_distributed.py` checks that no other module calls `torch.distributed` collectives.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from looplm.checkpoint import resolve_device  # noqa: F401 - where the device option is resolved (re-exported)
from looplm.errors import UserError


class CollectiveDeviceError(RuntimeError):
    """A collective was handed a tensor on a device its process group's backend does not serve."""


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    """Where the model computes."""
    comm_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where collectives run: a device the group's backend serves (cuda:<local rank> under nccl)."""
    joined: bool = False
    """A process group exists (launched by torchrun), even with a single rank."""
    local_world_size: int = 1
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE): the shard group of HSDP."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.joined


def rank_share(total: int, env: DistEnv, what: str) -> int:
    """This rank's equal share of a global per-step count (rows, prompts), which must divide evenly."""
    if total % env.world_size:
        raise UserError(
            f"{what} {total} (per step over all ranks) must be divisible by the number of ranks, {env.world_size}"
        )
    return total // env.world_size


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def served_device_types(group=None) -> set[str]:
    """Device types ('cpu', 'cuda', ...) the group's backends serve."""
    pg = group or dist.group.WORLD
    return {d.type for d in pg._device_types}


def comm_device_for(device: torch.device, served: set[str]) -> torch.device:
    """The device collectives use when the model computes on `device`: `device` itself when the
    backend serves it (nccl with CUDA, gloo with CPU), else the CPU when that is served."""
    if device.type in served:
        return device
    if "cpu" in served:
        return torch.device("cpu")
    raise CollectiveDeviceError(
        f"the process group's backend ({dist.get_backend()}) serves {', '.join(sorted(served))}, "
        f"but the model computes on {device}; launch with a backend that serves it (nccl for cuda, gloo for cpu)"
    )


# How long a collective may wait for the other ranks before the process group aborts it (and the run
# fails with an error naming the collective) instead of hanging; from LOOPLM_DIST_TIMEOUT_S if set.
DEFAULT_TIMEOUT_S = 600.0


def process_group_options(device: torch.device) -> dict:
    """`init_process_group` arguments for a model on `device`: nccl bound to this rank's GPU
    (`device_id` forms the communicator at once, so a wrong device or a missing peer fails at start-up
    rather than at the first collective), gloo on the CPU; both with a timeout."""
    timeout = timedelta(seconds=float(os.environ.get("LOOPLM_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
    if device.type == "cuda":
        return {"backend": "nccl", "device_id": device, "timeout": timeout}
    return {"backend": "gloo", "timeout": timeout}


def init_distributed(device_pref: str = "auto") -> DistEnv:
    """Join the process group when launched by torchrun; else a single process without one."""
    device = resolve_device(device_pref)
    if not launched_by_torchrun():
        return DistEnv(device=device)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(**process_group_options(device))
    env = DistEnv(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        device=device,
        comm_device=comm_device_for(device, served_device_types()),
        joined=True,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
    )
    if env.is_main:
        print(
            f"process group: {dist.get_backend()}, {world} rank(s), model on {device}, "
            f"collectives on {env.comm_device}",
            file=sys.stderr,
        )
    return env


def check_served(t: torch.Tensor, group=None) -> None:
    """Raise CollectiveDeviceError when `t` lies on a device the group's backend cannot serve."""
    served = served_device_types(group)
    if t.device.type not in served:
        raise CollectiveDeviceError(
            f"collective on a {t.device.type} tensor, but the process group's backend ({dist.get_backend(group)}) "
            f"serves only {', '.join(sorted(served))}"
        )


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum `t` over ranks; the result has `t`'s device and dtype (`t` itself is not modified)."""
    if not env.distributed:
        return t
    x = t.detach().to(env.comm_device, copy=True)
    check_served(x)
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x.to(t.device)


def all_reduce_sums(values: list[float], env: DistEnv) -> list[float]:
    """Sum a few Python numbers over ranks in one float64 collective."""
    if not env.distributed:
        return list(values)
    return all_reduce_sum(torch.tensor(values, dtype=torch.float64), env).tolist()


def all_reduce_int(x: int, env: DistEnv) -> int:
    """Sum an integer over ranks."""
    if not env.distributed:
        return int(x)
    return int(all_reduce_sum(torch.tensor([x], dtype=torch.int64), env).item())


def all_reduce_gradients(params, env: DistEnv, *, average: bool = True) -> None:
    """Sum (or average) the gradients of `params` over ranks, in place, in one flat collective.

    For trainers that call model pieces directly (RL estimators, the distillation student), where
    DDP's forward hook cannot see the backward; every rank must pass the same parameters in the
    same order. A parameter without a gradient on every rank contributes zeros."""
    if not env.distributed:
        return
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float() for p in params]
    )
    flat = all_reduce_sum(flat, env)
    if average:
        flat /= env.world_size
    offset = 0
    for p in params:
        n = p.numel()
        g = flat[offset : offset + n].view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
        offset += n


def barrier(env: DistEnv) -> None:
    if env.distributed:
        # nccl's barrier needs to know the device; gloo ignores device_ids
        dist.barrier(device_ids=[env.comm_device.index] if env.comm_device.type == "cuda" else None)


def broadcast_object(obj, env: DistEnv):
    """Rank 0's `obj` on every rank (pickled; moved through comm_device)."""
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=env.comm_device)
    return box[0]


def all_gather_object(obj, env: DistEnv) -> list:
    """Every rank's `obj` (pickled), in rank order, on every rank."""
    if not env.distributed:
        return [obj]
    out = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def side_group(env: DistEnv):
    """A second gloo group over every rank (every rank must call this at the same point): for
    collectives issued from a background thread (asynchronous checkpoint writes), which must not
    interleave with the training loop's collectives on the main group. None without a group."""
    if not env.distributed:
        return None
    return dist.new_group(backend="gloo")


def shutdown(env: DistEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()
