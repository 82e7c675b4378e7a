"""Tests for looplm.data.tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from looplm.data import BPETokenizer, ByteTokenizer, build_tokenizer, load_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Looped models reuse the same block many times.",
    "Fixed points, recurrences and depth: héllo wörld, 日本語, emoji 🙂.",
] * 20


def test_byte_round_trip_non_ascii() -> None:
    tok = ByteTokenizer()
    text = "héllo 日本 🙂\n<eos>"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (258, 256, 257)


def test_byte_decode_skips_specials_and_replaces_invalid() -> None:
    tok = ByteTokenizer()
    assert tok.decode([104, 256, 105, 257]) == "hi"
    # A lone continuation byte is invalid UTF-8.
    assert tok.decode([104, 0x80, 105]) == "h\ufffdi"


def test_byte_save_load(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    tok.save(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {"type": "byte"}
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, ByteTokenizer)
    assert loaded.fingerprint() == tok.fingerprint()


def test_bpe_train_round_trip_and_save_load(tmp_path: Path) -> None:
    tok = BPETokenizer.train(CORPUS, vocab_size=320)
    assert 258 <= tok.vocab_size <= 320
    assert tok.eos_id != tok.pad_id
    for text in CORPUS[:3] + ["unseen bytes: ж ✓ \t\n"]:
        ids = tok.encode(text)
        assert tok.eos_id not in ids
        assert tok.decode(ids) == text
    # The literal text "<eos>" is text, not the special token.
    assert tok.eos_id not in tok.encode("a <eos> b")
    assert tok.decode(tok.encode("a <eos> b")) == "a <eos> b"
    assert tok.decode(tok.encode("ab") + [tok.eos_id, tok.pad_id]) == "ab"

    tok.save(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {"type": "bpe"}
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, BPETokenizer)
    assert loaded.fingerprint() == tok.fingerprint()
    assert loaded.encode(CORPUS[2]) == tok.encode(CORPUS[2])
    assert tok.fingerprint() != ByteTokenizer().fingerprint()


def test_bpe_from_file_requires_special_tokens(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<eos>"], show_progress=False)
    backend.train_from_iterator(CORPUS, trainer=trainer)
    path = tmp_path / "tokenizer.json"
    backend.save(str(path))
    with pytest.raises(ValueError, match="<pad>"):
        BPETokenizer.from_file(path)


def test_build_tokenizer_specs(tmp_path: Path) -> None:
    assert isinstance(build_tokenizer("byte", None, 0), ByteTokenizer)
    bpe = build_tokenizer("bpe", lambda: iter(CORPUS), 300)
    assert isinstance(bpe, BPETokenizer)
    bpe.save(tmp_path)
    from_path = build_tokenizer(str(tmp_path / "tokenizer.json"), None, 0)
    assert from_path.fingerprint() == bpe.fingerprint()
    with pytest.raises(ValueError):
        build_tokenizer("bpe", None, 300)
    with pytest.raises(ValueError, match="unknown tokenizer spec"):
        build_tokenizer(str(tmp_path / "missing.json"), None, 0)


def test_token_pieces_are_each_tokens_own_bytes() -> None:
    """Concatenated, the pieces of an encoding are the text's UTF-8 bytes, also where a character is
    split across tokens (their `decode` alone gives U+FFFD); special tokens are named."""
    texts = ["héllo wörld, 日本語 🙂", "unseen: ж ✓ 🎉 \t\n", " leading space"]
    byte = ByteTokenizer()
    assert [byte.token_piece(i) for i in (0x68, 0xE6, 256, 257)] == [b"h", b"\xe6", "<eos>", "<pad>"]
    bpe = BPETokenizer.train(CORPUS, vocab_size=320)
    for tok in (byte, bpe):
        for text in texts:
            ids = tok.encode(text)
            assert b"".join(tok.token_piece(i) for i in ids) == text.encode("utf-8"), (tok, text)
        assert (tok.token_piece(tok.eos_id), tok.token_piece(tok.pad_id)) == ("<eos>", "<pad>")
    split = [i for i in bpe.encode("🎉") if bpe.decode([i]) == "\ufffd"]
    assert split and all(isinstance(bpe.token_piece(i), bytes) for i in split)  # really part of a character
    with pytest.raises(ValueError, match="outside"):
        byte.token_piece(258)


def test_sentencepiece_token_pieces_keep_their_words_spaces() -> None:
    """A `▁word` token's piece is " word", the text it adds after other tokens (decoded alone, the
    Metaspace decoder drops a text's first space); pieces after a text's first token spell the rest."""
    from _reference import SP_TEXTS, sentencepiece_tokenizer

    sp = sentencepiece_tokenizer()
    for text in SP_TEXTS:
        ids = sp.encode(text)
        first = sp.decode(ids[:1])
        assert b"".join(sp.token_piece(i) for i in ids[1:]).decode() == text[len(first) :], text
    the, quick = sp.encode("the quick")
    assert (sp.decode([quick]), sp.token_piece(quick), sp.token_piece(the)) == ("quick", b" quick", b" the")
    assert (sp.token_piece(sp.eos_id), sp.token_piece(sp.pad_id)) == ("<eos>", "<pad>")


def test_byte_level_alphabet_is_the_backends() -> None:
    from tokenizers import pre_tokenizers

    from looplm.data.tokenizer import BYTE_LEVEL

    assert sorted(BYTE_LEVEL) == sorted(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(BYTE_LEVEL.values()) == list(range(256))


def test_a_pickled_bpe_tokenizer_keeps_special_token_text_as_text() -> None:
    # the trainer broadcasts its tokenizer to the other ranks by pickling; the backend's
    # encode_special_tokens flag did not survive it, so "<eos>" in text became the EOS id there
    import copy
    import pickle

    tok = BPETokenizer.train(["some text with <eos> in it " * 20], vocab_size=300)
    for other in (pickle.loads(pickle.dumps(tok)), copy.deepcopy(tok)):
        assert other.encode("a<eos>b") == tok.encode("a<eos>b")
        assert tok.eos_id not in other.encode("a<eos>b")
        assert other.fingerprint() == tok.fingerprint()


def test_eos_and_pad_pieces_are_their_names_even_when_not_special() -> None:
    """A foreign tokenizer may add its end and padding tokens as ordinary added tokens: `token_piece`
    still names them (they are looplm's special tokens), while another ordinary added token is its text."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    backend.add_tokens([AddedToken(t, special=False) for t in ("<end>", "<fill>", "<word>")])
    tok = BPETokenizer(backend, eos_token="<end>", pad_token="<fill>")
    assert (tok.token_piece(tok.eos_id), tok.token_piece(tok.pad_id)) == ("<end>", "<fill>")
    assert tok.token_piece(backend.token_to_id("<word>")) == b"<word>"
