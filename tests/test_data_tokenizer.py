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


def _bare_bpe(vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` trained on CORPUS without special tokens (what a tokenizer
    made elsewhere may look like before its own end and padding tokens are added)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return backend


def test_eos_and_pad_pieces_are_their_names_even_when_not_special() -> None:
    """A foreign tokenizer may add its end and padding tokens as ordinary added tokens: `token_piece`
    still names them (they are looplm's special tokens), while another ordinary added token is its text."""
    from tokenizers import AddedToken

    backend = _bare_bpe(300)
    backend.add_tokens([AddedToken(t, special=False) for t in ("<end>", "<fill>", "<word>")])
    tok = BPETokenizer(backend, eos_token="<end>", pad_token="<fill>")
    assert (tok.token_piece(tok.eos_id), tok.token_piece(tok.pad_id)) == ("<end>", "<fill>")
    assert tok.token_piece(backend.token_to_id("<word>")) == b"<word>"


# -- byte-fallback pieces, added tokens, loading a folder, the smallest BPE --------------------------------
def _byte_fallback_tokenizer() -> BPETokenizer:
    """A Llama-style SentencePiece BPE with byte fallback: a character outside its vocabulary encodes as
    the `<0xHH>` tokens of its UTF-8 bytes, and the `▁` of each word is its leading space."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {"<eos>": 0, "<pad>": 1, "<unk>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("\u2581", "h", "i", "e", "l", "o"):
        vocab[piece] = len(vocab)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<eos>", "<pad>", "<unk>"])
    return BPETokenizer(backend)


def test_byte_fallback_pieces_are_their_bytes() -> None:
    """A byte-fallback token's piece is the byte its name spells, so the pieces of a character split into bytes are its
    UTF-8 bytes."""
    tok = _byte_fallback_tokenizer()
    assert not tok._byte_level
    for b in (0x00, 0x0A, 0x41, 0x80, 0xE6, 0xFF):
        assert tok.token_piece(3 + b) == bytes([b])
    ids = tok.encode("hi 日本")
    assert tok.decode(ids) == "hi 日本"
    first = tok.decode(ids[:1])  # the prepended `▁`, which the decoder strips at a text's start
    assert b"".join(tok.token_piece(i) for i in ids[1:]) == "hi 日本"[len(first) :].encode()
    assert sum(3 <= i < 3 + 256 for i in ids) == len("日本".encode())  # both characters fell back to bytes


def test_vocab_size_counts_tokens_added_past_the_models_vocabulary() -> None:
    """Ids of tokens added on top of the BPE vocabulary are token ids too, so vocab_size reaches past the largest of
    them (the embedding must have their rows)."""
    backend = _bare_bpe(280)
    backend.add_special_tokens(["<eos>", "<pad>", "<extra>"])
    tok = BPETokenizer(backend)
    added = [backend.token_to_id(t) for t in ("<eos>", "<pad>", "<extra>")]
    assert tok.vocab_size == max(added) + 1 == 283
    assert max(max(tok.encode(t)) for t in CORPUS[:3]) < tok.vocab_size


def test_a_folder_with_only_a_tokenizer_json_loads(tmp_path: Path) -> None:
    """A folder holding just another tool's tokenizer.json loads as a BPE tokenizer (with looplm's default special
    names)."""
    bpe = BPETokenizer.train(CORPUS, vocab_size=300)
    (tmp_path / "tokenizer.json").write_text(bpe.backend_json)
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, BPETokenizer) and loaded.fingerprint() == bpe.fingerprint()
    assert loaded.encode(CORPUS[2]) == bpe.encode(CORPUS[2])
    with pytest.raises(ValueError, match="no tokenizer_config.json or tokenizer.json"):
        load_tokenizer(tmp_path / "empty")


def test_an_unknown_tokenizer_type_is_refused(tmp_path: Path) -> None:
    """A tokenizer_config.json of another type is a one-line error, never silently another tokenizer."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"type": "sentencepiece"}))
    with pytest.raises(ValueError, match="unknown tokenizer type 'sentencepiece'"):
        load_tokenizer(tmp_path)


def test_bpe_vocab_size_258_is_the_smallest_accepted() -> None:
    """256 bytes and the two special tokens fit in 258 ids (a BPE without merges); 257 is refused."""
    tok = BPETokenizer.train(CORPUS, vocab_size=258)
    assert tok.vocab_size == 258
    assert tok.decode(tok.encode(CORPUS[2])) == CORPUS[2]
    with pytest.raises(ValueError, match="BPE vocab_size must be >= 258"):
        BPETokenizer.train(CORPUS, vocab_size=257)


def test_eos_and_pad_added_as_ordinary_tokens_are_special_in_encode_and_decode() -> None:
    """A foreign tokenizer may add its end and padding tokens as ordinary (non-special) added tokens. looplm
    treats them as its special tokens all the same: their literal names in text stay text (never a document
    boundary in the packed data), and `decode` skips them, as it skips `<eos>`/`<pad>` of its own tokenizers."""
    from tokenizers import AddedToken

    backend = _bare_bpe(300)
    backend.add_tokens([AddedToken(t, special=False) for t in ("<end>", "<fill>")])
    end, fill = backend.token_to_id("<end>"), backend.token_to_id("<fill>")
    tok = BPETokenizer(backend, eos_token="<end>", pad_token="<fill>")
    assert (tok.eos_id, tok.pad_id) == (end, fill)  # the same ids, now special
    ids = tok.encode("a <end> b <fill>")
    assert tok.eos_id not in ids and tok.pad_id not in ids and tok.decode(ids) == "a <end> b <fill>"
    assert tok.decode(tok.encode("ab") + [tok.eos_id, tok.pad_id]) == "ab"


def test_a_tokenizer_whose_named_tokens_were_ordinary_is_told_apart_from_its_file_alone() -> None:
    """Such a tokenizer encodes its end token's name in text differently since looplm makes the token special
    (as text, where it used to be the end id). Token caches and `looplm tokenize` folders are keyed by the
    fingerprint; one keyed by the hash of the file content and names alone (what looplm wrote before) must not
    be reused, so the fingerprint is not that hash. A tokenizer whose named tokens were special keeps it."""
    import hashlib

    from tokenizers import AddedToken

    def content_hash(tok: BPETokenizer) -> str:  # the file content, then the non-default names, as JSON
        names = {"eos_token": "<end>", "pad_token": "<fill>"}
        return hashlib.sha256((tok.backend_json + "\n" + json.dumps(names, sort_keys=True)).encode()).hexdigest()

    fingerprints = {}
    for special in (False, True):
        backend = _bare_bpe(300)
        backend.add_tokens([AddedToken(t, special=special) for t in ("<end>", "<fill>")])
        tok = BPETokenizer(backend, eos_token="<end>", pad_token="<fill>")
        assert (tok.fingerprint() == content_hash(tok)) is special
        fingerprints[special] = tok.fingerprint()
    assert fingerprints[False] != fingerprints[True]  # the file differs in the tokens' flags


def test_a_tokenizer_file_that_truncates_or_pads_encodes_whole_documents() -> None:
    """A tokenizer.json saved with truncation or padding on (as Transformers pipelines often leave it) would cut
    every document to its max_length and pad short ones with supervised pad tokens; looplm packs documents
    itself, so it encodes each whole and unpadded, as the same file without those settings does. Both have
    one fingerprint, so caches written while the file truncated (keyed by its content) are not reused."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    backend = _bare_bpe(300)
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<eos>", "<pad>")])
    ref = HFTokenizer.from_str(backend.to_str())  # the reference: the file without the settings
    backend.enable_truncation(max_length=8)
    backend.enable_padding(length=8, pad_id=backend.token_to_id("<pad>"), pad_token="<pad>")
    tok = BPETokenizer(backend)
    long, short = CORPUS[0] * 3, "hi"
    assert tok.encode(long) == ref.encode(long, add_special_tokens=False).ids and len(tok.encode(long)) > 8
    assert tok.encode(short) == ref.encode(short, add_special_tokens=False).ids and tok.pad_id not in tok.encode(short)
    assert tok.fingerprint() == BPETokenizer(ref).fingerprint()
