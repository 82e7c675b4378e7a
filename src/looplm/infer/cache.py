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


class KVBank:
    """K (after RoPE) and V of up to `max_len` tokens: [B, H_kv, max_len, head_dim] each."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, device, dtype):
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor) -> "KVBank":
        """A bank over existing tensors (views of a larger bank: writes land in it)."""
        bank = cls.__new__(cls)
        bank.k, bank.v = k, v
        return bank

    def buffer(self, length) -> tuple[torch.Tensor, torch.Tensor, int | torch.Tensor]:
        """(K, V, length) for attention to write a chunk at `length` and read [0, length + n)."""
        return self.k, self.v, length

    def write(self, start, kv: tuple[torch.Tensor, torch.Tensor], keep: torch.Tensor | None = None) -> None:
        """Write a chunk's K/V [B, H, n, hd] at `start` (an int, or per-row starts [B] for n = 1);
        with `keep` [B, n] only where it is True."""
        rows = None if isinstance(start, int) else torch.arange(self.k.shape[0], device=self.k.device)
        for buf, new in zip((self.k, self.v), kv):
            n = new.shape[2]
            old = buf[:, :, start:start + n] if rows is None else buf[rows, :, start][:, :, None]
            if keep is not None:
                new = torch.where(keep[:, None, :, None], new, old)
            if rows is None:
                buf[:, :, start:start + n] = new
            else:
                buf[rows, :, start] = new[:, :, 0]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


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

    def keep_terminal(self, j: int, start, kv, used: torch.Tensor, early: bool) -> None:
        """After a chunk: core layer j's terminal K/V `kv` (each token's last recurrence), `used` [B, n]
        recurrences per token, go to every bank of layer j that a token's recurrences did not write.
        `early`: some token may have stopped before the chunk's last recurrence (its later,
        discarded recurrences then overwrote the banks it reads)."""
        raise NotImplementedError

    def view(self, rows: slice, max_len: int | None = None, length=None) -> "KVCache":
        """The same cache restricted to batch rows `rows` and positions [0, max_len): its banks are
        views, so what runs on it writes here (the serving engine's slots). `length` is the view's
        pointer (an int, or per-row lengths [rows] for one-token steps)."""
        view = copy.copy(self)
        view.max_len = self.max_len if max_len is None else max_len
        view.batch = len(range(*rows.indices(self.batch)))
        view.length = 0 if length is None else length

        def cut(bank: KVBank) -> KVBank:
            return KVBank.of(bank.k[rows, :, :view.max_len], bank.v[rows, :, :view.max_len])

        view.prelude, view.coda = [cut(b) for b in self.prelude], [cut(b) for b in self.coda]
        view.core = [cut(b) for b in self.core] if self.mode == "terminal" else [[cut(b) for b in v] for v in self.core]
        return view


class TerminalCache(KVCache):
    mode = "terminal"

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, **kw):
        super().__init__(cfg, batch, max_len, **kw)
        self.core = [self._new() for _ in range(cfg.n_core)]

    def banks(self):
        return [*self.prelude, *self.core, *self.coda]

    def core_read(self, r, j):
        return self.core[j]  # design §7: every recurrence reads the terminal bank; the last one's K/V stay

    def keep_terminal(self, j, start, kv, used, early):
        if early:  # a token that stopped early: its exit recurrence's K/V, not later scratch
            self.core[j].write(start, kv)  # otherwise the last recurrence already left exactly `kv` here


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

    def keep_terminal(self, j, start, kv, used, early):
        for v in range(int(used.min()), self.depth):  # visits a shallower token did not reach
            self.core[v][j].write(start, kv, keep=used <= v)


def make_cache(mode: str, cfg: ModelConfig, batch: int, max_len: int, depth: int, **kw) -> KVCache:
    if mode == "terminal":
        return TerminalCache(cfg, batch, max_len, **kw)
    if mode == "full":
        return FullCache(cfg, batch, max_len, depth, **kw)
    raise UserError(f"unknown cache mode {mode!r}; choose terminal or full")
