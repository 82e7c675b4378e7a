"""What wraps the single-device model for training, applied from outside it (torchtitan's order):
activation checkpointing, then `torch.compile`, then data parallelism (DDP, FSDP2 or HSDP).

The model never learns it is wrapped: blocks are replaced by checkpointing wrappers or compiled
in place, and the depth loop stays in Python, so a drawn depth R in 1..64 replays the same
compiled block and injection graphs R times instead of tracing a graph per depth.
"""

from __future__ import annotations

import contextlib
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


# Graphs one compiled block may need: grad / no-grad (the truncated-backprop prefix) x input that does or does
# not require grad x mask kinds (plain causal, boolean, FlexAttention block mask) x a few shapes (training,
# evaluation, a last short batch). dynamo's default limit (8) is a hard error under fullgraph=True.
RECOMPILE_LIMIT = 64


def apply_compile(model: nn.Module, backend: str = "inductor") -> None:
    """Compile every block and the injection in place (`nn.Module.compile`), static shapes.

    Blocks share one code object and are called with one signature (`block(x, rope, mask, **kw)`),
    so one graph per (grad mode, mask kind, shape) serves the prelude, every core visit at every
    recurrence, and the coda. `dynamic=False`: a new shape compiles a static graph (the trainer
    runs fixed shapes) instead of a dynamic-shape one; up to RECOMPILE_LIMIT graphs per block.
    `backend` is torch.compile's ("inductor"; tests and dry runs may use "aot_eager")."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), RECOMPILE_LIMIT))
    for block in blocks(model):
        block.compile(fullgraph=True, dynamic=False, backend=backend)
    model.injection.compile(dynamic=False, backend=backend)


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

        # injection none: the prelude output enters only through s0 (state_init input) or not at all, so a
        # step deeper than the backprop window leaves the prelude and embedding without a gradient
        unused = model.cfg.injection == "none"
        return DDP(
            model, device_ids=[env.local_rank] if env.device.type == "cuda" else None, find_unused_parameters=unused
        )
    if parallel in ("fsdp", "hsdp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

        mesh = None
        if parallel == "hsdp":
            from torch.distributed.device_mesh import init_device_mesh

            shard = env.local_world_size
            if env.world_size % shard:
                raise UserError(f"hsdp: world size {env.world_size} is not a multiple of the ranks per node {shard}")
            mesh = init_device_mesh(
                env.device.type, (env.world_size // shard, shard), mesh_dim_names=("replicate", "shard")
            )
        # cast_forward_inputs=False: the residual stream and the recurrent state enter every block as they
        # are (fp32, as under DDP with autocast), not cast to bf16; autocast casts the matmul inputs
        mp = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None, cast_forward_inputs=False
        )
        core = {id(block) for block in model.core}
        for block in blocks(model):
            # a core block runs at every recurrence: resharded after each run, it would be all-gathered R
            # times per forward; kept gathered from its first run, once (backward still gathers it per run)
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=id(block) not in core)
        if param_dtype is not None and any(True for _ in model.injection.parameters()):
            # the injection's decay and scales act elementwise on the state at every recurrence: fp32, as
            # under DDP (autocast casts matmul inputs only); bf16 rounding would move the fixed point
            fp32 = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
            fully_shard(model.injection, mesh=mesh, mp_policy=fp32)
            for method in ("prepare", "qkv_offsets", "exit"):  # called by the model directly, not via forward:
                register_fsdp_forward_method(model.injection, method)  # each must gather the parameters too
        fully_shard(model, mesh=mesh, mp_policy=mp)
        if param_dtype is not None:
            keep_stream_fp32(model)
        return model
    raise UserError(f"unknown parallel mode {parallel!r}; choose ddp, fsdp or hsdp")


def keep_stream_fp32(model: nn.Module) -> None:
    """Cast the token embedding's output to fp32.

    Under DDP the parameters stay fp32 and bf16 autocast computes the matmuls, so the embedding rows,
    the residual stream and the recurrent state carried through R recurrences are fp32. FSDP2 with
    bf16 parameters would hand out bf16 rows and carry the state in bf16; with this hook (and
    `cast_forward_inputs=False`) it carries the same dtypes as DDP."""
    model.embed.register_forward_hook(lambda _module, _inputs, out: out.float())


@contextlib.contextmanager
def gradient_sync(model: nn.Module, env: DistEnv, parallel: str, sync: bool):
    """Run a microbatch's forward and backward with (`sync`) or without the gradient reduction across
    ranks: accumulation micro-steps skip it (DDP `no_sync`, FSDP2/HSDP `set_requires_gradient_sync`),
    the last microbatch of a step reduces the accumulated gradients once."""
    if not env.distributed:
        yield
    elif parallel == "ddp":
        with contextlib.nullcontext() if sync else model.no_sync():
            yield
    else:
        model.set_requires_gradient_sync(sync)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
