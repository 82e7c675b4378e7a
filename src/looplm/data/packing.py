"""Token caches on disk, packed fixed-length sequences and a stateless sampler.

A cache directory holds one split:

* ``tokens.bin``      -- all token ids, each document followed by ``eos_id``
  (``uint16`` when ``vocab_size <= 65535``, else ``uint32``);
* ``supervised.bin``  -- ``uint8`` per token, 1 where the token is a valid *target*;
* ``doc_starts.npy``  -- ``int64`` offset of each document's first token;
* ``meta.json``       -- dtype, counts, tokenizer fingerprint, source description.

Sequences are windows of ``seq_len + 1`` tokens with stride ``seq_len``; attention
and positions are segmented per document inside a row (see :class:`Batch`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from looplm.errors import UserError

from .sources import DataError, Document, describe_source, iter_documents
from .staging import staging_folder
from .tasks import DEFAULT_TASK_EXAMPLES, Example, TaskConfig, generate_examples
from .tokenizer import Tokenizer

CACHE_VERSION = 1
IGNORE_INDEX = -100
_ENCODE_CHUNK_DOCS = 256  # documents tokenized (and written) per chunk


# --------------------------------------------------------------------------- cache writing


class _CacheWriter:
    """Streams tokenized documents to the files of one split through buffered writes."""

    def __init__(self, directory: Path, dtype: np.dtype) -> None:
        directory.mkdir(parents=True)
        self.directory = directory
        self.dtype = dtype
        self._tokens = open(directory / "tokens.bin", "wb", buffering=1 << 20)
        self._supervised = open(directory / "supervised.bin", "wb", buffering=1 << 20)
        self._starts = array("q")  # 8 bytes per document, far smaller than the tokens
        self.n_tokens = 0

    def add(self, ids: Sequence[int], supervised: np.ndarray) -> None:
        """Append one document (``ids`` already ends with eos)."""
        self._starts.append(self.n_tokens)
        self._tokens.write(np.asarray(ids, dtype=self.dtype).tobytes())
        self._supervised.write(supervised.astype(np.uint8, copy=False).tobytes())
        self.n_tokens += len(ids)

    def close(self, meta: dict[str, object]) -> dict[str, object]:
        """Flush everything and write ``doc_starts.npy`` and ``meta.json`` last; return the meta."""
        self._tokens.close()
        self._supervised.close()
        np.save(self.directory / "doc_starts.npy", np.frombuffer(self._starts, dtype=np.int64))
        meta = dict(meta, dtype=np.dtype(self.dtype).name, n_tokens=self.n_tokens, n_docs=len(self._starts))
        (self.directory / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
        return meta

    def abort(self) -> None:
        self._tokens.close()
        self._supervised.close()


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def _write_docs(
    docs: Iterable[tuple[Document, int]],
    tokenizer: Tokenizer,
    writers: Sequence[_CacheWriter],
    on_chunk: Callable[[int], None] | None = None,
) -> None:
    """Tokenize ``(document, writer index)`` pairs in chunks and append them to ``writers``;
    ``on_chunk(n)`` is told after each chunk how many documents it wrote."""
    eos = tokenizer.eos_id
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]  # a released tokenizer's beginning of text
    chunk: list[tuple[Document, int]] = []

    def flush() -> None:
        # Prompt and answer are encoded separately so the answer span is token-aligned,
        # exactly as at inference time where the prompt is encoded on its own.
        pieces: list[str] = []
        for doc, _ in chunk:
            if doc.answer_start is None:
                pieces.append(doc.text)
            else:
                pieces += [doc.text[: doc.answer_start], doc.text[doc.answer_start :]]
        encoded = iter(tokenizer.encode_batch(pieces))
        for doc, which in chunk:
            if doc.answer_start is None:
                ids = bos + next(encoded) + [eos]
                sup = np.ones(len(ids), dtype=np.uint8)
                sup[: len(bos)] = 0
            else:
                prompt, answer = bos + next(encoded), next(encoded)
                ids = prompt + answer + [eos]
                sup = np.zeros(len(ids), dtype=np.uint8)
                sup[len(prompt) :] = 1
            writers[which].add(ids, sup)
        if on_chunk is not None and chunk:
            on_chunk(len(chunk))
        chunk.clear()

    for item in docs:
        chunk.append(item)
        if len(chunk) >= _ENCODE_CHUNK_DOCS:
            flush()
    flush()


def _task_splits(config: TaskConfig, n_train: int, holdout: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Train and validation task sets from different seeds; validation prompts seen in
    training are dropped so validation measures generalisation, not recall."""
    train = generate_examples(config, n_train, seed)
    n_val = max(1, round(n_train * holdout))
    val_seed = int.from_bytes(hashlib.sha256(f"looplm-val-{seed}".encode()).digest()[:8], "little")
    seen = {ex.prompt for ex in train}
    val = [ex for ex in generate_examples(config, n_val, val_seed) if ex.prompt not in seen]
    return train, val


ProgressFn = Callable[[int, int | None], None]
"""``progress(documents, total)``: documents counted (``total`` None) or written so far."""
_COUNT_REPORT_EVERY = 4096  # documents between progress reports of the counting pass


def write_splits(
    source: str,
    tokenizer: Tokenizer,
    directory: Path,
    *,
    holdout: float,
    text_field: str = "text",
    task_config: TaskConfig | None = None,
    n_task_examples: int = DEFAULT_TASK_EXAMPLES,
    seed: int = 0,
    source_desc: str | None = None,
    progress: ProgressFn | None = None,
) -> dict[str, dict[str, object]]:
    """Tokenize ``source`` into ``directory/train`` and ``directory/val``; return each split's meta.

    The one writer behind both the content-keyed start-up cache (:func:`prepare_caches`) and
    ``looplm tokenize`` (:mod:`looplm.data.pretokenized`), so both produce identical files for
    the same inputs. The split folders must not exist yet. It does not clean up after a
    failure: callers write into a temporary folder that they remove or move into place.
    ``progress`` (see :data:`ProgressFn`) lets long runs report how far they are.
    """
    if not 0.0 < holdout < 1.0:
        raise UserError(f"holdout must be in (0, 1), got {holdout}")
    opts = dict(text_field=text_field, task_config=task_config, n_task_examples=n_task_examples, seed=seed)
    desc = source_desc if source_desc is not None else describe_source(source, **opts)  # type: ignore[arg-type]
    directory = Path(directory)
    dtype = _token_dtype(tokenizer.vocab_size)
    writers = [_CacheWriter(directory / "train", dtype), _CacheWriter(directory / "val", dtype)]
    try:
        if source == "tasks":
            train, val = _task_splits(task_config or TaskConfig(), n_task_examples, holdout, seed)
            if not val:
                raise DataError("task validation set is empty: every validation prompt also occurs in training")
            n_docs = len(train) + len(val)
            docs: Iterable[tuple[Document, int]] = [
                (Document(ex.text, answer_start=len(ex.prompt)), which)
                for which, exs in ((0, train), (1, val))
                for ex in exs
            ]
        else:
            # First pass only counts documents, so the held-out set can be an exact,
            # deterministic fraction without holding the corpus in memory.
            n_docs = 0
            for _ in iter_documents(source, **opts):  # type: ignore[arg-type]
                n_docs += 1
                if progress is not None and n_docs % _COUNT_REPORT_EVERY == 0:
                    progress(n_docs, None)
            if n_docs < 2:
                raise DataError(f"data source {source!r} has 1 document; a held-out split needs at least 2")
            n_val = min(n_docs - 1, max(1, round(n_docs * holdout)))
            is_val = np.zeros(n_docs, dtype=bool)
            is_val[np.random.default_rng([seed, n_docs]).choice(n_docs, n_val, replace=False)] = True
            docs = ((doc, int(is_val[i])) for i, doc in enumerate(iter_documents(source, **opts)))  # type: ignore[arg-type]
        written = 0

        def on_chunk(n: int) -> None:
            nonlocal written
            written += n
            if progress is not None:
                progress(written, n_docs)

        if progress is not None:
            progress(0, n_docs)
        _write_docs(docs, tokenizer, writers, on_chunk)
        return {
            split: writer.close(
                {
                    "version": CACHE_VERSION,
                    "split": split,
                    "source": desc,
                    "tokenizer": tokenizer.fingerprint(),
                    "tokenizer_name": tokenizer.name,
                    "vocab_size": tokenizer.vocab_size,
                    "eos_id": tokenizer.eos_id,
                }
            )
            for split, writer in zip(("train", "val"), writers)
        }
    except BaseException:
        for w in writers:
            w.abort()
        raise


def _cache_folder(source: str, tokenizer: Tokenizer, holdout: float, cache_dir: Path, opts: dict) -> tuple[Path, str]:
    """(the cache folder of these inputs, the source description its key covers)."""
    if not 0.0 < holdout < 1.0:
        raise UserError(f"holdout must be in (0, 1), got {holdout}")
    desc = describe_source(source, **opts)
    key_material = json.dumps(
        {
            "v": CACHE_VERSION,
            "source": desc,
            "tokenizer": tokenizer.fingerprint(),
            "holdout": holdout,
            "seed": opts["seed"],
        },
        sort_keys=True,
    )
    return cache_dir / hashlib.sha256(key_material.encode()).hexdigest()[:32], desc


def caches_ready(
    source: str,
    tokenizer: Tokenizer,
    *,
    holdout: float = 0.05,
    cache_dir: Path = Path(".cache/looplm"),
    text_field: str = "text",
    task_config: TaskConfig | None = None,
    n_task_examples: int = DEFAULT_TASK_EXAMPLES,
    seed: int = 0,
) -> bool:
    """Whether :func:`prepare_caches` with these arguments would reuse a finished cache (no tokenizing)."""
    opts = dict(text_field=text_field, task_config=task_config, n_task_examples=n_task_examples, seed=seed)
    final, _ = _cache_folder(source, tokenizer, holdout, Path(cache_dir), opts)
    return all((final / split / "meta.json").is_file() for split in ("train", "val"))


def prepare_caches(
    source: str,
    tokenizer: Tokenizer,
    *,
    holdout: float = 0.05,
    cache_dir: Path = Path(".cache/looplm"),
    text_field: str = "text",
    task_config: TaskConfig | None = None,
    n_task_examples: int = DEFAULT_TASK_EXAMPLES,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Build (or reuse) the train and validation token caches; return their directories.

    The cache key covers the source description (file paths, sizes, mtimes), the
    tokenizer fingerprint and every option that changes the token stream, so a second
    call with the same inputs reuses the cache without tokenizing. The cache is built
    in a temporary directory and moved into place atomically.
    """
    opts = dict(text_field=text_field, task_config=task_config, n_task_examples=n_task_examples, seed=seed)
    final, desc = _cache_folder(source, tokenizer, holdout, Path(cache_dir), opts)
    cache_dir, key = final.parent, final.name
    train_dir, val_dir = final / "train", final / "val"
    if (train_dir / "meta.json").is_file() and (val_dir / "meta.json").is_file():
        return train_dir, val_dir

    tmp = staging_folder(cache_dir, key)
    try:
        write_splits(source, tokenizer, tmp, holdout=holdout, source_desc=desc, **opts)  # type: ignore[arg-type]
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process (e.g. another rank) finished the same cache first.
            if not (train_dir / "meta.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return train_dir, val_dir


# --------------------------------------------------------------------------- reading


@dataclass
class Batch:
    """A batch of packed sequences (int64 tensors of shape ``[B, L]`` unless noted).

    ``targets`` is ``-100`` where the target is not supervised or lies in another
    document than the input token. ``doc_ids`` numbers document segments within a row
    (0 for the first) -- attention must not cross segments. ``positions`` restart at 0
    at each document start (and at the row start). ``example_ids`` ``[B]`` are the
    sequence indices.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    doc_ids: torch.Tensor
    positions: torch.Tensor
    example_ids: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy of the batch on ``device``."""
        return Batch(
            *(
                t.to(device, non_blocking=non_blocking)
                for t in (self.inputs, self.targets, self.doc_ids, self.positions, self.example_ids)
            )
        )

    @property
    def n_targets(self) -> int:
        """Number of supervised targets (``targets != -100``)."""
        return int((self.targets != IGNORE_INDEX).sum())


class PackedDataset:
    """Fixed-length, non-overlapping windows over a memory-mapped token cache."""

    def __init__(self, cache_dir: str | Path, seq_len: int) -> None:
        self.cache_dir = Path(cache_dir)
        if seq_len < 1:
            raise UserError(f"seq_len must be >= 1, got {seq_len}")
        self.meta: dict[str, object] = json.loads((self.cache_dir / "meta.json").read_text())
        self.seq_len = seq_len
        self.n_tokens = int(self.meta["n_tokens"])  # type: ignore[arg-type]
        self.n_docs = int(self.meta["n_docs"])  # type: ignore[arg-type]
        if self.n_tokens < seq_len + 1:
            raise DataError(
                f"{self.meta.get('split', 'data')} split has {self.n_tokens} tokens; "
                f"seq_len={seq_len} needs at least {seq_len + 1}"
            )
        dtype = np.dtype(str(self.meta["dtype"]))
        self.tokens = np.memmap(self.cache_dir / "tokens.bin", dtype=dtype, mode="r", shape=(self.n_tokens,))
        self.supervised = np.memmap(self.cache_dir / "supervised.bin", dtype=np.uint8, mode="r", shape=(self.n_tokens,))
        self.doc_starts: np.ndarray = np.load(self.cache_dir / "doc_starts.npy")
        self._len = (self.n_tokens - 1) // seq_len

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"PackedDataset({str(self.cache_dir)!r}, seq_len={self.seq_len}, sequences={self._len})"

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """Assemble the sequences ``indices`` into a :class:`Batch`."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self._len):
            raise IndexError(f"sequence index out of range [0, {self._len})")
        L = self.seq_len
        starts = idx * L
        window = np.stack([np.asarray(self.tokens[s : s + L + 1], dtype=np.int64) for s in starts]).reshape(-1, L + 1)
        sup = np.stack([np.asarray(self.supervised[s : s + L + 1]) for s in starts]).reshape(-1, L + 1)
        offsets = starts[:, None] + np.arange(L + 1)
        doc = np.searchsorted(self.doc_starts, offsets, side="right") - 1

        targets = window[:, 1:].copy()
        valid = (sup[:, 1:] == 1) & (doc[:, 1:] == doc[:, :-1])
        targets[~valid] = IGNORE_INDEX
        doc_in = doc[:, :-1]
        segment_start = np.maximum(self.doc_starts[doc_in], starts[:, None])
        return Batch(
            inputs=torch.from_numpy(np.ascontiguousarray(window[:, :-1])),
            targets=torch.from_numpy(targets),
            doc_ids=torch.from_numpy(doc_in - doc_in[:, :1]),
            positions=torch.from_numpy(offsets[:, :-1] - segment_start),
            example_ids=torch.from_numpy(idx.copy()),
        )


# --------------------------------------------------------------------------- sampling


@functools.lru_cache(maxsize=4)
def _cached_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    perm.flags.writeable = False  # shared through the cache
    return perm


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order of the ``n`` sequences in ``epoch`` (deterministic in ``seed``, ``epoch``)."""
    if n < 1 or seed < 0 or epoch < 0:
        raise UserError(f"need n >= 1, seed >= 0, epoch >= 0; got n={n}, seed={seed}, epoch={epoch}")
    return _cached_permutation(n, seed, epoch).copy()


def batch_indices(n_sequences: int, step: int, micro: int, micro_batch: int, n_micro: int, seed: int) -> np.ndarray:
    """Global sequence indices of microbatch ``micro`` of optimizer step ``step``.

    The data order is the concatenation of per-epoch permutations; this microbatch
    reads ``micro_batch`` consecutive entries starting at
    ``(step * n_micro + micro) * micro_batch``. Being a pure function of its arguments,
    a resumed run reads exactly the same data. Ranks slice the returned array.
    """
    if not 0 <= micro < n_micro:
        raise UserError(f"micro must be in [0, {n_micro}), got {micro}")
    if n_sequences < 1:
        raise DataError("cannot sample from an empty dataset (n_sequences = 0)")
    if step < 0 or micro_batch < 1:
        raise UserError(f"need step >= 0 and micro_batch >= 1; got step={step}, micro_batch={micro_batch}")
    pos = (step * n_micro + micro) * micro_batch + np.arange(micro_batch, dtype=np.int64)
    epochs, offsets = np.divmod(pos, n_sequences)
    out = np.empty(micro_batch, dtype=np.int64)
    for epoch in np.unique(epochs):
        sel = epochs == epoch
        out[sel] = _cached_permutation(n_sequences, seed, int(epoch))[offsets[sel]]
    return out
