"""Where an attention layer's keys and values go: the slot interface of the cached forward (design §7).

An attention layer computes this chunk's K (after RoPE) and V, hands them to its *slot* with
`update(k, v)` and attends to what the slot returns. The model never knows which cache it has:

- no slot: the chunk attends to itself (the parallel forward);
- `KVBank.slot(start, keep=...)`: a preallocated bank [B, H_kv, max_len, hd]; the chunk is written
  in place at [start, start + n) and attention reads [0, start + n) (or, for per-row starts [B] and
  one token per row, the whole bank under the caller's mask). With `keep` [B, n] only the tokens
  still recurring write: a stopped token's entry keeps its terminal K/V, taken from its own bank
  or, where the cache says so, from the bank of the visit before (`fallback`);
- `RowsView(rows).slot(bank_slot)`: the rows of a one-token step that still recur, on their
  gathered copy of the bank (gathered once per bank while the rows stay the same);
- `KVRecord(inner)`: keeps the chunk's K/V (diagnostics, and the terminal cache's bookkeeping)
  and passes them on to `inner` (or attends to the chunk alone).

Which bank a layer visit writes (one per physical layer, or one per visit) is the cache's
business (`looplm.infer.cache`); the model asks its cache for a slot per visit.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVSlot(Protocol):
    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this chunk's K/V [B, H_kv, n, hd]; return the keys and values to attend to."""


class LayerCache(Protocol):
    """What the cached forward asks of a cache (see `looplm.infer.cache.KVCache`)."""

    def chunk(self, n: int, pad: torch.Tensor | None, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [B, n], boolean mask [B or 1, 1, n, S]) of n new tokens after the cached ones."""

    def slot(self, stack: str, layer: int, recurrence: int = 0, keep: torch.Tensor | None = None) -> KVSlot:
        """The slot of one layer visit ("prelude", "core" at a 0-based recurrence, "coda"); `keep`
        [B, n]: the tokens still recurring (a stopped token's entry keeps its terminal K/V)."""

    def keep_terminal(
        self, n: int, recurrences: int, used: torch.Tensor | None = None, lowest: int | None = None
    ) -> None:
        """After a chunk of n tokens ran `recurrences` loop steps (`used` [B, n] per token, None: all):
        every bank a token reads later holds its terminal K/V (a full cache fills unreached visits)."""

    def advance(self, n: int) -> None:
        """The chunk's n tokens are now cached."""


class KVBank:
    """K (after RoPE) and V of up to `max_len` tokens: [B, H_kv, max_len, head_dim] each."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, device, dtype):
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor) -> KVBank:
        """A bank over existing tensors (views of a larger bank: writes land in it)."""
        bank = cls.__new__(cls)
        bank.k, bank.v = k, v
        return bank

    def slot(
        self, start: int | torch.Tensor, keep: torch.Tensor | None = None, fallback: KVBank | None = None
    ) -> BankSlot:
        """The slot of a chunk that starts at `start` (an int, or per-row starts [B] for one token per
        row); with `keep` [B, n] only those tokens write, the others keep `fallback`'s entry (default:
        this bank's own)."""
        return BankSlot(self, start, keep, fallback)

    def read(self, start: int | torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V [B, H, n, hd] stored at [start, start + n) (or from per-row starts [B])."""
        if isinstance(start, torch.Tensor):
            rows = torch.arange(self.k.shape[0], device=self.k.device)[:, None]
            pos = start[:, None] + torch.arange(n, device=start.device)  # [B, n]
            return self.k[rows, :, pos].transpose(1, 2), self.v[rows, :, pos].transpose(1, 2)
        return self.k[:, :, start : start + n], self.v[:, :, start : start + n]

    def write(
        self,
        start: int | torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        keep: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        fallback: KVBank | None = None,
    ) -> None:
        """Write a chunk's K/V [B, H, n, hd] at `start` (an int, or per-row starts [B]);
        with `keep` [B, n] only where it is True (elsewhere `fallback`'s entry, default the old one);
        with `rows` [b] the chunk holds those batch rows only."""
        per_row = isinstance(start, torch.Tensor)
        sel = (
            rows
            if rows is not None
            else (torch.arange(self.k.shape[0], device=self.k.device) if per_row else slice(None))
        )
        at = start[sel] if per_row else start
        source = fallback if fallback is not None else self
        for buf, src, new in zip((self.k, self.v), (source.k, source.v), kv):
            n = new.shape[2]
            if per_row and n != 1:  # a chunk per row at its own start (the static step's verify chunk)
                if keep is not None:
                    raise ValueError("per-row chunks of several tokens take no keep mask")
                pos = at[:, None] + torch.arange(n, device=at.device)  # [b, n]
                buf[sel[:, None].expand(-1, n), :, pos] = new.transpose(1, 2)  # indexed as [b, n, H, hd]
                continue
            if keep is not None:
                old = src[sel, :, at][:, :, None] if per_row else src[sel, :, start : start + n]
                new = torch.where(keep[:, None, :, None], new, old)
            if per_row:
                buf[sel, :, at] = new[:, :, 0]
            else:
                buf[sel, :, start : start + n] = new

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class BankSlot:
    """A chunk's place in a bank: `update` writes it in place, then returns what attention reads."""

    def __init__(
        self, bank: KVBank, start: int | torch.Tensor, keep: torch.Tensor | None = None, fallback: KVBank | None = None
    ):
        self.bank, self.start, self.keep, self.fallback = bank, start, keep, fallback

    def update(self, k, v):
        self.bank.write(self.start, (k, v), keep=self.keep, fallback=self.fallback)
        if isinstance(self.start, torch.Tensor):
            return self.bank.k, self.bank.v  # per-row lengths: the caller's mask marks each row's [0, start_b]
        end = self.start + k.shape[2]
        return self.bank.k[:, :, :end], self.bank.v[:, :, :end]


class RowsView:
    """Batch rows `rows` [b] of the banks a one-token step visits, for the recurrences that only
    some rows still run (design §13, §16). Each bank's rows are gathered once and reused while the set
    of rows stays the same (the terminal cache visits one bank per core layer at every
    recurrence); a visit writes its token's K/V into the gathered rows and through to the bank."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows
        self._gathered: dict[int, KVBank] = {}

    def slot(self, slot: BankSlot) -> RowsSlot:
        bank = slot.bank
        local = self._gathered.get(id(bank))
        if local is None:
            end = None if isinstance(slot.start, torch.Tensor) else slot.start + 1
            local = self._gathered[id(bank)] = KVBank.of(bank.k[self.rows, :, :end], bank.v[self.rows, :, :end])
        start = slot.start[self.rows] if isinstance(slot.start, torch.Tensor) else slot.start
        return RowsSlot(local.slot(start), bank, slot.start, self.rows)


class RowsSlot:
    """The slot of some rows: reads and writes their gathered copy, and writes through to the bank."""

    def __init__(self, local: BankSlot, bank: KVBank, start: int | torch.Tensor, rows: torch.Tensor):
        self.local, self.bank, self.start, self.rows = local, bank, start, rows

    def update(self, k, v):
        self.bank.write(self.start, (k, v), rows=self.rows)
        return self.local.update(k, v)


class KVRecord:
    """A slot that keeps the chunk's K/V (`.kv`) and passes them on to `inner`, or attends to them alone."""

    def __init__(self, inner: KVSlot | None = None):
        self.inner, self.kv = inner, None

    def update(self, k, v):
        self.kv = (k, v)
        return self.inner.update(k, v) if self.inner is not None else (k, v)
