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
    """Mutant corp-tail-dropped: a trailing piece under 200 characters joins the last scene (nothing lost)."""
    from looplm.data.corpus import split_scenes

    text = "ACT 1.\n" + "Enter the king. " * 20 + "\nSCENE 2.\nExeunt.\n"
    docs = split_scenes(text)
    assert "".join(docs) == text
    assert docs[-1].endswith("SCENE 2.\nExeunt.\n")
