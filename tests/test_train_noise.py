"""Initial-state noise of training: per global row, the same on any number of ranks, drawn only locally."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from looplm.train.noise import initial_state_noise, noise_seed

CPU = torch.device("cpu")


def one_call_draw(seed, step, micro, rows, L, d):
    """The global microbatch's noise as every rank used to draw it: one randn call of the whole
    [rows, L, d] from the (seed, step, micro) generator, divided by sqrt(d)."""
    gen = torch.Generator().manual_seed(noise_seed(seed, step, micro))
    return torch.randn((rows, L, d), generator=gen) / math.sqrt(d)


def split_draw(world, global_rows, L, d, seed=0, step=3, micro=1):
    share = global_rows // world
    return torch.cat(
        [initial_state_noise(seed, step, micro, range(r * share, (r + 1) * share), L, d, CPU) for r in range(world)]
    )


@pytest.mark.parametrize(("L", "d"), [(64, 32), (256, 128)])
def test_ranks_draw_the_rows_of_the_single_process_draw(L, d):
    """1, 2 and 4 ranks see the same global microbatch of noise, equal (bitwise) to one call's draw on
    the CPU generator (L * d a multiple of 16), so single-process runs keep their trajectories."""
    ref = one_call_draw(0, 3, 1, 8, L, d)
    for world in (1, 2, 4, 8):
        assert torch.equal(split_draw(world, 8, L, d), ref), world
    assert not torch.equal(split_draw(2, 8, L, d, step=4), ref)  # the stream does depend on the step


def test_split_into_forwards_or_ranks_is_the_same_for_any_shape():
    """Whatever the shape (here L * d not a multiple of 16), any split of the rows into ranks or
    forwards draws the same rows: each row is its own draw of one stream."""
    L, d = 7, 5
    whole = initial_state_noise(0, 0, 0, range(6), L, d, CPU)
    uneven = [range(0, 1), range(1, 4), range(4, 6)]
    assert torch.equal(torch.cat([initial_state_noise(0, 0, 0, r, L, d, CPU) for r in uneven]), whole)
    assert torch.equal(split_draw(3, 6, L, d, step=0, micro=0), whole)
    assert abs(whole.std().item() * math.sqrt(d) - 1) < 0.15  # N(0, 1/d)


class StorageRecorder(TorchDispatchMode):
    """The bytes of every tensor storage an op returns while active."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.sizes.append(t.untyped_storage().nbytes())
        return out


def largest_storage(fn) -> int:
    with StorageRecorder() as rec:
        fn()
    return max(rec.sizes)


def test_noise_memory_is_per_rank():
    """The last rank of 1..16 ranks (the one that skips the most rows) holds only its own rows: the
    largest tensor it creates is its [2, L, d] output, whatever the world size; the one-call draw
    of the global microbatch grows with the ranks."""
    L, d, rows = 32, 16, 2
    local = rows * L * d * 4
    for world in (1, 2, 4, 16):
        last = range((world - 1) * rows, world * rows)
        assert largest_storage(lambda: initial_state_noise(0, 1, 0, last, L, d, CPU)) == local, world
    # the recorder sees what the old draw allocated: the whole global microbatch
    assert largest_storage(lambda: one_call_draw(0, 1, 0, 16 * rows, L, d)[-rows:]) == 16 * local


def test_rows_must_be_a_contiguous_range():
    with pytest.raises(ValueError, match="contiguous"):
        initial_state_noise(0, 0, 0, range(0, 4, 2), 4, 4, CPU)
    with pytest.raises(ValueError, match="contiguous"):
        initial_state_noise(0, 0, 0, range(2, 2), 4, 4, CPU)
    with pytest.raises(ValueError, match="contiguous"):  # no row before row 0 (was drawn as row 0)
        initial_state_noise(0, 0, 0, range(-1, 2), 4, 4, CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ranks_draw_the_same_rows():
    cuda = torch.device("cuda")
    whole = initial_state_noise(0, 2, 1, range(8), 64, 128, cuda)
    parts = [initial_state_noise(0, 2, 1, range(r * 2, r * 2 + 2), 64, 128, cuda) for r in range(4)]
    assert torch.equal(torch.cat(parts), whole)


def test_each_microbatch_step_and_seed_has_its_own_stream():
    """The noise of (seed, step, micro) differs from every other triple's and is uncorrelated with it
    (checked by correlation, not by the seed function), and the same triple draws the same noise."""
    L, d = 64, 32
    keys = [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (1, 0, 0)]
    draws = [initial_state_noise(*k, range(2), L, d, CPU) for k in keys]
    assert torch.equal(draws[1], initial_state_noise(0, 0, 1, range(2), L, d, CPU))
    corr = torch.corrcoef(torch.cat(draws).flatten(1))  # 12 rows of L * d values
    assert (corr - torch.eye(len(keys) * 2)).abs().max() < 0.15, corr  # 7 standard deviations of 2048 values


@pytest.mark.parametrize("std", [None, 0.5])
def test_truncation_applies_with_the_default_and_an_explicit_std(std):
    """ "trunc-normal" with the default std 1/sqrt(d) (state_std 0) is truncated too: every value within
    +-3 std, the std of a standard normal cut at +-3 (0.98658) times the scale, and the cut is a monotone
    map of the untruncated draw (it keeps the order of the values)."""
    L, d = 64, 32
    scale = std if std else 1 / math.sqrt(d)
    raw = initial_state_noise(0, 0, 0, range(4), L, d, CPU, std=std)
    cut = initial_state_noise(0, 0, 0, range(4), L, d, CPU, std=std, truncate=True)
    assert float(raw.abs().max()) > 3 * scale  # 8192 draws: some lie past 3 std, so the cut shows
    assert float(cut.abs().max()) <= 3 * scale * (1 + 1e-6)
    assert abs(float(cut.std()) / scale - 0.98658) < 0.02
    in_raw_order = cut.flatten()[raw.flatten().argsort()]
    assert bool((in_raw_order.diff() >= 0).all())
