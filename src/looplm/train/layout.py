"""How one optimizer step's global batch is laid out over ranks and forwards.

A step is `grad_accum` microbatches. A microbatch is `global_rows` consecutive sequences of the
data order, with one depth draw and one noise stream (`looplm.train.noise`) whose rows are
numbered 0..global_rows-1. Rank k holds rows [k * n, (k + 1) * n) with n = global_rows /
world_size and runs them in forwards of at most `max_rows` (train.micro_batch) sequences, so the
loss (a token mean over the global batch) and the gradient do not depend on the split beyond the
order of float sums.

A fresh run has global_rows = micro_batch x world size. A resumed run keeps the global_rows of its
checkpoint, so it can continue on another number of ranks with the same data, depth draws and
noise: fewer ranks run more (or larger) forwards per microbatch, more ranks smaller ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from looplm.errors import UserError


@dataclass(frozen=True)
class BatchLayout:
    global_rows: int
    """Sequences per microbatch over all ranks."""
    grad_accum: int
    """Microbatches per optimizer step (one depth draw each)."""
    world_size: int = 1
    rank: int = 0
    max_rows: int = 1
    """Most sequences one forward of a rank runs (train.micro_batch)."""

    def __post_init__(self):
        sizes = (self.global_rows, self.grad_accum, self.world_size, self.max_rows)
        if min(sizes) < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"invalid batch layout {self}")
        if self.global_rows % self.world_size:
            raise UserError(
                f"the run's microbatch of {self.global_rows} sequences over all ranks (train.micro_batch x "
                f"ranks when it started) does not split evenly over {self.world_size} ranks; resume on a "
                f"number of ranks that divides {self.global_rows}"
            )

    @property
    def rank_rows(self) -> int:
        """Sequences of each microbatch this rank holds."""
        return self.global_rows // self.world_size

    @property
    def rank_rows_range(self) -> range:
        """Global rows of a microbatch this rank holds."""
        return range(self.rank * self.rank_rows, (self.rank + 1) * self.rank_rows)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all ranks."""
        return self.global_rows * self.grad_accum

    def forwards(self) -> list[range]:
        """Global rows of each forward of this rank per microbatch: its rows in as few forwards of at
        most max_rows as possible, of sizes differing by at most one (few distinct shapes to compile)."""
        n = -(-self.rank_rows // self.max_rows)
        base, extra = divmod(self.rank_rows, n)
        out, start = [], self.rank_rows_range.start
        for i in range(n):
            size = base + (i < extra)
            out.append(range(start, start + size))
            start += size
        return out
