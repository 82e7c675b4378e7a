"""Training progress where it goes: a tqdm bar on a terminal, one plain line every `every_s` seconds
otherwise (nohup, CI, SLURM logs), instead of a bar's carriage-return redraws joined into one line."""

from __future__ import annotations

import sys
import time


class LineProgress:
    """The part of tqdm's interface the trainer uses (`update`, `set_postfix`, `write`, `close`),
    printing `desc: step n/total (p%), key=value ...` at most every `every_s` seconds and at the end."""

    def __init__(self, total: int, initial: int = 0, desc: str = "train", every_s: float = 30.0, file=None):
        self.total, self.n, self.desc, self.every_s = total, initial, desc, every_s
        self.file = file or sys.stderr
        self.postfix: dict = {}
        self._last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.every_s or self.n >= self.total:
            self._last = now
            self._print()

    def set_postfix(self, **values) -> None:
        self.postfix = values

    def write(self, line: str) -> None:
        print(line, file=self.file, flush=True)

    def close(self) -> None:
        pass

    def _print(self) -> None:
        extra = "".join(f", {k}={v}" for k, v in self.postfix.items())
        print(
            f"{self.desc}: step {self.n}/{self.total} ({100 * self.n / max(self.total, 1):.0f}%){extra}",
            file=self.file,
            flush=True,
        )


def progress_bar(total: int, initial: int, desc: str, unit: str = "step"):
    """A tqdm bar when stderr is a terminal, else `LineProgress`."""
    if not sys.stderr.isatty():
        return LineProgress(total, initial, desc)
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True)
