"""The built-in corpus: shipped with the package, lossless scene splitting, a stable cache key."""

from __future__ import annotations

import json

from looplm.data import iter_documents
from looplm.data.corpus import CORPORA, corpus_files, split_scenes
from looplm.data.sources import describe_source

PLAY = (
    """THE PLAY

PERSONS REPRESENTED.
A King.
A Fool.

ACT I.

SCENE I. A heath.

KING.
"""
    + "Blow, winds, and crack your cheeks! " * 8
    + """

Scene 2.--A hovel.

FOOL.
"""
    + "He that has a little tiny wit. " * 8
    + """

ACT 2.

SCENE I. The same.

KING.
"""
    + "Never, never, never, never, never. " * 8
    + """
This scene that I would see is no heading: a heading starts a line with a capital.
"""
)


def test_split_scenes_cuts_at_headings_and_loses_nothing():
    docs = split_scenes(PLAY)
    assert "".join(docs) == PLAY
    # a short front matter and an act heading join the scene that follows them
    assert [d.splitlines()[0] for d in docs] == ["THE PLAY", "Scene 2.--A hovel.", "ACT 2."]
    assert "ACT I.\n\nSCENE I. A heath." in docs[0] and "SCENE I. The same." in docs[2]
    assert all(len(d.strip()) >= 200 for d in docs)


def test_shakespeare_is_installed_and_read_scene_by_scene():
    files = corpus_files("shakespeare")
    assert len(files) == 12 and (CORPORA["shakespeare"] / "SOURCE.md").is_file()
    text = "".join(f.read_text() for f in files)
    assert 1_000_000 < len(text) < 2_000_000
    docs = [d.text for d in iter_documents("shakespeare")]
    assert "".join(docs) == text  # lossless
    assert len(docs) > 150 and all(d.answer_start is None for d in iter_documents("shakespeare"))
    assert any("To be, or not to be" in d for d in docs)


def test_cache_key_is_the_content():
    desc = json.loads(describe_source("shakespeare"))
    assert desc["builtin"] and len(desc["sha256"]) == 64
    assert describe_source("shakespeare") == describe_source("shakespeare")


def test_split_scenes_keeps_a_short_tail():
    """A trailing piece under 200 characters joins the last scene (nothing lost)."""
    from looplm.data.corpus import split_scenes

    text = "ACT 1.\n" + "Enter the king. " * 20 + "\nSCENE 2.\nExeunt.\n"
    docs = split_scenes(text)
    assert "".join(docs) == text
    assert docs[-1].endswith("SCENE 2.\nExeunt.\n")


# -- how the built-in corpus is cut into documents and keyed -----------------------------------------------
def _scene(heading: str, chars: int) -> str:
    """A heading line and speech making a piece of exactly `chars` characters once stripped."""
    body = ("Speak the speech, I pray you. " * 20)[: chars - len(heading) - 1]
    return f"{heading}\n{body}\n"


def test_a_scene_of_exactly_200_characters_is_a_document():
    """A piece of 200 characters (stripped) is long enough to stand alone."""
    text = _scene("ACT 1.", 200) + _scene("SCENE 2.", 300)
    assert len(_scene("ACT 1.", 200).strip()) == 200
    docs = split_scenes(text)
    assert [d.splitlines()[0] for d in docs] == ["ACT 1.", "SCENE 2."] and "".join(docs) == text


def test_a_scene_under_200_characters_joins_the_next_one():
    """A 150-character scene is merged into the scene after it."""
    text = _scene("SCENE 1.", 150) + _scene("SCENE 2.", 300) + _scene("SCENE 3.", 199) + _scene("SCENE 4.", 250)
    docs = split_scenes(text)
    assert [d.splitlines()[0] for d in docs] == ["SCENE 1.", "SCENE 3."] and "".join(docs) == text
    assert docs[0].count("SCENE") == 2 and docs[1].count("SCENE") == 2


def test_a_short_tail_is_not_a_document_of_its_own():
    """What follows the last long scene and is under 200 characters joins that scene, so no document is shorter than 200
    characters."""
    text = _scene("SCENE 1.", 300) + _scene("SCENE 2.", 250) + "SCENE 3.\nExeunt.\n"
    docs = split_scenes(text)
    assert len(docs) == 2 and docs[1].startswith("SCENE 2.") and docs[1].endswith("SCENE 3.\nExeunt.\n")
    assert all(len(d.strip()) >= 200 for d in docs)


def _corpus(monkeypatch, root, files: dict[str, str]) -> None:
    root.mkdir()
    for name, text in files.items():
        (root / name).write_text(text)
    monkeypatch.setitem(CORPORA, "test", root)


def test_the_corpus_is_read_in_file_name_order(tmp_path, monkeypatch):
    """A corpus's files, and so its documents, come in name order, whatever order the folder lists them in (its held-out
    split is drawn over this order)."""
    from looplm.data.corpus import iter_corpus

    names = [f"{c}.txt" for c in "kcjadgfbhie"]
    _corpus(monkeypatch, tmp_path / "c", {n: _scene(f"SCENE {i + 1}.", 250) for i, n in enumerate(names)})
    assert [p.name for p in corpus_files("test")] == sorted(names)
    assert list(iter_corpus("test")) == [(tmp_path / "c" / n).read_text() for n in sorted(names)]


def test_the_corpus_key_covers_file_names_and_contents(tmp_path, monkeypatch):
    """Renaming a file (which changes the name order the documents are read in) changes the corpus's cache key, as
    changing a file's text does."""
    from looplm.data.corpus import describe_corpus

    _corpus(monkeypatch, tmp_path / "c", {"a.txt": _scene("SCENE 1.", 250), "b.txt": _scene("SCENE 2.", 250)})
    before = describe_corpus("test")
    (tmp_path / "c" / "b.txt").rename(tmp_path / "c" / "c.txt")
    renamed = describe_corpus("test")
    assert renamed != before
    (tmp_path / "c" / "c.txt").write_text(_scene("SCENE 3.", 250))
    assert describe_corpus("test") not in (before, renamed)
