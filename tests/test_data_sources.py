"""Tests for looplm.data.sources."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest

from looplm.data import DataError, Document, TaskConfig, iter_documents
from looplm.data import sources


def test_folder_sorted_recursive(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.md").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "c.txt").write_text("   \n")  # whitespace only: skipped
    (tmp_path / "ignored.json").write_text("{}")
    assert [d.text for d in iter_documents(str(tmp_path))] == ["first", "second"]


def test_tasks_source() -> None:
    docs = list(iter_documents("tasks", task_config=TaskConfig(), n_task_examples=12, seed=3))
    assert len(docs) == 12
    for d in docs:
        assert d.answer_start is not None
        assert d.text[d.answer_start - 1] == "=" and d.text.endswith("\n")


def test_large_file_split_on_blank_lines(tmp_path: Path) -> None:
    paragraphs = [f"paragraph {i} " + "word " * 400 for i in range(200)]
    text = "\n\n".join(paragraphs) + "\n"
    path = tmp_path / "big.txt"
    path.write_text(text)
    docs = list(iter_documents(str(path)))
    assert len(docs) > 3
    assert "".join(d.text for d in docs) == text
    assert all(len(d.text) < 2 * sources.MAX_CHUNK_CHARS for d in docs)


def test_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"doc {i}"}) for i in range(3)) + "\n\n")
    assert [d.text for d in iter_documents(str(path), text_field="body")] == ["doc 0", "doc 1", "doc 2"]


@pytest.mark.parametrize(
    "line, pattern",
    [("{not json", r"bad\.jsonl:3: invalid JSON"), ('{"other": "x"}', r"bad\.jsonl:3: no field 'text'")],
)
def test_jsonl_errors(tmp_path: Path, line: str, pattern: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n' + line + "\n")
    with pytest.raises(DataError, match=pattern):
        list(iter_documents(str(path)))


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        list(iter_documents(str(tmp_path / "missing")))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no non-empty document"):
        list(iter_documents(str(empty)))
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match="latin1.txt is not valid UTF-8"):
        list(iter_documents(str(bad)))
    assert issubclass(DataError, ValueError)
    # the offset of the bad byte counts from the file's start, in a file read in chunks too
    for at in (1000, 300_000):
        big = tmp_path / f"bad{at}.txt"
        big.write_bytes(b"ab\n" * (at // 3) + b"a" * (at % 3) + b"\xff" + b"tail\n" * 10)
        with pytest.raises(DataError, match=rf"bad{at}.txt is not valid UTF-8 \(byte offset {at}\)"):
            list(iter_documents(str(big)))
    # a JSON escape of half a surrogate pair (a cut emoji) is no text: named with its line
    cut = tmp_path / "cut.jsonl"
    cut.write_text('{"text": "fine"}\n{"text": "a cut emoji \\ud83d here"}\n')
    with pytest.raises(DataError, match=r"cut.jsonl:2: field 'text' holds a lone surrogate"):
        list(iter_documents(str(cut)))


def test_hf_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(DataError, match="datasets"):
        list(iter_documents("hf:some/corpus"))


def test_hf_with_fake_package(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def load_dataset(name: str, split: str) -> list[dict[str, str]]:
        calls.append((name, split))
        return [{"text": "one"}, {"text": ""}, {"text": "two"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert [d.text for d in iter_documents("hf:org/corpus:validation")] == ["one", "two"]
    assert list(iter_documents("hf:org/corpus")) == [Document("one"), Document("two")]
    assert calls == [("org/corpus", "validation"), ("org/corpus", "train")]


def test_a_changed_hf_dataset_is_new_data(monkeypatch: pytest.MonkeyPatch) -> None:
    # the token cache's key named the dataset only: a local copy that changed kept its old tokens
    class Rows(list):
        _fingerprint = "a1"

    rows = Rows([{"text": "old"}])
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda name, split: rows))
    before = sources.describe_source("hf:/data/local_set")
    rows._fingerprint = "b2"
    assert sources.describe_source("hf:/data/local_set") != before


def test_large_files_are_cut_only_at_blank_lines(tmp_path):
    """Paragraphs of many short lines stay
    whole; every document but the last ends with its blank line."""
    from looplm.data import iter_documents
    from looplm.data import sources

    para = "".join(f"line {j} of a paragraph that goes on\n" for j in range(60))
    text = "\n".join(para for _ in range(80))  # ~170 KB, a blank line every 60 lines
    path = tmp_path / "big.txt"
    path.write_text(text)
    docs = [d.text for d in iter_documents(str(path))]
    assert len(docs) > 1 and "".join(docs) == text
    assert all(d.endswith("\n\n") for d in docs[:-1])
    assert all(len(d) >= sources.MAX_CHUNK_CHARS for d in docs[:-1])


def test_a_same_size_edit_changes_the_source_description(tmp_path):
    """An edit that keeps the size (only the mtime tells) is new data."""
    from looplm.data.sources import describe_source

    path = tmp_path / "a.txt"
    path.write_text("hello world\n")
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    before = describe_source(str(path))
    path.write_text("HELLO WORLD\n")
    os.utime(path, ns=(2_000_000_000, 2_000_000_000))
    assert describe_source(str(path)) != before


def test_a_huge_file_without_blank_lines_is_still_cut(tmp_path):
    """A 1.2 MB file of lines and no blank line is cut
    once a piece reaches 16 x 64 KB, so memory stays bounded; nothing is lost."""
    from looplm.data import sources

    line = "x" * 99 + "\n"
    text = line * 12_000
    path = tmp_path / "wall.txt"
    path.write_text(text)
    docs = [d.text for d in iter_documents(str(path))]
    limit = 16 * sources.MAX_CHUNK_CHARS
    assert len(docs) == 2 and "".join(docs) == text
    assert limit <= len(docs[0]) < limit + len(line)


def test_the_bad_byte_offset_counts_a_character_split_across_read_chunks(tmp_path):
    """The decoder reads 1 MiB chunks; when a 2-byte character straddles the
    chunk boundary its first byte is pending in the decoder, and the offset of a later bad byte must
    not count it twice."""
    at = (1 << 20) - 1 + 2 + 10  # 'a' * (2^20 - 1), then 'é' across the boundary, then 10 'b', then 0xff
    bad = tmp_path / "split.txt"
    bad.write_bytes(b"a" * ((1 << 20) - 1) + "é".encode() + b"b" * 10 + b"\xff" + b"tail\n")
    with pytest.raises(DataError, match=rf"split.txt is not valid UTF-8 \(byte offset {at}\)"):
        list(iter_documents(str(bad)))


def test_whitespace_only_jsonl_records_are_skipped(tmp_path):
    """A record of blanks is no document."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("one", "  \n\t", "two")))
    assert [d.text for d in iter_documents(str(path))] == ["one", "two"]


def test_folder_suffixes_are_matched_without_case(tmp_path):
    """README.MD and NOTES.TXT are text files of a folder source too."""
    (tmp_path / "NOTES.TXT").write_text("upper")
    (tmp_path / "b.Md").write_text("mixed")
    (tmp_path / "c.txt").write_text("lower")
    assert sorted(d.text for d in iter_documents(str(tmp_path))) == ["lower", "mixed", "upper"]


def test_source_description_names_the_jsonl_field_and_the_task_count(tmp_path):
    """Another JSONL text field, or another number of
    generator examples, is other data (a token cache keyed on the description must not be reused)."""
    from looplm.data.sources import describe_source

    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "a", "body": "b"}) + "\n")
    assert describe_source(str(path), text_field="text") != describe_source(str(path), text_field="body")
    assert describe_source("tasks", n_task_examples=10) != describe_source("tasks", n_task_examples=20)


def test_the_bad_byte_offset_after_a_split_character_and_another_whole_chunk(tmp_path):
    """A character split across the first chunk boundary must not shift the
    offset of a bad byte two chunks later (each chunk's start is counted in whole bytes)."""
    mib = 1 << 20
    head = b"a" * (mib - 1) + "é".encode() + b"b" * (mib - 1)  # 'é' straddles the 1 MiB boundary
    at = len(head) + 5  # third chunk: 5 'c', then 0xff
    bad = tmp_path / "far.txt"
    bad.write_bytes(head + b"c" * 5 + b"\xff\n")
    assert at > 2 * mib
    with pytest.raises(DataError, match=rf"far.txt is not valid UTF-8 \(byte offset {at}\)"):
        list(iter_documents(str(bad)))


def test_a_file_cut_inside_its_last_character_says_so(tmp_path):
    """A file whose last character is truncated has no bad byte to point at: the error says it ends inside one."""
    bad = tmp_path / "cut.txt"
    bad.write_bytes(b"fine text " + "é".encode()[:1])
    with pytest.raises(DataError, match=r"cut.txt is not valid UTF-8 \(it ends inside a character\)"):
        list(iter_documents(str(bad)))


def test_hf_rows_that_are_not_text_or_blank_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """An HF row whose field is blank or not a string (None, a number) is no document."""
    rows = [{"text": "one"}, {"text": None}, {"text": 7}, {"text": "  \n"}, {"text": "two"}]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda name, split: rows))
    assert [d.text for d in iter_documents("hf:org/corpus")] == ["one", "two"]


def test_hf_sources_are_loaded_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a locally cached dataset is used: HF_DATASETS_OFFLINE is set before datasets loads."""
    seen = []

    def load_dataset(name: str, split: str) -> list[dict[str, str]]:
        seen.append(os.environ.get("HF_DATASETS_OFFLINE"))
        return [{"text": "one"}]

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    list(iter_documents("hf:org/corpus"))
    assert seen == ["1"]


def test_hf_source_description_names_the_text_field(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another text field of the same HF dataset is other data."""
    rows = [{"text": "a", "body": "b"}]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda name, split: rows))
    assert sources.describe_source("hf:org/c", text_field="text") != sources.describe_source(
        "hf:org/c", text_field="body"
    )


def test_jsonl_suffix_is_matched_without_case(tmp_path):
    """DATA.JSONL is read as JSONL (its text field), not as one text file."""
    path = tmp_path / "DATA.JSONL"
    path.write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    assert [d.text for d in iter_documents(str(path))] == ["one", "two"]


def test_moving_a_file_between_subfolders_changes_the_folder_description(tmp_path):
    """Files of a folder source are named by their path under it, not only their file name."""
    from looplm.data.sources import describe_source

    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    path = tmp_path / "a" / "x.txt"
    path.write_text("same bytes\n")
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    before = describe_source(str(tmp_path))
    path.rename(tmp_path / "b" / "x.txt")
    os.utime(tmp_path / "b" / "x.txt", ns=(1_000_000_000, 1_000_000_000))
    assert describe_source(str(tmp_path)) != before


def test_same_relative_path_in_two_folders_is_two_sources(tmp_path, monkeypatch):
    """A relative source is described by its resolved path: 'data.txt' typed in two working folders
    (same size and mtime) must not share a token cache."""
    from looplm.data.sources import describe_source

    descs = []
    for sub in ("one", "two"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "data.txt").write_text("same size\n")
        os.utime(tmp_path / sub / "data.txt", ns=(1_000_000_000, 1_000_000_000))
        monkeypatch.chdir(tmp_path / sub)
        descs.append(describe_source("data.txt"))
    assert descs[0] != descs[1]
