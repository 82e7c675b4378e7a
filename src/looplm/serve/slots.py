"""The serving engine's KV memory: one cache preallocated for `max_batch` sequences (design §15).

Running sequences occupy the first `n` batch rows (slots) of the pool, each with its own length.
A new sequence is prefilled into slot `n` through a one-row view of the pool; a one-token decode
step runs on the view of rows [0, n) cut at the longest row; when a sequence finishes, the last
running row is moved into its slot so the running rows stay contiguous (no gather per step).
Positions past a row's length are never read (every mask stops at the row's length), so a slot
needs no clearing when a new sequence takes it.
"""

from __future__ import annotations

import torch

from looplm.infer.cache import KVCache, make_cache


class SlotPool:
    """`max_batch` slots of `max_len` positions in a terminal or full cache."""

    def __init__(self, cfg, max_batch: int, max_len: int, *, mode: str, depth: int, device, dtype):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.cache = make_cache(mode, cfg, max_batch, max_len, depth, device=device, dtype=dtype)
        self.max_batch, self.max_len, self.mode, self.device = max_batch, max_len, mode, device
        self.lengths: list[int] = []  # cached tokens of each running slot, slot i at index i
        self.bytes_per_token = self.cache.nbytes // (max_batch * max_len)

    @property
    def running(self) -> int:
        return len(self.lengths)

    @property
    def free(self) -> int:
        return self.max_batch - self.running

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    @property
    def bytes_in_use(self) -> int:
        return sum(self.lengths) * self.bytes_per_token

    def claim(self) -> tuple[int, KVCache]:
        """A free slot and an empty one-row view of it to prefill."""
        if not self.free:
            raise RuntimeError("no free slot")
        slot = self.running
        self.lengths.append(0)
        return slot, self.cache.view(slice(slot, slot + 1))

    def set_length(self, slot: int, length: int) -> None:
        self.lengths[slot] = length

    def decode_view(self) -> KVCache:
        """Rows [0, running) with their per-row lengths, cut at the longest row + the new token."""
        lengths = torch.tensor(self.lengths, dtype=torch.long, device=self.device)
        return self.cache.view(slice(0, self.running), max_len=max(self.lengths) + 1, length=lengths)

    def save(self, slot: int, start: int, stop: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of `slot`'s entries at positions [start, stop) in every bank (`restore` puts it back)."""
        return [(b.k[slot, :, start:stop].clone(), b.v[slot, :, start:stop].clone()) for b in self.cache.banks()]

    def restore(self, slot: int, start: int, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write what `save` copied back at positions from `start` of `slot`."""
        for bank, (k, v) in zip(self.cache.banks(), saved, strict=True):
            bank.k[slot, :, start : start + k.shape[1]] = k
            bank.v[slot, :, start : start + v.shape[1]] = v

    def release(self, slot: int) -> int | None:
        """Free `slot`; the last running row moves into it. Returns the moved row's old slot (or None)."""
        last = self.running - 1
        if not 0 <= slot <= last:
            raise IndexError(f"slot {slot} is not running")
        moved = None
        if slot != last:
            n = self.lengths[last]
            for bank in self.cache.banks():
                bank.k[slot, :, :n] = bank.k[last, :, :n]
                bank.v[slot, :, :n] = bank.v[last, :, :n]
            self.lengths[slot] = n
            moved = last
        self.lengths.pop()
        return moved
