"""What wraps the single-device model for training, applied from outside it (torchtitan's order):
activation checkpointing, then `torch.compile`, then data parallelism (DDP, FSDP2 or HSDP).

The model never learns it is wrapped: blocks are replaced by checkpointing wrappers or compiled
in place, and the depth loop stays in Python, so a drawn depth R in 1..64 replays the same
compiled block and injection graphs R times instead of tracing a graph per depth.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from looplm.errors import UserError
from looplm.train.distributed import DistEnv

ActivationCheckpointing = Literal["none", "block"]
STACKS = ("prelude", "core", "coda")


def blocks(model: nn.Module) -> list[nn.Module]:
    """Every transformer block of the model, in forward order (prelude, core, coda)."""
    return [b for stack in STACKS for b in getattr(model, stack)]


def apply_activation_checkpointing(model: nn.Module, mode: ActivationCheckpointing) -> None:
    """'block': each block keeps only its input for backward and recomputes its insides, so the
    saved activations of full BPTT at depth R shrink from ~R x (everything inside the core blocks)
    to ~R x n_core x one [B, L, d] state."""
    if mode == "none":
        return
    if mode != "block":
        raise UserError(f"unknown activation checkpointing {mode!r}; choose none or block")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for stack in STACKS:
        layers = getattr(model, stack)
        for i, block in enumerate(layers):
            layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)  # blocks draw no randomness


def apply_compile(model: nn.Module) -> None:
    """Compile every block and the injection in place (`nn.Module.compile`).

    Blocks share one code object, so one graph per (grad mode, mask kind) serves the prelude,
    every core visit at every recurrence, and the coda."""
    for block in blocks(model):
        block.compile(fullgraph=True)
    model.injection.compile()


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far: a recompile (a guard that failed, e.g. a
    new mask kind, grad mode or shape) adds one; the same code on another module instance does not.
    (dynamo's frame count misses guard-failure recompiles of an already compiled frame.)"""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def wrap_model(model: nn.Module, env: DistEnv, parallel: str, *, param_dtype: torch.dtype | None = None) -> nn.Module:
    """DDP, FSDP2 or HSDP around a single-device model; the model itself without a process group.

    FSDP2/HSDP with `param_dtype=torch.bfloat16` computes in bf16 and reduces gradients in fp32
    (the master weights and optimizer state stay fp32). HSDP shards within a node
    (LOCAL_WORLD_SIZE ranks) and replicates across nodes."""
    if not env.distributed:
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
    if parallel in ("fsdp", "hsdp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = None
        if parallel == "hsdp":
            from torch.distributed.device_mesh import init_device_mesh

            shard = env.local_world_size
            if env.world_size % shard:
                raise UserError(f"hsdp: world size {env.world_size} is not a multiple of the ranks per node {shard}")
            mesh = init_device_mesh(env.device.type, (env.world_size // shard, shard),
                                    mesh_dim_names=("replicate", "shard"))
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
        for block in blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model
    raise UserError(f"unknown parallel mode {parallel!r}; choose ddp, fsdp or hsdp")
