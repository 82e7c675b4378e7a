"""Tests for looplm.data.packing against naive per-token reference implementations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from looplm.data import (
    Batch,
    BPETokenizer,
    ByteTokenizer,
    DataError,
    PackedDataset,
    TaskConfig,
    Tokenizer,
    batch_indices,
    build_datasets,
    epoch_permutation,
    iter_documents,
)


class CountingTokenizer(ByteTokenizer):
    """Byte tokenizer that counts encode calls (to detect re-tokenization)."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return super().encode(text)


class WideTokenizer(ByteTokenizer):
    """Byte tokenizer claiming a vocabulary too big for uint16."""

    @property
    def vocab_size(self) -> int:
        return 70000

    def canonical_description(self) -> str:
        return "wide-test"


class BosTokenizer(ByteTokenizer):
    """Byte tokenizer with a beginning-of-text token (id 258), as a released model's tokenizer may have."""

    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def bos_id(self) -> int:
        return 258

    def canonical_description(self) -> str:
        return "byte-bos-test"


class TopEosTokenizer(ByteTokenizer):
    """Byte tokenizer of `vocab` ids whose end-of-document token is the last id, vocab - 1."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    @property
    def vocab_size(self) -> int:
        return self.vocab

    @property
    def eos_id(self) -> int:
        return self.vocab - 1

    def canonical_description(self) -> str:
        return f"top-eos-{self.vocab}"


def make_folder(root: Path, n: int = 12) -> Path:
    root.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):
        words = " ".join(f"w{int(x)}" for x in rng.integers(0, 100, size=int(rng.integers(1, 30))))
        (root / f"doc{i:02d}.txt").write_text(f"document {i}: {words} é\n")
    return root


def reference_docs(source: str, tok: Tokenizer, **kw: object) -> list[tuple[list[int], list[int]]]:
    """Naive: (token ids incl. bos and eos, supervised flags) per document, in source order; a tokenizer's
    BOS starts every document (the prompt of a task) and is never supervised."""
    out = []
    bos = [] if tok.bos_id is None else [tok.bos_id]
    for doc in iter_documents(source, **kw):  # type: ignore[arg-type]
        if doc.answer_start is None:
            ids = bos + tok.encode(doc.text) + [tok.eos_id]
            sup = [0] * len(bos) + [1] * (len(ids) - len(bos))
        else:
            p, a = bos + tok.encode(doc.text[: doc.answer_start]), tok.encode(doc.text[doc.answer_start :])
            ids = p + a + [tok.eos_id]
            sup = [0] * len(p) + [1] * (len(a) + 1)
        out.append((ids, sup))
    return out


def split_docs(ds: PackedDataset) -> list[list[int]]:
    toks = np.asarray(ds.tokens).tolist()
    bounds = list(ds.doc_starts) + [ds.n_tokens]
    return [toks[bounds[i] : bounds[i + 1]] for i in range(ds.n_docs)]


def check_against_reference(ds: PackedDataset, docs: list[tuple[list[int], list[int]]]) -> None:
    """Compare every batch field with a per-token loop over the concatenated docs."""
    stream, sup, doc_of = [], [], []
    for d, (ids, s) in enumerate(docs):
        stream += ids
        sup += s
        doc_of += [d] * len(ids)
    assert np.asarray(ds.tokens).tolist() == stream
    L = ds.seq_len
    assert len(ds) == (len(stream) - 1) // L
    batch = ds.get_batch(list(range(len(ds))))
    # The token stream is the concatenation of the rows' inputs (plus the last target).
    assert batch.inputs.reshape(-1).tolist() == stream[: len(ds) * L]
    for row in range(len(ds)):
        base = row * L
        seg, pos = 0, 0
        for j in range(L):
            p = base + j
            if j > 0 and doc_of[p] != doc_of[p - 1]:
                seg, pos = seg + 1, 0
            elif j > 0:
                pos += 1
            want_target = stream[p + 1] if sup[p + 1] and doc_of[p + 1] == doc_of[p] else -100
            assert batch.targets[row, j].item() == want_target, (row, j)
            assert batch.doc_ids[row, j].item() == seg, (row, j)
            assert batch.positions[row, j].item() == pos, (row, j)
    assert batch.example_ids.tolist() == list(range(len(ds)))
    for t in (batch.inputs, batch.targets, batch.doc_ids, batch.positions, batch.example_ids):
        assert t.dtype == torch.int64


def test_folder_packing_matches_reference(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "corpus")
    tok = ByteTokenizer()
    train, val = build_datasets(str(src), tok, seq_len=16, holdout=0.2, cache_dir=tmp_path / "cache")
    ref = reference_docs(str(src), tok)
    train_docs, val_docs = split_docs(train), split_docs(val)
    # Holdout by document: disjoint, covering, order preserved, expected size.
    all_ids = [ids for ids, _ in ref]
    assert len(val_docs) == round(0.2 * len(ref))
    assert sorted(map(tuple, train_docs + val_docs)) == sorted(map(tuple, all_ids))
    assert not set(map(tuple, train_docs)) & set(map(tuple, val_docs))
    assert train_docs == [d for d in all_ids if d in train_docs]
    check_against_reference(train, [r for r in ref if r[0] in train_docs])
    check_against_reference(PackedDataset(val.cache_dir, 4), [r for r in ref if r[0] in val_docs])
    assert train.tokens.dtype == np.uint16 and isinstance(train.tokens, np.memmap)
    assert train.tokens.mode == "r"


def test_tasks_packing_supervision(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    cfg = TaskConfig(min_difficulty=2, max_difficulty=5)
    train, val = build_datasets(
        "tasks", tok, seq_len=32, holdout=0.1, cache_dir=tmp_path, task_config=cfg, n_task_examples=300, seed=1
    )
    ref = reference_docs("tasks", tok, task_config=cfg, n_task_examples=300, seed=1)
    check_against_reference(train, ref)
    check_against_reference(PackedDataset(val.cache_dir, 8), reference_docs_val(val))
    train_prompts = {tok.decode(ids[: s.index(1)]) for ids, s in ref}
    for ids in split_docs(val):
        assert ids[-1] == tok.eos_id
        text = tok.decode(ids)
        assert text.endswith("\n")
        assert text[: text.index("=", text.index("?") if "?" in text else 0) + 1] not in train_prompts
    assert 0 < val.n_docs <= 30


def reference_docs_val(val: PackedDataset) -> list[tuple[list[int], list[int]]]:
    """Rebuild task supervision from the stored validation docs (answer = after last '=')."""
    out = []
    for ids in split_docs(val):
        cut = len(ids) - 1 - ids[::-1].index(ord("="))
        out.append((ids, [0] * (cut + 1) + [1] * (len(ids) - cut - 1)))
    return out


def test_bpe_packing_matches_reference(tmp_path: Path) -> None:
    cfg = TaskConfig(max_difficulty=4)
    texts = [d.text for d in iter_documents("tasks", task_config=cfg, n_task_examples=200, seed=0)]
    tok = BPETokenizer.train(texts, vocab_size=300)
    train, _ = build_datasets(
        "tasks", tok, seq_len=16, cache_dir=tmp_path, task_config=cfg, n_task_examples=200, seed=0
    )
    check_against_reference(train, reference_docs("tasks", tok, task_config=cfg, n_task_examples=200, seed=0))


def test_cache_reused_and_invalidated(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "corpus", n=5)
    tok = CountingTokenizer()
    train, _ = build_datasets(str(src), tok, seq_len=8, cache_dir=tmp_path / "cache")
    first_calls = tok.calls
    assert first_calls > 0
    mtime = (train.cache_dir / "tokens.bin").stat().st_mtime_ns
    train2, _ = build_datasets(str(src), tok, seq_len=12, cache_dir=tmp_path / "cache")
    assert tok.calls == first_calls
    assert train2.cache_dir == train.cache_dir
    assert (train.cache_dir / "tokens.bin").stat().st_mtime_ns == mtime
    assert len(list((tmp_path / "cache").iterdir())) == 1  # no temp dir left behind
    meta = json.loads((train.cache_dir / "meta.json").read_text())
    assert meta["tokenizer"] == tok.fingerprint() and meta["n_docs"] == train.n_docs
    # Editing the corpus, or another holdout, builds a new cache.
    (src / "doc00.txt").write_text("changed content, longer than before")
    train3, _ = build_datasets(str(src), tok, seq_len=8, cache_dir=tmp_path / "cache")
    assert train3.cache_dir != train.cache_dir and tok.calls > first_calls


def test_wide_vocab_uses_uint32(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "corpus", n=4)
    train, val = build_datasets(str(src), WideTokenizer(), seq_len=8, holdout=0.25, cache_dir=tmp_path / "c")
    assert train.tokens.dtype == np.uint32 and val.tokens.dtype == np.uint32
    assert np.asarray(train.tokens).max() == 256  # eos id survives


def test_jsonl_holdout_disjoint(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"unique document number {i}"}) + "\n" for i in range(40)))
    tok = ByteTokenizer()
    train, val = build_datasets(str(path), tok, seq_len=8, holdout=0.05, cache_dir=tmp_path / "c")
    tr = {tok.decode(d) for d in split_docs(train)}
    va = {tok.decode(d) for d in split_docs(val)}
    assert len(va) == 2 and len(tr) == 38 and not tr & va
    # Same seed, same split; different seed, (almost surely) different split.
    _, val_again = build_datasets(str(path), tok, seq_len=8, holdout=0.05, cache_dir=tmp_path / "c2")
    assert {tok.decode(d) for d in split_docs(val_again)} == va
    _, val_other = build_datasets(str(path), tok, seq_len=8, holdout=0.05, cache_dir=tmp_path / "c", seed=1)
    assert {tok.decode(d) for d in split_docs(val_other)} != va


def test_build_errors(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no non-empty document"):
        build_datasets(str(empty), tok, seq_len=8, cache_dir=tmp_path / "c")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "ok.txt").write_text("fine")
    (bad / "broken.txt").write_bytes(b"\xff\xfe bad bytes")
    with pytest.raises(DataError, match="broken.txt"):
        build_datasets(str(bad), tok, seq_len=8, cache_dir=tmp_path / "c")
    jl = tmp_path / "x.jsonl"
    jl.write_text('{"text": "a"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"x\.jsonl:2"):
        build_datasets(str(jl), tok, seq_len=8, cache_dir=tmp_path / "c")
    src = make_folder(tmp_path / "corpus", n=3)
    with pytest.raises(DataError, match=r"tokens; seq_len=100000 needs at least 100001"):
        build_datasets(str(src), tok, seq_len=100000, cache_dir=tmp_path / "c")
    one = tmp_path / "one.txt"
    one.write_text("a single document")
    with pytest.raises(DataError, match="at least 2"):
        build_datasets(str(one), tok, seq_len=4, cache_dir=tmp_path / "c")
    assert not [p for p in (tmp_path / "c").iterdir() if p.name.startswith(".tmp")]


def test_batch_to_and_n_targets(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "corpus", n=6)
    train, _ = build_datasets(str(src), ByteTokenizer(), seq_len=8, cache_dir=tmp_path / "c")
    b = train.get_batch(np.array([1, 0]))
    assert isinstance(b, Batch) and b.inputs.shape == (2, 8)
    assert b.example_ids.tolist() == [1, 0]
    moved = b.to("cpu")
    assert torch.equal(moved.targets, b.targets)
    assert b.n_targets == int((b.targets != -100).sum())
    with pytest.raises(IndexError):
        train.get_batch([len(train)])


def test_epoch_permutation() -> None:
    p = epoch_permutation(50, seed=3, epoch=0)
    assert sorted(p.tolist()) == list(range(50))
    assert np.array_equal(p, epoch_permutation(50, 3, 0))
    assert not np.array_equal(p, epoch_permutation(50, 3, 1))


def test_batch_indices_epochs_and_resume() -> None:
    n, micro_batch, n_micro, seed = 23, 3, 2, 5
    per_step = micro_batch * n_micro
    steps = 20  # 120 samples: 5 full epochs + 5
    full = np.concatenate(
        [batch_indices(n, s, m, micro_batch, n_micro, seed) for s in range(steps) for m in range(n_micro)]
    )
    expected = np.concatenate([epoch_permutation(n, seed, e) for e in range(6)])[: steps * per_step]
    assert np.array_equal(full, expected)
    for e in range(5):
        assert sorted(full[e * n : (e + 1) * n].tolist()) == list(range(n))
    # A run resumed at step 7 reads exactly the same indices as an uninterrupted one.
    resumed = np.concatenate(
        [batch_indices(n, s, m, micro_batch, n_micro, seed) for s in range(7, steps) for m in range(n_micro)]
    )
    assert np.array_equal(resumed, full[7 * per_step :])
    # micro_batch larger than the dataset spans several epochs.
    big = batch_indices(4, 0, 0, 10, 1, 0)
    assert sorted(big[:4].tolist()) == [0, 1, 2, 3] and len(big) == 10


def test_one_default_for_the_task_generators_size():
    """Training (DataConfig), the caches, `looplm tokenize` and its CLI draw the same number of generator
    examples when none is given (the caches' default was 20,000, training's 200,000)."""
    import inspect

    import looplm.cli as cli
    from looplm.data import datasets, packing, pretokenized, sources
    from looplm.train.config import DataConfig

    want = DataConfig().n_task_examples
    for fn in (
        datasets.build_datasets,
        packing.prepare_caches,
        packing.write_splits,
        sources.iter_documents,
        sources.describe_source,
        pretokenized.tokenize_corpus,
        cli.tokenize,
    ):
        assert inspect.signature(fn).parameters["n_task_examples"].default == want, fn.__qualname__


@pytest.mark.parametrize("source", ["folder", "tasks"])
def test_bos_starts_every_document(tmp_path: Path, source: str) -> None:
    """A tokenizer with a BOS: every document, a task's prompt included, starts with it, unsupervised
    (as `encode_prompt` starts a prompt at inference)."""
    tok = BosTokenizer()
    cfg = TaskConfig(max_difficulty=3)
    kw: dict = dict(task_config=cfg, n_task_examples=100, seed=0) if source == "tasks" else {}
    src = "tasks" if source == "tasks" else str(make_folder(tmp_path / "corpus", n=6))
    train, _ = build_datasets(src, tok, seq_len=16, holdout=0.2, cache_dir=tmp_path / "c", **kw)
    docs = split_docs(train)
    assert docs and all(d[0] == tok.bos_id and d.count(tok.bos_id) == 1 for d in docs)
    ref = reference_docs(src, tok, **kw)
    check_against_reference(train, [r for r in ref if r[0] in docs])


def test_a_large_holdout_leaves_a_training_document(tmp_path: Path) -> None:
    """holdout 0.9 of 3 documents rounds to 3 held out; at most n - 1 are, so training keeps one."""
    src = make_folder(tmp_path / "corpus", n=3)
    train, val = build_datasets(str(src), ByteTokenizer(), seq_len=4, holdout=0.9, cache_dir=tmp_path / "c")
    assert (train.n_docs, val.n_docs) == (1, 2)


def test_a_tiny_task_holdout_still_validates_on_one_example(tmp_path: Path) -> None:
    """holdout * n rounds to 0 task examples: the validation split still gets one (not an empty split)."""
    cfg = TaskConfig(min_difficulty=4, max_difficulty=6)
    _, val = build_datasets(
        "tasks", ByteTokenizer(), seq_len=8, holdout=0.001, cache_dir=tmp_path, task_config=cfg, n_task_examples=300
    )
    assert val.n_docs == 1


def test_another_holdout_builds_another_cache(tmp_path: Path) -> None:
    """The holdout is part of the cache key: the same corpus with another holdout is split again."""
    src = make_folder(tmp_path / "corpus", n=10)
    tok = ByteTokenizer()
    train_a, val_a = build_datasets(str(src), tok, seq_len=8, holdout=0.2, cache_dir=tmp_path / "c")
    train_b, val_b = build_datasets(str(src), tok, seq_len=8, holdout=0.5, cache_dir=tmp_path / "c")
    assert train_b.cache_dir != train_a.cache_dir
    assert (val_a.n_docs, val_b.n_docs) == (2, 5)


@pytest.mark.parametrize(("vocab", "dtype"), [(65535, np.uint16), (65536, np.uint32), (65537, np.uint32)])
def test_token_dtype_holds_the_largest_id(tmp_path: Path, vocab: int, dtype) -> None:
    """The cache's documented rule: uint16 when vocab_size <= 65535, else uint32; the largest id survives."""
    src = make_folder(tmp_path / "corpus", n=4)
    tok = TopEosTokenizer(vocab)
    train, _ = build_datasets(str(src), tok, seq_len=8, holdout=0.25, cache_dir=tmp_path / "c")
    assert train.tokens.dtype == dtype
    assert np.asarray(train.tokens).max() == vocab - 1  # the eos id survives


def test_caches_ready_needs_both_splits(tmp_path: Path) -> None:
    """`caches_ready` (the trainer's "no tokenizing needed") holds only when both splits are finished."""
    from looplm.data.packing import caches_ready

    src = make_folder(tmp_path / "corpus", n=5)
    tok = ByteTokenizer()
    assert not caches_ready(str(src), tok, cache_dir=tmp_path / "c")
    train, val = build_datasets(str(src), tok, seq_len=8, cache_dir=tmp_path / "c")
    assert caches_ready(str(src), tok, cache_dir=tmp_path / "c")
    (val.cache_dir / "meta.json").unlink()
    assert not caches_ready(str(src), tok, cache_dir=tmp_path / "c")


def test_epoch_permutation_is_the_callers_own_copy() -> None:
    """The permutation is cached; the caller gets a writable copy, and writing it leaves the next call's intact."""
    p = epoch_permutation(20, seed=4, epoch=2)
    want = p.copy()
    p[:] = 0
    assert np.array_equal(epoch_permutation(20, seed=4, epoch=2), want)


def test_negative_sequence_indices_are_refused(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "corpus", n=6)
    train, _ = build_datasets(str(src), ByteTokenizer(), seq_len=8, cache_dir=tmp_path / "c")
    with pytest.raises(IndexError, match="out of range"):
        train.get_batch([0, -1])


def test_batch_to_keeps_every_field_in_its_place(tmp_path: Path) -> None:
    """The moved batch's doc ids and positions are the original's, not each other."""
    src = make_folder(tmp_path / "corpus", n=12)
    train, _ = build_datasets(str(src), ByteTokenizer(), seq_len=16, holdout=0.5, cache_dir=tmp_path / "c")
    b = train.get_batch(list(range(len(train))))
    assert int(b.doc_ids.max()) > 0  # a row with a document boundary: doc ids and positions differ
    moved = b.to("cpu")
    for field in ("inputs", "targets", "doc_ids", "positions", "example_ids"):
        assert torch.equal(getattr(moved, field), getattr(b, field)), field


def test_a_split_needs_one_token_more_than_a_row(tmp_path: Path) -> None:
    """A row reads seq_len + 1 tokens (its inputs and the last target), so a split of exactly seq_len tokens is refused
    (not an empty dataset); seq_len - 1 gives one row."""
    src = make_folder(tmp_path / "corpus", n=6)
    _, val = build_datasets(str(src), ByteTokenizer(), seq_len=8, holdout=0.2, cache_dir=tmp_path / "c")
    n = val.n_tokens
    with pytest.raises(DataError, match=f"seq_len={n} needs at least {n + 1}"):
        PackedDataset(val.cache_dir, n)
    assert len(PackedDataset(val.cache_dir, n - 1)) == 1
