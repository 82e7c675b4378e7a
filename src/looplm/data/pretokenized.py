"""Pre-tokenized corpora: tokenize once with ``looplm tokenize``, then train from the folder.

Start-up tokenization (:func:`~looplm.data.packing.prepare_caches`) makes the first run on a
corpus -- and every run after its cache key changes -- pay for tokenizing all of it before the
first step, on the main rank while the others wait. For corpora too large for that, the
tokenization is done once, ahead of time, into a self-contained folder::

    OUT/pretokenized.json       marker, written last: format, source, tokenizer, counts
    OUT/tokenizer_config.json   the tokenizer (Tokenizer.save; plus tokenizer.json for BPE)
    OUT/train/, OUT/val/        the splits, in the memory-mapped cache format of
                                looplm.data.packing (tokens.bin, supervised.bin,
                                doc_starts.npy, meta.json)

The splits are written by the same code as the start-up cache, so they are byte-identical to
what ``prepare_caches`` writes for the same source, tokenizer, holdout and seed.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from looplm.errors import UserError

from .packing import CACHE_VERSION, PackedDataset, write_splits
from .sources import DataError, describe_source, iter_documents
from .staging import staging_folder
from .tasks import DEFAULT_TASK_EXAMPLES, TaskConfig
from .tokenizer import Tokenizer, build_tokenizer, load_tokenizer

PRETOKENIZED_VERSION = 1
"""Version of the folder layout and marker; bumped when readers of older folders would misread them."""
MARKER_FILE = "pretokenized.json"
SPLITS = ("train", "val")
_FORMAT = "looplm-pretokenized"


# --------------------------------------------------------------------------- reading


def is_pretokenized(source: str | Path) -> bool:
    """True when ``source`` is a folder with a pretokenized marker.

    Only the marker is looked at, so this is cheap enough to dispatch on any ``--data.source``
    (``'tasks'`` and ``'hf:...'`` are simply not folders); :func:`open_pretokenized` checks
    that the rest of the folder is sound.
    """
    return (Path(source) / MARKER_FILE).is_file()


def pretokenized_info(source: str | Path) -> dict[str, Any]:
    """The marker of a pretokenized folder (see :func:`tokenize_corpus` for its fields).

    Raises :class:`DataError` when the marker is missing, unreadable or from another version.
    """
    root = Path(source)
    path = root / MARKER_FILE
    if not path.is_file():
        raise DataError(f"{root} is not a pretokenized folder (no {MARKER_FILE}); make one with `looplm tokenize`")
    try:
        info = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path} is unreadable ({exc}); re-run `looplm tokenize`") from None
    if not isinstance(info, dict) or info.get("format") != _FORMAT:
        raise DataError(f"{path} is not a looplm pretokenized marker; re-run `looplm tokenize`")
    version = info.get("version")
    if version != PRETOKENIZED_VERSION:
        raise DataError(
            f"{root} has pretokenized format version {version}, this looplm reads version "
            f"{PRETOKENIZED_VERSION}; re-run `looplm tokenize`"
        )
    missing = [k for k in ("tokenizer_fingerprint", "splits", "cache_version") if k not in info]
    if missing or not isinstance(info["splits"], dict):
        raise DataError(f"{path} lacks {', '.join(missing) or 'splits'}; re-run `looplm tokenize`")
    if info["cache_version"] != CACHE_VERSION:
        raise DataError(
            f"{root} holds token caches of version {info['cache_version']}, this looplm reads version "
            f"{CACHE_VERSION}; re-run `looplm tokenize`"
        )
    return info


def _check_split(root: Path, split: str, info: dict[str, Any], fingerprint: str) -> None:
    """Cheap consistency checks of one split (no token is read): a truncated copy or a split
    written with another tokenizer would otherwise train on garbage without any error."""
    folder = root / split
    hint = "the folder is incomplete or damaged; re-run `looplm tokenize`"
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        raise DataError(f"{root}: no {split} split ({split}/meta.json is missing); {hint}")
    try:
        meta = json.loads(meta_path.read_text())
        n_tokens, n_docs, dtype = int(meta["n_tokens"]), int(meta["n_docs"]), np.dtype(str(meta["dtype"]))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{meta_path} is unreadable ({exc}); {hint}") from None
    if meta.get("version") != CACHE_VERSION:
        raise DataError(f"{meta_path}: cache version {meta.get('version')}, expected {CACHE_VERSION}; {hint}")
    if meta.get("tokenizer") != fingerprint:
        raise DataError(
            f"{root}: the {split} split was written with tokenizer {str(meta.get('tokenizer'))[:12]}, but the "
            f"folder's tokenizer is {fingerprint[:12]}; {hint}"
        )
    counts = info["splits"].get(split) or {}
    if counts.get("tokens") != n_tokens or counts.get("docs") != n_docs:
        raise DataError(f"{root}: {split}/meta.json disagrees with {MARKER_FILE} on the counts; {hint}")
    sizes = {"tokens.bin": n_tokens * dtype.itemsize, "supervised.bin": n_tokens}
    for name, size in sizes.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            found = f"{path.stat().st_size} bytes" if path.is_file() else "missing"
            raise DataError(f"{path}: expected {size} bytes, found {found}; {hint}")
    try:
        starts = np.load(folder / "doc_starts.npy", mmap_mode="r")
    except (OSError, ValueError) as exc:
        raise DataError(f"{folder / 'doc_starts.npy'} is unreadable ({exc}); {hint}") from None
    if starts.shape != (n_docs,):
        raise DataError(f"{folder / 'doc_starts.npy'}: {starts.shape[0]} documents, expected {n_docs}; {hint}")


def _validate(root: Path) -> tuple[dict[str, Any], Tokenizer]:
    """Marker and tokenizer of a sound pretokenized folder, else :class:`DataError`."""
    info = pretokenized_info(root)
    try:
        tokenizer = load_tokenizer(root)
    except ValueError as exc:
        raise DataError(f"{root}: cannot load its tokenizer ({exc}); re-run `looplm tokenize`") from None
    fingerprint = tokenizer.fingerprint()
    if fingerprint != info["tokenizer_fingerprint"]:
        raise DataError(
            f"{root}: the saved tokenizer ({fingerprint[:12]}) is not the one the splits were written with "
            f"({str(info['tokenizer_fingerprint'])[:12]}); re-run `looplm tokenize`"
        )
    for split in SPLITS:
        _check_split(root, split, info, fingerprint)
    return info, tokenizer


def open_pretokenized(source: str | Path, seq_len: int) -> tuple[Tokenizer, PackedDataset, PackedDataset]:
    """The tokenizer and the train and validation datasets of a pretokenized folder.

    The tokenizer is the one the splits were written with, so a trainer must use it (and its
    vocabulary size) instead of building one from its own settings. Raises
    :class:`DataError` on a missing, incomplete or inconsistent folder.
    """
    root = Path(source)
    _, tokenizer = _validate(root)
    return tokenizer, PackedDataset(root / "train", seq_len), PackedDataset(root / "val", seq_len)


# --------------------------------------------------------------------------- writing


def _existing_state(out: Path) -> str:
    """'absent', 'empty' or 'finished'; anything else in the way is refused, so a typo in the
    output path can never delete or mix into unrelated files."""
    if not out.exists():
        return "absent"
    if not out.is_dir():
        raise UserError(f"output {out} exists and is not a folder")
    if is_pretokenized(out):
        return "finished"
    if any(out.iterdir()):
        raise UserError(f"output folder {out} is not empty and is not a pretokenized folder; choose a new or empty one")
    return "empty"


def _install(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``, replacing an empty or earlier pretokenized folder.

    Renames within one parent are atomic, so ``out`` is at every moment either the old
    folder, absent, or the complete new one -- never a partly written folder with a marker.
    """
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{secrets.token_hex(4)}"
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


class _DocProgress:
    """A tqdm bar fed by :data:`looplm.data.packing.ProgressFn` calls: first the counting pass
    (no total), then tokenization against the document total."""

    def __init__(self) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(
            desc="reading documents", unit="doc", dynamic_ncols=True, leave=False, file=sys.stderr, disable=None
        )  # None: off when stderr is not a terminal
        self.counting = True

    def __call__(self, done: int, total: int | None) -> None:
        if total is not None and self.counting:
            self.counting = False
            self.bar.reset(total=total)
            self.bar.set_description("tokenizing")
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def _same_tokenizer(old_tok: Tokenizer, tok: Tokenizer | None) -> bool:
    """Whether a given tokenizer is the folder's (which a request for a BPE to train, recorded as such, hides)."""
    return tok is not None and tok.fingerprint() == old_tok.fingerprint()


def _differences(
    info: dict[str, Any],
    old_tok: Tokenizer,
    source: str,
    request: dict[str, Any],
    tok: Tokenizer | None,
    bpe_vocab_size: int,
) -> list[str]:
    """What differs between the inputs of the folder with marker `info` (and tokenizer `old_tok`) and a
    new request, in words: "holdout 0.5 (the folder's: 0.25)"."""
    old = info.get("request") or {}
    out = []
    if old.get("source") != request["source"]:
        same = os.path.abspath(str(info.get("source"))) == os.path.abspath(source)
        out.append(
            "the source's files changed since (sizes or times)"
            if same
            else f"source {source} (the folder's: {info.get('source')})"
        )
    if old.get("tokenizer") != request["tokenizer"] and not _same_tokenizer(old_tok, tok):
        new = tok.summary() if tok is not None else f"bpe, vocabulary {bpe_vocab_size}, to be trained"
        out.append(f"tokenizer {new} (the folder's: {old_tok.summary()})")
    out += [
        f"{key} {request[key]} (the folder's: {old.get(key)})"
        for key in ("holdout", "seed")
        if old.get(key) != request[key]
    ]
    return out


def tokenize_corpus(
    source: str | Path,
    out_dir: str | Path,
    *,
    tokenizer: str = "byte",
    bpe_vocab_size: int = 4096,
    holdout: float = 0.05,
    text_field: str = "text",
    seed: int = 0,
    n_task_examples: int = DEFAULT_TASK_EXAMPLES,
    task_config: TaskConfig | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Tokenize ``source`` once into the pretokenized folder ``out_dir``; return its path.

    ``source`` is anything :func:`~looplm.data.sources.iter_documents` reads; ``tokenizer`` is
    ``'byte'``, ``'bpe'`` (trained on the corpus, ``bpe_vocab_size`` ids, exactly as the trainer
    would) or a path to a ``tokenizer.json`` or saved tokenizer folder. The held-out split is the
    one ``prepare_caches`` would draw for the same ``holdout`` and ``seed``.

    ``out_dir`` must be new, empty, or an earlier pretokenized folder: one made from the same
    source (paths, sizes, mtimes), tokenizer request, holdout and seed is kept as it is (nothing
    is tokenized), as is one whose tokenizer is the given one; one made from other inputs is
    refused, naming what differs (runs trained on it would no longer read it), unless
    ``overwrite``, which replaces it; a damaged one is rebuilt. Everything is written into a
    temporary sibling folder that is renamed into place only when complete, so an interrupted run
    never leaves a folder that looks finished. ``progress`` shows a documents bar on stderr.

    The marker ``pretokenized.json`` records: ``format``, ``version``, ``cache_version``, the
    ``source`` as given and its ``source_description``, ``tokenizer`` (name),
    ``tokenizer_fingerprint``, ``vocab_size``, ``eos_id``, ``splits`` (``{split: {tokens, docs,
    dtype}}``), ``holdout``, ``seed``, ``text_field``, ``n_task_examples``, the ``request`` used to
    recognise an up-to-date folder, and ``created`` (UTC).
    """
    source = str(source)
    out = Path(os.path.abspath(out_dir))  # a name and a parent even for "." or "dir/"
    if not 0.0 < holdout < 1.0:
        raise UserError(f"holdout must be in (0, 1), got {holdout}")
    state = _existing_state(out)
    opts: dict[str, Any] = dict(
        text_field=text_field, task_config=task_config, n_task_examples=n_task_examples, seed=seed
    )
    desc = describe_source(source, **opts)
    # A given tokenizer is cheap to load and is identified by content; a BPE to be trained is
    # identified by its request, since training it is the expensive part being skipped.
    tok = None if tokenizer == "bpe" else build_tokenizer(tokenizer, None, bpe_vocab_size)
    request = {
        "source": desc,
        "tokenizer": tok.fingerprint() if tok is not None else f"bpe-{bpe_vocab_size}",
        "holdout": holdout,
        "seed": seed,
    }
    if state == "finished":
        try:
            info, old_tok = _validate(out)
        except DataError:
            info = None  # damaged: rebuild it
        differs = None if info is None else _differences(info, old_tok, source, request, tok, bpe_vocab_size)
        if differs == []:
            return out
        if differs and not overwrite:
            raise UserError(
                f"{out} was tokenized from other inputs: {'; '.join(differs)}. Runs trained on it "
                "would no longer read it; choose another folder, or --overwrite to replace it"
            )
    if tok is None:
        if progress:
            print(f"training a {bpe_vocab_size}-id BPE tokenizer on {source} ...", file=sys.stderr, flush=True)
        tok = build_tokenizer("bpe", lambda: (doc.text for doc in iter_documents(source, **opts)), bpe_vocab_size)

    tmp = staging_folder(out.parent, out.name)
    bar = _DocProgress() if progress else None
    try:
        metas = write_splits(source, tok, tmp, holdout=holdout, source_desc=desc, progress=bar, **opts)
        tok.save(tmp)
        info = {
            "format": _FORMAT,
            "version": PRETOKENIZED_VERSION,
            "cache_version": CACHE_VERSION,
            "source": source,
            "source_description": desc,
            "tokenizer": tok.name,
            "tokenizer_fingerprint": tok.fingerprint(),
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "splits": {
                split: {"tokens": meta["n_tokens"], "docs": meta["n_docs"], "dtype": meta["dtype"]}
                for split, meta in metas.items()
            },
            "holdout": holdout,
            "seed": seed,
            "text_field": text_field,
            "n_task_examples": n_task_examples,
            "request": request,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        # The marker is the last file written: without it the folder is not pretokenized.
        (tmp / MARKER_FILE).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return out
