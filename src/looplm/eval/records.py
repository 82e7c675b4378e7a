"""Evaluation items from JSONL files: one JSON object per line, with errors that name file:line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from looplm.errors import UserError


def read_records(path: str | Path, required: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """Yield ("file:line", object) for every non-blank line; ValueError on invalid JSON, a
    non-object line or a missing required field."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{where}: invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise UserError(f"{where}: expected a JSON object")
            for key in required:
                if key not in row:
                    raise UserError(f"{where}: missing field {key!r}")
            yield where, row
