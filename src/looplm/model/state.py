"""Initial recurrent state s0 (design §2).

- "gaussian": N(0, 1/d) per element, fresh each forward (training);
- "seeded": a deterministic, stateless hash of (seed, example id, position, channel) mapped to
  N(0, 1/d), so an evaluation result does not depend on batch composition;
- "zero".
s0 never carries a gradient. `std` rescales the noise (default 1/sqrt(d)) and `truncate` maps each
standard normal monotonically onto the normal truncated at +-3 sigma (Huginn's state, design §14).
A model whose `cfg.state_init` is "input" starts from its prelude output instead (`LoopedLM.initial_state`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch

StateInit = Literal["gaussian", "seeded", "zero"]
_M32 = 0xFFFFFFFF


class StateStart(NamedTuple):
    """Where a forward's s^0 comes from (`LoopedLM.start_state`), the first that applies: `initial(e,
    rope, mask[, values=...])`, a prediction from the prelude output (the distilled prefill's
    student, design §9); `state0`, given (detached; trainers that draw a global batch's noise
    themselves); the model's own start (`LoopedLM.initial_state`: the prelude output for
    `cfg.state_init` "input", else the noise `init`, seeded by `seed`, `example_ids` and the
    positions, or drawn from `generator`). A tuple, so that a compiled step builds it freely."""

    init: StateInit = "gaussian"
    state0: torch.Tensor | None = None
    initial: Callable | None = None
    example_ids: torch.Tensor | None = None
    seed: int = 0
    generator: torch.Generator | None = None


def _mix32(h):
    """A 32-bit integer finalizer on int64 tensors or Python ints (values stay < 2^59, so no overflow)."""
    h = ((h >> 16) ^ h) * 0x45D9F3B & _M32
    h = ((h >> 16) ^ h) * 0x45D9F3B & _M32
    return (h >> 16) ^ h


def _mix32_(h: torch.Tensor) -> torch.Tensor:
    """`_mix32` of an int64 tensor, in place (one temporary at a time: the [B, L, d] hashes of a long
    batch are large)."""
    for _ in range(2):
        h.bitwise_xor_(h >> 16).mul_(0x45D9F3B).bitwise_and_(_M32)
    return h.bitwise_xor_(h >> 16)


def seeded_normal(
    example_ids: torch.Tensor, positions: torch.Tensor, dim: int, seed: int = 0, dtype=torch.float32
) -> torch.Tensor:
    """Standard normals [B, L, dim] that depend only on (seed, example id, position, channel). The
    [B, L, dim] steps run in place, so that at most three int64/float64 tensors of that shape are
    alive at once (the depth report's memory estimate, `looplm.eval.memory`, allows for them)."""
    dev = positions.device
    h = _mix32((seed & _M32) ^ 0x9E3779B9)  # a Python int: no host-to-device copy (CUDA graphs)
    h = _mix32(h ^ (example_ids.to(torch.int64).to(dev) & _M32))[:, None]  # [B, 1]
    h = _mix32(h ^ (positions.to(torch.int64) & _M32))[..., None]  # [B, L, 1]
    h1 = _mix32_(h ^ torch.arange(dim, dtype=torch.int64, device=dev))  # [B, L, d]
    h1 = _mix32_(h1.bitwise_xor_(0x85EBCA6B))
    h2 = _mix32_(h1 ^ 0xC2B2AE35)
    u1 = h1.to(torch.float64).add_(1.0).div_(2.0**32 + 1.0)  # in (0, 1): log is finite
    del h1
    radius = u1.log_().mul_(-2.0).sqrt_()
    angle = h2.to(torch.float64).div_(2.0**32).mul_(2.0 * math.pi).cos_()
    del h2
    return radius.mul_(angle).to(dtype)  # Box-Muller


def truncate_normal(z: torch.Tensor, bound: float = 3.0) -> torch.Tensor:
    """Standard normals -> normals truncated to [-bound, bound] through the CDF (monotone, so a
    seeded state stays a function of its hash): Phi^-1(Phi(-b) + Phi(z) (Phi(b) - Phi(-b)))."""
    z64 = z.to(torch.float64)
    lo = 0.5 * math.erfc(bound / math.sqrt(2.0))  # Phi(-b)
    u = 0.5 * torch.erfc(-z64 / math.sqrt(2.0))  # Phi(z), accurate in both tails
    p = lo + u * (1.0 - 2.0 * lo)
    return (math.sqrt(2.0) * torch.erfinv(2.0 * p - 1.0)).clamp(-bound, bound).to(z.dtype)


def initial_state(
    kind: StateInit,
    shape: tuple[int, int, int],
    *,
    device: torch.device,
    dtype: torch.dtype,
    example_ids: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    seed: int = 0,
    generator: torch.Generator | None = None,
    std: float | None = None,
    truncate: bool = False,
) -> torch.Tensor:
    """s0 of `shape` [B, L, d] scaled to standard deviation `std` (default 1/sqrt(d), design §2),
    truncated at +-3 std with `truncate`."""
    B, L, d = shape
    if kind == "zero":
        return torch.zeros(shape, device=device, dtype=dtype)
    if kind == "gaussian":
        gen_device = generator.device if generator is not None else device
        z = torch.randn(shape, generator=generator, device=gen_device, dtype=torch.float32)
    elif kind == "seeded":
        if example_ids is None:
            example_ids = torch.arange(B, device=device)
        if positions is None:
            positions = torch.arange(L, device=device).expand(B, L)
        z = seeded_normal(example_ids, positions, d, seed)
    else:
        raise ValueError(f"unknown state init {kind!r}; choose gaussian, seeded or zero")
    if truncate:
        z = truncate_normal(z)
    z = z / math.sqrt(d) if not std else z * std  # division as ever for the default (bit-identical states)
    return z.to(device=device, dtype=dtype)
