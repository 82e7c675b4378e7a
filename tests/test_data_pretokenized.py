"""`looplm tokenize` / looplm.data.pretokenized: identical to the start-up cache, sound reading,
refusals, atomic writes and the CLI end to end."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from _jobs import error_line, looplm_cmd, subprocess_env

import looplm.data.pretokenized as pretok
from looplm.cli import main
from looplm.data import (
    BPETokenizer,
    ByteTokenizer,
    DataError,
    PackedDataset,
    TaskConfig,
    Tokenizer,
    is_pretokenized,
    iter_documents,
    load_tokenizer,
    open_pretokenized,
    prepare_caches,
    pretokenized_info,
    tokenize_corpus,
)
from looplm.data.datasets import build_datasets
from looplm.errors import UserError

SPLIT_FILES = ("tokens.bin", "supervised.bin", "doc_starts.npy", "meta.json")
TASKS = dict(task_config=TaskConfig(min_difficulty=1, max_difficulty=3), n_task_examples=300)


def make_folder(root: Path, n: int = 12) -> Path:
    """A folder of n small .txt documents (plus a file that folder sources skip)."""
    root.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):
        words = " ".join(f"w{int(x)}" for x in rng.integers(0, 100, size=int(rng.integers(5, 40))))
        (root / f"doc{i:02d}.txt").write_text(f"document {i}: {words} é\n")
    (root / "skip.bin").write_bytes(b"\x00\x01")
    return root


def make_jsonl(path: Path, n: int = 10) -> Path:
    path.write_text("".join(json.dumps({"body": f"record {i} " + "abc " * i, "id": i}) + "\n" for i in range(n)))
    return path


def make_source(kind: str, tmp_path: Path) -> tuple[str, dict]:
    """(source, extra options) for one of the source kinds the tests cover."""
    if kind == "folder":
        return str(make_folder(tmp_path / "corpus")), {}
    if kind == "jsonl":
        return str(make_jsonl(tmp_path / "corpus.jsonl")), {"text_field": "body"}
    return "tasks", dict(TASKS)


def assert_same_splits(pretokenized: Path, cache_train: Path) -> None:
    for split, cache in (("train", cache_train), ("val", cache_train.parent / "val")):
        for name in SPLIT_FILES:
            assert (pretokenized / split / name).read_bytes() == (cache / name).read_bytes(), (split, name)


def damage_folder(out: Path, how: str) -> None:
    if how == "no val split":
        (out / "val" / "meta.json").unlink()
    elif how == "truncated tokens":
        data = (out / "train" / "tokens.bin").read_bytes()
        (out / "train" / "tokens.bin").write_bytes(data[:-2])
    elif how == "missing supervision":
        (out / "val" / "supervised.bin").unlink()
    elif how == "other tokenizer":  # the saved tokenizer is not the one the splits were written with
        BPETokenizer.train(["some other text"] * 4, 300).save(out)
    elif how == "split fingerprint":
        meta = json.loads((out / "train" / "meta.json").read_text())
        meta["tokenizer"] = "0" * 64
        (out / "train" / "meta.json").write_text(json.dumps(meta))
    elif how == "format version":
        info = json.loads((out / pretok.MARKER_FILE).read_text())
        info["version"] = pretok.PRETOKENIZED_VERSION + 1
        (out / pretok.MARKER_FILE).write_text(json.dumps(info))
    elif how == "corrupt marker":
        (out / pretok.MARKER_FILE).write_text("{not json")
    elif how == "no marker":
        (out / pretok.MARKER_FILE).unlink()
    else:
        raise AssertionError(how)


# -- same files as the start-up cache --------------------------------------------------------------
@pytest.mark.parametrize("kind", ["folder", "jsonl", "tasks"])
def test_splits_are_byte_identical_to_prepare_caches(tmp_path: Path, kind: str) -> None:
    source, extra = make_source(kind, tmp_path)
    out = tokenize_corpus(source, tmp_path / "out", holdout=0.25, seed=3, progress=False, **extra)
    assert out == tmp_path / "out" and is_pretokenized(out)
    train_dir, _ = prepare_caches(source, ByteTokenizer(), holdout=0.25, seed=3, cache_dir=tmp_path / "cache", **extra)
    assert_same_splits(out, train_dir)

    info = pretokenized_info(out)
    assert (info["tokenizer"], info["vocab_size"], info["eos_id"]) == ("byte", 258, 256)
    assert info["tokenizer_fingerprint"] == ByteTokenizer().fingerprint()
    assert (info["holdout"], info["seed"], info["source"]) == (0.25, 3, source)
    for split in ("train", "val"):
        meta = json.loads((out / split / "meta.json").read_text())
        assert info["splits"][split] == {"tokens": meta["n_tokens"], "docs": meta["n_docs"], "dtype": "uint16"}
    n_docs = sum(1 for _ in iter_documents(source, **extra))  # tasks: training examples; val is drawn apart
    assert (
        info["splits"]["train"]["docs"]
        if kind == "tasks"
        else info["splits"]["train"]["docs"] + info["splits"]["val"]["docs"]
    ) == n_docs
    # Nothing but the finished folder is left next to it.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_open_pretokenized_gives_the_batches_of_the_cache(tmp_path: Path) -> None:
    source = str(make_folder(tmp_path / "corpus", n=20))
    out = tokenize_corpus(source, tmp_path / "out", holdout=0.2, progress=False)
    tok, train, val = open_pretokenized(out, 8)
    assert isinstance(tok, ByteTokenizer) and tok.fingerprint() == ByteTokenizer().fingerprint()
    cache_train, cache_val = prepare_caches(source, ByteTokenizer(), holdout=0.2, cache_dir=tmp_path / "cache")
    for got, want in ((train, PackedDataset(cache_train, 8)), (val, PackedDataset(cache_val, 8))):
        assert len(got) == len(want) > 0
        idx = np.arange(len(want))[::-1]
        a, b = got.get_batch(idx), want.get_batch(idx)
        for field in ("inputs", "targets", "doc_ids", "positions", "example_ids"):
            assert getattr(a, field).equal(getattr(b, field)), field
    with pytest.raises(DataError, match="seq_len"):
        open_pretokenized(out, 10_000)


# -- tokenizers ------------------------------------------------------------------------------------
def test_bpe_tokenizer_is_trained_saved_and_round_trips(tmp_path: Path) -> None:
    source = str(make_folder(tmp_path / "corpus"))
    out = tokenize_corpus(source, tmp_path / "out", tokenizer="bpe", bpe_vocab_size=300, holdout=0.25, progress=False)
    tok, train, _ = open_pretokenized(out, 4)
    # The same BPE the trainer would train on this corpus, saved and loaded unchanged.
    want = BPETokenizer.train((d.text for d in iter_documents(source)), 300)
    assert isinstance(tok, BPETokenizer) and tok.fingerprint() == want.fingerprint()
    assert load_tokenizer(out).fingerprint() == tok.fingerprint() == pretokenized_info(out)["tokenizer_fingerprint"]
    assert pretokenized_info(out)["vocab_size"] == tok.vocab_size <= 300
    text = "document 7: w1 w2 é <eos>"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id in np.asarray(train.tokens)
    train_dir, _ = prepare_caches(source, tok, holdout=0.25, cache_dir=tmp_path / "cache")
    assert_same_splits(out, train_dir)

    # A saved tokenizer can be given by path (a tokenizer.json or the folder); it is kept as is.
    out2 = tokenize_corpus(
        source, tmp_path / "out2", tokenizer=str(out / "tokenizer.json"), holdout=0.25, progress=False
    )
    tok2, _, _ = open_pretokenized(out2, 4)
    assert tok2.fingerprint() == tok.fingerprint()
    assert_same_splits(out2, train_dir)


# -- refusals, reuse, replacement, atomic writes ---------------------------------------------------
def test_refuses_a_non_empty_folder_and_bad_options(tmp_path: Path) -> None:
    source = str(make_folder(tmp_path / "corpus"))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty and is not a pretokenized folder"):
        tokenize_corpus(source, busy, progress=False)
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]
    with pytest.raises(ValueError, match="not empty"):
        tokenize_corpus(source, source, progress=False)  # e.g. the corpus itself
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        tokenize_corpus(source, tmp_path / "file", progress=False)
    with pytest.raises(ValueError, match="holdout"):
        tokenize_corpus(source, tmp_path / "new", holdout=1.0, progress=False)
    with pytest.raises(ValueError, match="unknown tokenizer"):
        tokenize_corpus(source, tmp_path / "new", tokenizer="nope", progress=False)
    with pytest.raises(DataError, match="not found"):
        tokenize_corpus(tmp_path / "missing", tmp_path / "new", progress=False)
    assert not (tmp_path / "new").exists()
    # An empty folder is fine.
    (tmp_path / "empty").mkdir()
    assert is_pretokenized(tokenize_corpus(source, tmp_path / "empty", progress=False))


def test_same_inputs_are_kept_and_other_inputs_replace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = str(make_folder(tmp_path / "corpus"))
    out = tokenize_corpus(source, tmp_path / "out", holdout=0.25, progress=False)
    first = pretokenized_info(out)
    calls = []
    real = pretok.write_splits
    monkeypatch.setattr(pretok, "write_splits", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert pretokenized_info(tokenize_corpus(source, out, holdout=0.25, progress=False)) == first
    assert calls == []  # nothing tokenized again

    with pytest.raises(UserError, match=r"holdout 0\.5 \(the folder's: 0\.25\).*--overwrite"):
        tokenize_corpus(source, out, holdout=0.5, progress=False)  # runs may train on it: not replaced silently
    assert calls == [] and pretokenized_info(out) == first
    tokenize_corpus(source, out, holdout=0.5, progress=False, overwrite=True)
    assert calls == [1] and pretokenized_info(out)["holdout"] == 0.5
    train_dir, _ = prepare_caches(source, ByteTokenizer(), holdout=0.5, cache_dir=tmp_path / "cache")
    assert_same_splits(out, train_dir)

    damage_folder(out, "truncated tokens")  # a damaged folder is rebuilt, not kept
    tokenize_corpus(source, out, holdout=0.5, progress=False)
    assert calls == [1, 1]
    open_pretokenized(out, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "corpus", "out"]


def test_a_folder_from_another_tokenizer_is_replaced_only_with_overwrite(tmp_path: Path, capsys) -> None:
    """`looplm tokenize` into a folder made with another tokenizer refuses, naming the vocabulary sizes and
    the folder's tokenizer hash, unless --overwrite; a run trained on the old folder then reads the new one
    with an error naming both tokenizers (once "another tokenizer (bpe) than this run's (bpe)")."""
    source, out = str(make_folder(tmp_path / "corpus")), tmp_path / "tok"
    tokenize_corpus(source, out, tokenizer="bpe", bpe_vocab_size=300, holdout=0.25, progress=False)
    first = pretokenized_info(out)
    old_hash = first["tokenizer_fingerprint"][:12]
    run_tokenizer = load_tokenizer(out)  # what a run trained on the folder has in its checkpoint

    argv = ["tokenize", source, str(out), "--tokenizer", "bpe", "--bpe-vocab-size", "320", "--holdout", "0.25"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert "vocabulary 320" in err and "vocabulary 300" in err and old_hash in err and "--overwrite" in err
    assert pretokenized_info(out) == first
    with pytest.raises(UserError, match=f"byte, vocabulary 258, hash {ByteTokenizer().fingerprint()[:12]}"):
        tokenize_corpus(source, out, tokenizer="byte", holdout=0.25, progress=False)  # a given one: its own hash

    assert main([*argv, "--overwrite"]) == 0
    assert pretokenized_info(out)["vocab_size"] == 320
    load_tokenizer(out).save(tmp_path / "saved")  # the folder's own tokenizer, given by path: up to date
    kept = pretokenized_info(out)
    assert (
        pretokenized_info(tokenize_corpus(source, out, tokenizer=str(tmp_path / "saved"), holdout=0.25, progress=False))
        == kept
    )
    new_hash = load_tokenizer(out).fingerprint()[:12]
    with pytest.raises(DataError) as refused:
        build_datasets(str(out), run_tokenizer, seq_len=8)
    message = str(refused.value)
    assert "vocabulary 320" in message and "vocabulary 300" in message
    assert new_hash in message and old_hash in message


def test_an_interrupted_run_leaves_nothing_that_looks_finished(tmp_path: Path, monkeypatch) -> None:
    source = str(make_folder(tmp_path / "corpus"))

    class Interrupted(BaseException):
        pass

    def explode(tok: Tokenizer, directory: Path) -> None:
        raise Interrupted  # after the splits are written, before the marker

    monkeypatch.setattr(ByteTokenizer, "save", explode)
    with pytest.raises(Interrupted):
        tokenize_corpus(source, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]

    monkeypatch.undo()
    out = tokenize_corpus(source, tmp_path / "out", holdout=0.25, progress=False)
    before = pretokenized_info(out)
    monkeypatch.setattr(ByteTokenizer, "save", explode)
    with pytest.raises(Interrupted):  # replacing a finished folder: the old one stays intact
        tokenize_corpus(source, out, holdout=0.5, progress=False, overwrite=True)
    assert pretokenized_info(out) == before
    open_pretokenized(out, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out"]


@pytest.mark.parametrize(
    "how, message",
    [
        ("no val split", "no val split"),
        ("truncated tokens", "tokens.bin: expected"),
        ("missing supervision", "supervised.bin: expected"),
        ("other tokenizer", "saved tokenizer"),
        ("split fingerprint", "train split was written with tokenizer"),
        ("format version", "format version"),
        ("corrupt marker", "unreadable"),
        ("no marker", "not a pretokenized folder"),
    ],
)
def test_an_incomplete_or_inconsistent_folder_is_a_data_error(tmp_path: Path, how: str, message: str) -> None:
    out = tokenize_corpus(str(make_folder(tmp_path / "corpus")), tmp_path / "out", holdout=0.25, progress=False)
    damage_folder(out, how)
    with pytest.raises(DataError, match=message) as err:
        open_pretokenized(out, 4)
    assert "\n" not in str(err.value)


def test_progress_bar_counts_documents(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the bar is drawn only on a terminal
    out = tokenize_corpus("tasks", tmp_path / "out", holdout=0.1, progress=True, **TASKS)
    err = capsys.readouterr().err
    assert "tokenizing" in err and "doc" in err
    info = pretokenized_info(out)
    assert info["splits"]["train"]["docs"] == 300 and info["n_task_examples"] == 300


# -- command line ----------------------------------------------------------------------------------
def looplm(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        looplm_cmd(*map(str, args)), env=subprocess_env(), capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_tokenize_command_end_to_end(tmp_path: Path) -> None:
    source = make_jsonl(tmp_path / "corpus.jsonl", n=12)
    out = tmp_path / "tokens"
    res = looplm("tokenize", source, out, "--text-field", "body", "--holdout", "0.25", "--seed", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    info = pretokenized_info(out)
    for split in ("train", "val"):
        counts = info["splits"][split]
        assert f"{counts['tokens']:,} tokens" in res.stdout and f"{counts['docs']:,} documents" in res.stdout
    assert str(out) in res.stdout.splitlines()[0]
    assert f"looplm train tiny --data.source {out}" in res.stdout
    train_dir, _ = prepare_caches(
        str(source), ByteTokenizer(), holdout=0.25, seed=1, text_field="body", cache_dir=tmp_path / "cache"
    )
    assert_same_splits(out, train_dir)

    # Bad input: one line `error: ...`, exit status 2, nothing written.
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x.txt").write_text("x")
    for args in ([tmp_path / "missing.jsonl", tmp_path / "new"], [source, tmp_path / "busy"]):
        res = looplm("tokenize", *args)
        assert res.returncode == 2, res.stderr
        error_line(res.stderr)
        assert res.stdout == ""
    assert not (tmp_path / "new").exists()


def test_training_reads_a_pretokenized_folder(tmp_path: Path) -> None:
    """`--data.source OUT` trains from the folder as it is: its splits, its tokenizer, and the
    end-of-training report reads the same folder."""
    from _jobs import tiny_job

    from looplm.train.trainer import Trainer

    out = tokenize_corpus(
        make_folder(tmp_path / "corpus", n=40),
        tmp_path / "tok",
        tokenizer="bpe",
        bpe_vocab_size=300,
        holdout=0.1,
        progress=False,
    )
    job = tiny_job(
        tmp_path,
        "run",
        data__source=str(out),
        data__tokenizer="byte",
        train__steps=2,
        model__max_seq_len=32,
        data__seq_len=32,
    )
    trainer = Trainer(job)
    assert trainer.tokenizer.fingerprint() == open_pretokenized(out, 32)[0].fingerprint()
    assert trainer.job.model.vocab_size == trainer.tokenizer.vocab_size != 258  # BPE, not the byte flag
    assert trainer.train_data.cache_dir == out / "train" and trainer.val_data.cache_dir == out / "val"
    assert not (tmp_path / "cache").exists()  # nothing was tokenized again
    trainer.fit()
    assert trainer.step == 2


def _pretok(tmp_path):
    from looplm.data import tokenize_corpus

    source = str(make_folder(tmp_path / "corpus"))
    return source, tokenize_corpus(source, tmp_path / "out", holdout=0.25, progress=False)


def test_another_seed_is_not_kept_silently(tmp_path):
    """The held-out draw depends on the seed, so a folder tokenized with seed 0
    is not reused for seed 1 (refused without --overwrite)."""
    from looplm.data import tokenize_corpus
    from looplm.errors import UserError

    source, out = _pretok(tmp_path)
    with pytest.raises(UserError, match=r"seed 1 \(the folder's: 0\)"):
        tokenize_corpus(source, out, holdout=0.25, seed=1, progress=False)


def test_marker_counts_must_match_the_split(tmp_path):
    """Pretokenized.json's token count disagreeing with train/meta.json."""
    from looplm.data import DataError, open_pretokenized

    _, out = _pretok(tmp_path)
    info = json.loads((out / "pretokenized.json").read_text())
    info["splits"]["train"]["tokens"] += 1
    (out / "pretokenized.json").write_text(json.dumps(info))
    with pytest.raises(DataError, match="disagrees"):
        open_pretokenized(out, 4)


def test_token_file_size_follows_the_split_dtype(tmp_path):
    """A split
    whose meta.json says uint32 but whose tokens.bin holds 2-byte ids is refused."""
    from looplm.data import DataError, open_pretokenized

    _, out = _pretok(tmp_path)
    meta = json.loads((out / "train" / "meta.json").read_text())
    assert meta["dtype"] == "uint16"
    meta["dtype"] = "uint32"
    (out / "train" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="expected"):
        open_pretokenized(out, 4)


# -- a pre-tokenized folder's consistency checks and its marker --------------------------------------
def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "how, message",
    [
        # doc_starts.npy holding fewer documents than meta.json says (the check was `> n_docs`)
        ("fewer doc starts", "doc_starts.npy'?: .*documents, expected"),
        # a split's meta.json of another cache version (the check was removed)
        ("split cache version", "cache version"),
        # the marker's document count disagreeing (only the token count was compared)
        ("marker docs", "disagrees"),
        # an older marker cache version (the check was `> CACHE_VERSION`)
        ("old marker cache version", "holds token caches of version"),
        # a marker whose splits are not a table (an AttributeError, not a DataError)
        ("splits not a table", "lacks splits"),
    ],
)
def test_more_inconsistent_folders_are_data_errors(tmp_path: Path, how: str, message: str) -> None:
    _, out = _pretok(tmp_path)
    if how == "fewer doc starts":
        starts = np.load(out / "train" / "doc_starts.npy")
        np.save(out / "train" / "doc_starts.npy", starts[:-1])
    elif how == "split cache version":
        _edit_json(out / "val" / "meta.json", lambda m: m.update(version=m["version"] + 1))
    elif how == "marker docs":
        _edit_json(out / pretok.MARKER_FILE, lambda i: i["splits"]["val"].update(docs=i["splits"]["val"]["docs"] + 1))
    elif how == "old marker cache version":
        _edit_json(out / pretok.MARKER_FILE, lambda i: i.update(cache_version=i["cache_version"] - 1))
    elif how == "splits not a table":
        _edit_json(out / pretok.MARKER_FILE, lambda i: i.update(splits=[]))
    with pytest.raises(DataError, match=message):
        open_pretokenized(out, 4)


def test_a_zero_holdout_is_refused_before_anything_else(tmp_path: Path) -> None:
    """Guards against: `0.0 < holdout` -> `0.0 <= holdout`. write_splits refuses it too, but only after the folder is
    compared: into an existing folder a zero holdout was reported as other inputs needing --overwrite."""
    source, out = _pretok(tmp_path)
    before = pretokenized_info(out)
    for target in (out, tmp_path / "new"):
        with pytest.raises(UserError, match=r"holdout must be in \(0, 1\), got 0\.0"):
            tokenize_corpus(source, target, holdout=0.0, progress=False)
    assert pretokenized_info(out) == before and not (tmp_path / "new").exists()


def test_the_marker_records_each_splits_dtype(tmp_path: Path, monkeypatch) -> None:
    """Guards against: the marker's splits recorded dtype uint16 whatever the split's meta.json said (a vocabulary over
    65536 ids is stored as uint32)."""
    from test_data_packing import WideTokenizer

    monkeypatch.setattr(pretok, "build_tokenizer", lambda *a, **k: WideTokenizer())
    out = tokenize_corpus(str(make_folder(tmp_path / "corpus")), tmp_path / "out", holdout=0.25, progress=False)
    info = json.loads((out / pretok.MARKER_FILE).read_text())
    for split in ("train", "val"):
        meta = json.loads((out / split / "meta.json").read_text())
        assert info["splits"][split]["dtype"] == meta["dtype"] == "uint32"


def test_build_datasets_passes_the_text_field(tmp_path: Path) -> None:
    """Guards against: build_datasets dropped `text_field` (a JSONL corpus whose text is under another key was read with
    the default 'text' field)."""
    source = str(make_jsonl(tmp_path / "corpus.jsonl", n=12))
    train, val = build_datasets(
        source, ByteTokenizer(), seq_len=8, holdout=0.25, cache_dir=tmp_path / "a", text_field="body"
    )
    want_train, want_val = prepare_caches(
        source, ByteTokenizer(), holdout=0.25, cache_dir=tmp_path / "b", text_field="body"
    )
    for got, want in ((train, want_train), (val, want_val)):
        assert np.array_equal(np.asarray(got.tokens), np.asarray(PackedDataset(want, 8).tokens))
