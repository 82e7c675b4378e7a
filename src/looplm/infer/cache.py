"""KV caches for incremental inference (design §7).

Both caches are preallocated and carry a length pointer: a chunk of n new tokens is written into
positions [length, length + n) of each bank, never concatenated.

- `TerminalCache`: one bank per *physical* attention layer (prelude layers, core layers, coda
  layers). A token's core banks hold its K/V from its *last* recurrence (its terminal K/V), and
  every recurrence of later tokens reads them. 1/2/1 blocks: 4 banks at any depth.
- `FullCache` (the baseline): one bank per layer *visit*: prelude, core layer j at recurrence r
  for r < depth, coda; 1 + 2R + 1 banks. A token at recurrence r reads the prefix's recurrence-r
  bank, which reproduces the parallel forward exactly when every chunk uses the cache's depth.
  Rule for other depths: a chunk run at fewer recurrences than the cache's depth fills its missing
  visits with its terminal K/V; a chunk run deeper than the cache reads the prefix's last visit
  bank for its extra recurrences and leaves its terminal K/V there.

A chunk's K/V are written into the bank its layer reads, at [length, length + n), before it
attends to [0, length + n) (see `Attention`); positions past `length` are scratch until the
pointer moves, so a recurrence whose K/V are not kept is simply overwritten by the next one.
"""

from __future__ import annotations

import copy

import torch

from looplm.config import ModelConfig
from looplm.errors import UserError
from looplm.model.kv import KVBank, KVSlot

__all__ = ["FullCache", "KVBank", "KVCache", "TerminalCache", "chunk_mask", "make_cache"]


def chunk_mask(prefix: int, n: int, device) -> torch.Tensor:
    """[1, 1, n, prefix + n]: every cached token, then causal within the chunk (bottom-right aligned)."""
    mask = torch.ones(n, prefix + n, dtype=torch.bool, device=device)
    mask[:, prefix:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return mask[None, None]


class KVCache:
    """Shared bookkeeping: banks for the prelude and coda, a length pointer, byte counts."""

    mode = "base"

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, *, device="cpu", dtype=torch.float32):
        if max_len > cfg.max_seq_len:
            raise UserError(f"cache length {max_len} exceeds the model context max_seq_len={cfg.max_seq_len}")
        self.cfg, self.batch, self.max_len, self.length = cfg, batch, max_len, 0
        self._new = lambda: KVBank(batch, cfg.n_kv_heads, max_len, cfg.head_dim, device, dtype)
        self.prelude = [self._new() for _ in range(cfg.n_prelude)]
        self.coda = [self._new() for _ in range(cfg.n_coda)]

    def banks(self) -> list[KVBank]:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.banks())

    def core_read(self, r: int, j: int) -> KVBank:
        """The bank core layer j reads at recurrence r (0-based)."""
        raise NotImplementedError

    # -- what the model's cached forward asks (looplm.model.kv.LayerCache) ----------------------
    def chunk(self, n: int, pad: torch.Tensor | None, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [B, n], mask [B or 1, 1, n, S]) of n new tokens after the `length` cached ones.

        `pad` [B] counts left-padding tokens at the start of each row (batched prompts of different
        lengths): no token attends to them and positions start at 0 at each row's first real token.
        With per-row lengths [B] (one-token steps of continuous batching) row b's token sits at
        position length_b and attends to its row's [0, length_b]."""
        c = self.length
        if n < 1:
            raise ValueError("a chunk needs at least one token")
        if isinstance(c, torch.Tensor):
            if n != 1 or pad is not None:
                raise ValueError("per-row cache lengths take one token per row, without padding")
            if int(c.max()) + 1 > self.max_len:
                raise ValueError(f"{int(c.max())} cached + 1 new token exceed the cache length {self.max_len}")
            positions = c.to(device)[:, None]
            mask = (torch.arange(self.max_len, device=device)[None, :] <= positions)[:, None, None, :]
            return positions, mask
        if c + n > self.max_len:
            raise ValueError(f"{c} cached + {n} new tokens exceed the cache length {self.max_len}")
        positions = (c + torch.arange(n, device=device)).expand(self.batch, n)
        mask = chunk_mask(c, n, device)
        if pad is not None:
            pad = pad.to(device)
            positions = (positions - pad[:, None]).clamp(min=0)
            real = torch.arange(c + n, device=device)[None, :] >= pad[:, None]  # [B, c+n] real keys
            own = torch.zeros(n, c + n, dtype=torch.bool, device=device)
            own[:, c:] = torch.eye(n, dtype=torch.bool, device=device)  # a pad query sees itself only
            mask = mask & (real[:, None, None, :] | own[None, None])
        return positions, mask

    def slot(self, stack: str, layer: int, recurrence: int = 0, keep: torch.Tensor | None = None) -> KVSlot:
        """The slot of one layer visit: the chunk is written at `length` in the bank the visit maps to;
        with `keep` [B, n] (the tokens still recurring) a stopped token's entry keeps its terminal K/V."""
        if stack == "core":
            return self.core_slot(recurrence, layer, keep)
        return getattr(self, stack)[layer].slot(self.length)

    def core_slot(self, r: int, j: int, keep: torch.Tensor | None) -> KVSlot:
        return self.core_read(r, j).slot(self.length, keep)

    def keep_terminal(
        self, n: int, recurrences: int, used: torch.Tensor | None = None, lowest: int | None = None
    ) -> None:
        """After a chunk of n tokens ran a loop of `recurrences` steps, `used` [B, n] recurrences per
        token (None: all of them; `lowest` a known lower bound of them): every bank a token reads later holds its terminal K/V. The terminal
        cache has them already (a stopped token's writes are masked, `slot(keep=...)`); the full cache
        fills the visits a token did not reach (design §7)."""

    def advance(self, n: int) -> None:
        self.length = self.length + n

    def view(self, rows: slice, max_len: int | None = None, length=None) -> "KVCache":
        """The same cache restricted to batch rows `rows` and positions [0, max_len): its banks are
        views, so what runs on it writes here (the serving engine's slots). `length` is the view's
        pointer (an int, or per-row lengths [rows] for one-token steps)."""
        view = copy.copy(self)
        view.max_len = self.max_len if max_len is None else max_len
        view.batch = len(range(*rows.indices(self.batch)))
        view.length = 0 if length is None else length

        def cut(bank: KVBank) -> KVBank:
            return KVBank.of(bank.k[rows, :, : view.max_len], bank.v[rows, :, : view.max_len])

        view.prelude, view.coda = [cut(b) for b in self.prelude], [cut(b) for b in self.coda]
        view.core = [cut(b) for b in self.core] if self.mode == "terminal" else [[cut(b) for b in v] for v in self.core]
        return view

    def take(self, rows: torch.Tensor) -> "KVCache":
        """A new cache holding copies of batch rows `rows` [b] (in that order), same length."""
        out = copy.copy(self)
        out.batch = rows.shape[0]
        out.length = self.length[rows] if isinstance(self.length, torch.Tensor) else self.length

        def pick(bank: KVBank) -> KVBank:
            return KVBank.of(bank.k[rows], bank.v[rows])

        out.prelude, out.coda = [pick(b) for b in self.prelude], [pick(b) for b in self.coda]
        out.core = (
            [pick(b) for b in self.core] if self.mode == "terminal" else [[pick(b) for b in v] for v in self.core]
        )
        out._new = None  # a taken cache grows no new banks
        return out


class TerminalCache(KVCache):
    mode = "terminal"

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, **kw):
        super().__init__(cfg, batch, max_len, **kw)
        self.core = [self._new() for _ in range(cfg.n_core)]

    def banks(self):
        return [*self.prelude, *self.core, *self.coda]

    def core_read(self, r, j):
        return self.core[j]  # design §7: every recurrence reads the terminal bank; the last one's K/V stay


class FullCache(KVCache):
    mode = "full"

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, depth: int, **kw):
        super().__init__(cfg, batch, max_len, **kw)
        if depth < 1:
            raise UserError(f"full cache depth must be >= 1, got {depth}")
        self.depth = depth
        self.core = [[self._new() for _ in range(cfg.n_core)] for _ in range(depth)]

    def banks(self):
        return [*self.prelude, *(b for visit in self.core for b in visit), *self.coda]

    def core_read(self, r, j):
        return self.core[min(r, self.depth - 1)][j]

    def core_slot(self, r, j, keep):
        # a stopped token's visit-r entry is its terminal K/V, i.e. its entry of visit r - 1 (filled
        # the same way when it stopped earlier), so chunk siblings read what a later token will
        fallback = self.core[r - 1][j] if keep is not None and 0 < r < self.depth else None
        return self.core_read(r, j).slot(self.length, keep, fallback)

    def keep_terminal(self, n, recurrences, used=None, lowest=None):
        # visits a token did not reach take its terminal K/V: in order, visit v copies visit v - 1 where
        # used <= v, so each entry ends with the K/V of the token's last recurrence (a no-op where the
        # loop's masked writes already did it)
        if lowest is None:  # the caller may know a bound (no host sync)
            lowest = recurrences if used is None else int(used.min())
        for v in range(max(lowest, 1), self.depth):
            stopped = None if used is None else used <= v
            for j in range(self.cfg.n_core):
                self.core[v][j].write(self.length, self.core[v - 1][j].read(self.length, n), keep=stopped)


def make_cache(mode: str, cfg: ModelConfig, batch: int, max_len: int, depth: int, **kw) -> KVCache:
    if mode == "terminal":
        return TerminalCache(cfg, batch, max_len, **kw)
    if mode == "full":
        return FullCache(cfg, batch, max_len, depth, **kw)
    raise UserError(f"unknown cache mode {mode!r}; choose terminal or full")
