"""Initial-state noise of training: N(0, 1/d) per global row (or the model's own std and truncation,
`LoopedLM.initial_state`), drawn only for the rows a rank holds.

The noise of microbatch `micro` of step `step` is one generator stream seeded by (seed, step,
micro); global row r of the microbatch is the r-th [L, d] draw of that stream. A rank (or one
forward of a rank, when its rows are split into several) seeds the stream, advances it past the
rows before its own by drawing them into the memory its first row will use, and then draws its
rows. So the values depend on neither the number of ranks nor how rows are split into forwards,
and memory holds only the local rows (design §2 for the distribution).

On the CPU generator a draw of B rows at once equals B row draws whenever L * d is a multiple of
16 (torch fills normals in blocks of 16), so single-process CPU runs see the same noise as when
every rank drew the whole global microbatch in one call. CUDA's generator lays one call's values
out by the launch grid, so there the row-by-row stream differs from a one-call draw (same
distribution, other values).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from looplm.model.state import truncate_normal


def noise_seed(seed: int, step: int, micro: int) -> int:
    """Seed of the stream of microbatch `micro` of optimizer step `step`."""
    return int(np.random.SeedSequence([seed, step, micro, 0x5EED]).generate_state(1)[0])


def initial_state_noise(
    seed: int,
    step: int,
    micro: int,
    rows: range,
    seq_len: int,
    d_model: int,
    device: torch.device,
    *,
    std: float | None = None,
    truncate: bool = False,
) -> torch.Tensor:
    """Initial states s0 ~ N(0, 1/d) of global rows `rows` (a contiguous range) of a microbatch:
    [len(rows), seq_len, d_model] float32 on `device`; `std` replaces 1/sqrt(d) and `truncate`
    maps each draw onto the normal truncated at +-3 std, as the model's `state_std` and
    "trunc-normal" state do (`looplm.model.state`)."""
    if rows.step != 1 or rows.start < 0 or len(rows) < 1:
        raise ValueError(f"rows must be a non-empty contiguous range from 0 up, got {rows}")
    gen = torch.Generator(device=device).manual_seed(noise_seed(seed, step, micro))
    out = torch.empty((len(rows), seq_len, d_model), device=device)
    for _ in range(rows.start):  # advance the stream past the rows of lower ranks (and earlier forwards)
        out[0].normal_(generator=gen)
    for i in range(len(rows)):
        out[i].normal_(generator=gen)
    if truncate:
        out = truncate_normal(out)
    return out.mul_(std) if std else out.div_(math.sqrt(d_model))
