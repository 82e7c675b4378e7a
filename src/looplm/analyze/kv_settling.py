"""KV settling: how much each core layer's keys and values still move deep in the recurrence (design §11).

For core layer j at depth r with span k: |K_j^(r+k) - K_j^r| / |K_j^r| (Frobenius norm over every
token of the batch; the same for V), where K_j^r are the keys layer j computes during recurrence r
(the paper: 1.23% at r = 25 and 0.59% at r = 160 for k = 5), and |K_j^r| / |K_j^(r0)|, the KV norm
relative to the first reported depth r0 (default 5).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from looplm.errors import UserError


def kv_recurrences(depths: Sequence[int], span: int) -> tuple[int, ...]:
    """The recurrences whose K/V the settling table needs: each depth r and r + span."""
    if span < 1:
        raise UserError(f"KV span must be >= 1, got {span}")
    if not depths or min(depths) < 1:
        raise UserError(f"KV depths must be >= 1, got {tuple(depths)}")
    return tuple(sorted({r for d in depths for r in (d, d + span)}))


class KVSums:
    """Accumulates squared norms over batches so that ratios are over all tokens together."""

    def __init__(self, depths: Sequence[int], span: int):
        self.depths, self.span = tuple(sorted(set(depths))), span
        kv_recurrences(self.depths, span)
        self.diff: dict = {}
        self.norm: dict = {}

    def add(self, kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """`kv`: recurrence -> per core layer (K, V), as recorded by `run_trajectory`."""
        for r in self.depths:
            for j, (now, later) in enumerate(zip(kv[r], kv[r + self.span])):
                for name, a, b in (("K", now[0], later[0]), ("V", now[1], later[1])):
                    key = (r, j, name)
                    self.diff[key] = self.diff.get(key, 0.0) + float((b.double() - a.double()).square().sum())
                    self.norm[key] = self.norm.get(key, 0.0) + float(a.double().square().sum())

    def table(self) -> list[dict]:
        """Rows {"layer", "depth", "K_change", "V_change", "K_norm_ratio", "V_norm_ratio"}."""
        r0 = self.depths[0]
        layers = sorted({j for _, j, _ in self.diff})
        rows = []
        for j in layers:
            for r in self.depths:
                row = {"layer": j, "depth": r}
                for name in ("K", "V"):
                    norm = self.norm[(r, j, name)]
                    row[f"{name}_change"] = (self.diff[(r, j, name)] / norm) ** 0.5 if norm > 0 else None
                    base = self.norm[(r0, j, name)]
                    row[f"{name}_norm_ratio"] = (norm / base) ** 0.5 if base > 0 else None
                rows.append(row)
        return rows


def kv_settling(kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], depths: Sequence[int], span: int) -> list[dict]:
    """The settling table of one recorded trajectory (see `KVSums.table`)."""
    sums = KVSums(depths, span)
    sums.add(kv)
    return sums.table()
