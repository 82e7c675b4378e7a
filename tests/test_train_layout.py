"""The global batch over ranks and forwards: every row once, forwards bounded, indivisible splits refused."""

from __future__ import annotations

import pytest

from looplm.errors import UserError
from looplm.train.layout import BatchLayout


@pytest.mark.parametrize(
    ("global_rows", "world", "max_rows"), [(8, 1, 8), (8, 2, 4), (8, 1, 2), (8, 1, 3), (12, 4, 2), (6, 3, 5), (7, 1, 2)]
)
def test_forwards_cover_every_global_row_once(global_rows, world, max_rows):
    rows = []
    for rank in range(world):
        layout = BatchLayout(global_rows, 2, world, rank, max_rows)
        forwards = layout.forwards()
        sizes = [len(f) for f in forwards]
        assert all(f.step == 1 for f in forwards) and max(sizes) <= max_rows and max(sizes) - min(sizes) <= 1
        assert len(forwards) == -(-(global_rows // world) // max_rows)  # as few forwards as the bound allows
        assert [r for f in forwards for r in f] == list(layout.rank_rows_range)
        rows += list(layout.rank_rows_range)
    assert rows == list(range(global_rows))
    assert BatchLayout(global_rows, 3, world, 0, max_rows).global_batch == 3 * global_rows


def test_a_split_that_does_not_divide_is_refused():
    """A resume on a number of ranks that does not divide the run's microbatch is the user's to fix (one
    `error:` line), not an internal error."""
    with pytest.raises(UserError, match="microbatch of 6 sequences.*does not split evenly over 4 ranks"):
        BatchLayout(6, 1, 4, 0, 2)
    with pytest.raises(ValueError, match="invalid"):
        BatchLayout(4, 1, 2, 2, 2)  # rank outside the world
    for sizes in ((4, 0, 1, 0, 2), (4, 1, 1, 0, 0), (0, 1, 1, 0, 2)):  # no microbatch, no rows a forward, no rows
        with pytest.raises(ValueError, match="invalid"):
            BatchLayout(*sizes)
