"""Document sources: the task generator, built-in corpora, text files, folders, JSONL and HF datasets."""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from looplm.errors import UserError, install_hint

from .corpus import CORPORA, describe_corpus, iter_corpus
from .tasks import DEFAULT_TASK_EXAMPLES, TaskConfig, generate_examples

MAX_CHUNK_CHARS = 64 * 1024
"""Text files larger than this are split on blank lines into documents of about this size."""
TEXT_SUFFIXES = (".txt", ".md")
"""File suffixes collected from folder sources."""


class DataError(UserError):
    """Bad or unusable training data (one-line, user-facing message)."""


@dataclass
class Document:
    """A text and where its supervised part starts."""

    text: str
    answer_start: int | None = None
    """Character index where the supervised answer begins; ``None`` supervises all of it."""


def _iter_text_file(path: Path) -> Iterator[Document]:
    """One document per file; large files split at blank lines into ~64 KB pieces."""
    try:
        if path.stat().st_size <= MAX_CHUNK_CHARS:
            text = path.read_text(encoding="utf-8")
            if text.strip():
                yield Document(text)
            return
        buf: list[str] = []
        size = 0
        with path.open(encoding="utf-8") as f:
            for line in f:
                buf.append(line)
                size += len(line)
                # Cut at a paragraph break once big enough; force a cut if a paragraph
                # never ends so memory stays bounded.
                if (size >= MAX_CHUNK_CHARS and not line.strip()) or size >= 16 * MAX_CHUNK_CHARS:
                    text = "".join(buf)
                    if text.strip():
                        yield Document(text)
                    buf, size = [], 0
        text = "".join(buf)
        if text.strip():
            yield Document(text)
    except UnicodeDecodeError:
        raise DataError(_not_utf8(path)) from None


def _not_utf8(path: Path) -> str:
    """The error of a file that is not UTF-8, with the file offset of its first bad byte (a streaming
    decoder's own offset counts from its current chunk)."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            pending = len(decoder.getstate()[0])  # bytes of a character begun in the chunk before
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                return f"{path} is not valid UTF-8 (byte offset {offset - pending + exc.start})"
            offset += len(chunk)
    return f"{path} is not valid UTF-8 (it ends inside a character)"


def _iter_jsonl(path: Path, text_field: str) -> Iterator[Document]:
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
                if not isinstance(record, dict) or text_field not in record:
                    raise DataError(f"{path}:{lineno}: no field {text_field!r}")
                text = record[text_field]
                if not isinstance(text, str):
                    raise DataError(f"{path}:{lineno}: field {text_field!r} is not a string")
                try:  # JSON may escape half of a surrogate pair (a cut emoji), which is no text
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise DataError(
                        f"{path}:{lineno}: field {text_field!r} holds a lone surrogate {text[exc.start]!r} "
                        f"at character {exc.start} (half of an escaped pair), which is no UTF-8 text"
                    ) from None
                if text.strip():
                    yield Document(text)
    except UnicodeDecodeError:
        raise DataError(_not_utf8(path)) from None


def _folder_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)


def _parse_hf(source: str) -> tuple[str, str]:
    rest = source[len("hf:") :]
    name, _, split = rest.partition(":")
    if not name:
        raise DataError(f"bad source {source!r}: expected 'hf:<name>[:<split>]'")
    return name, split or "train"


def _iter_hf(source: str, text_field: str) -> Iterator[Document]:
    for i, record in enumerate(_load_hf(source)):
        if text_field not in record:
            raise DataError(f"{source}: record {i} has no field {text_field!r}")
        text = record[text_field]
        if isinstance(text, str) and text.strip():
            yield Document(text)


def _load_hf(source: str):
    """The locally cached dataset of an hf:<name>[:<split>] source."""
    name, split = _parse_hf(source)
    # Never touch the network: only a locally cached dataset may be used.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise DataError(f"source {source!r} needs the 'datasets' package: {install_hint('datasets')}") from None
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as exc:  # datasets raises many unrelated types
        raise DataError(f"cannot load cached dataset {name!r} split {split!r}: {exc}".splitlines()[0]) from None


def _iter_raw(
    source: str, text_field: str, task_config: TaskConfig | None, n_task_examples: int, seed: int
) -> Iterator[Document]:
    if source == "tasks":
        for ex in generate_examples(task_config or TaskConfig(), n_task_examples, seed):
            yield Document(ex.text, answer_start=len(ex.prompt))
        return
    if source in CORPORA:
        yield from (Document(text) for text in iter_corpus(source))
        return
    if source.startswith("hf:"):
        yield from _iter_hf(source, text_field)
        return
    path = Path(source)
    if not path.exists():
        raise DataError(f"data source not found: {source}")
    if path.is_dir():
        for file in _folder_files(path):
            yield from _iter_text_file(file)
    elif path.suffix.lower() == ".jsonl":
        yield from _iter_jsonl(path, text_field)
    else:
        yield from _iter_text_file(path)


def iter_documents(
    source: str,
    *,
    text_field: str = "text",
    task_config: TaskConfig | None = None,
    n_task_examples: int = DEFAULT_TASK_EXAMPLES,
    seed: int = 0,
) -> Iterator[Document]:
    """Yield the non-empty documents of ``source``.

    ``source`` is ``"tasks"`` (the procedural generator, ``n_task_examples`` examples
    from ``seed``), the name of a built-in corpus (``"shakespeare"``), a text file, a folder (all ``*.txt``/``*.md`` recursively, sorted),
    a ``.jsonl`` file (``text_field`` of each line) or ``"hf:<name>[:<split>]"``.
    Raises :class:`DataError` on missing, empty or malformed sources.
    """
    empty = True
    for doc in _iter_raw(source, text_field, task_config, n_task_examples, seed):
        empty = False
        yield doc
    if empty:
        raise DataError(f"data source {source!r} has no non-empty document")


def describe_source(
    source: str,
    *,
    text_field: str = "text",
    task_config: TaskConfig | None = None,
    n_task_examples: int = DEFAULT_TASK_EXAMPLES,
    seed: int = 0,
) -> str:
    """A string that changes whenever the documents of ``source`` may change.

    Files are identified by resolved path, size and mtime, so edits invalidate caches.
    """
    if source == "tasks":
        cfg = asdict(task_config or TaskConfig())
        return json.dumps({"source": "tasks", "config": cfg, "n": n_task_examples, "seed": seed}, sort_keys=True)
    if source in CORPORA:
        return describe_corpus(source)
    if source.startswith("hf:"):
        name, split = _parse_hf(source)
        # the dataset's own fingerprint (datasets derives it from its files): a changed local copy is new data
        fingerprint = getattr(_load_hf(source), "_fingerprint", None)
        desc = {"source": "hf", "name": name, "split": split, "field": text_field, "fingerprint": fingerprint}
        return json.dumps(desc, sort_keys=True)
    path = Path(source)
    if not path.exists():
        raise DataError(f"data source not found: {source}")
    files = _folder_files(path) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(path) if path.is_dir() else f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    desc = {"source": str(path.resolve()), "files": len(files), "stat": h.hexdigest()}
    if path.is_file() and path.suffix.lower() == ".jsonl":
        desc["field"] = text_field
    return json.dumps(desc, sort_keys=True)
