"""The decoding core: incremental text with stop strings against decoding the whole sequence at
once, its cost per token, and the one decode-spec check."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from _reference import SP_TEXTS, sentencepiece_tokenizer

from looplm.data import BPETokenizer, ByteTokenizer
from looplm.infer import DepthRule
from looplm.infer.decode import (
    CONTEXT_IDS,
    SamplingConfig,
    TextStream,
    cut_at_stop,
    decode_context,
    probabilities,
    token_vocab,
)
from looplm.model.exits import DepthPlan

TEXTS = ["Hello, world! déjà vu — 東京タワー 🙂 ok.\nNext line", "aaaa bbbb STOP here", "ümlaut ß ∑ x"]


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(TEXTS * 20, vocab_size=300)


def _tokenizer(kind, bpe):
    """byte, byte-level BPE, or SentencePiece-style (`▁` word markers; unknown characters are <unk>)."""
    return {"byte": ByteTokenizer, "bpe": lambda: bpe, "sentencepiece": sentencepiece_tokenizer}[kind]()


def stream_all(tokenizer, ids, stop=()):
    s = TextStream(tokenizer, stop)
    pieces = []
    for t in ids:
        piece, stopped = s.push(t)
        pieces.append(piece)
        if stopped:
            break
    pieces.append(s.finish())
    return pieces, s


@pytest.mark.parametrize("kind", ["byte", "bpe", "sentencepiece"])
def test_pieces_join_into_the_whole_decode(kind, bpe):
    tok = _tokenizer(kind, bpe)
    rng = random.Random(0)
    for text in TEXTS + SP_TEXTS[:2]:
        ids = tok.encode(text)
        pieces, s = stream_all(tok, ids)
        assert "".join(pieces) == s.text == tok.decode(ids)
    # arbitrary id sequences (invalid UTF-8 in the middle, cut characters at the end) decode alike
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        ids = [t for t in ids if t not in (tok.eos_id, tok.pad_id)] or [ord("a")]
        pieces, s = stream_all(tok, ids)
        assert "".join(pieces) == tok.decode(ids), ids


@pytest.mark.parametrize("kind", ["byte", "bpe", "sentencepiece"])
def test_stop_strings_cut_like_the_whole_decode_and_are_never_released(kind, bpe):
    tok = _tokenizer(kind, bpe)
    for text in TEXTS + SP_TEXTS[:3]:
        ids = tok.encode(text)
        for stop in (("STOP",), ("é",), ("world", "ok"), ("\n",), ("zzz",), ("タワ",), (" brown",), ("o",), ("n, t",)):
            pieces, s = stream_all(tok, ids, stop)
            want, hit = cut_at_stop(tok.decode(ids), stop)
            assert "".join(pieces) == want, (text, stop)
            assert s.stopped == hit
            released = ""
            for p in pieces[:-1]:  # before finish: no released text may end in part of a stop string
                released += p
                assert not any(x in released for x in stop)


def test_sentencepiece_words_stream_with_their_spaces():
    """Each `▁word` token releases " word": its space comes from decoding it after the tokens before it
    (a token decoded on its own loses the space), so the pieces read like the text."""
    sp = sentencepiece_tokenizer()
    text = "the quick brown fox jumps over the lazy dog"
    ids = sp.encode(text)
    assert len(ids) == 9 and sp.decode(ids[1:2]) == "quick"  # one token per word; alone, no space
    pieces, s = stream_all(sp, ids)
    assert pieces[:9] == ["the", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog"]
    assert "".join(pieces) == s.text == text
    pieces, s = stream_all(sp, ids, (" fox",))
    assert "".join(pieces) == "the quick brown" and s.stopped


@pytest.mark.parametrize("kind", ["byte", "bpe", "sentencepiece"])
def test_a_reply_decoded_after_its_prompt_joins_into_the_whole_decode(kind, bpe):
    """With the prompt's ids as context, prompt text + streamed pieces = the decode of prompt + reply ids
    (for a SentencePiece tokenizer the reply's first `▁word` keeps its space); byte and BPE tokenizers
    stream exactly what they stream without a context."""
    tok = _tokenizer(kind, bpe)
    rng = random.Random(1)
    for text in TEXTS + SP_TEXTS:
        ids = tok.encode(text)
        for cut in {1, len(ids) // 2, len(ids) - 1} - {0, len(ids)}:
            prompt, reply = ids[:cut], ids[cut:]
            if tok.decode(prompt).endswith("\ufffd"):  # cut inside a character: the random ids' case below
                continue
            for stop in ((), (" ",), ("o",)):
                s = TextStream(tok, stop, context=prompt)
                pieces = [s.push(t)[0] for t in reply if not s.stopped] + [s.finish()]
                want, hit = cut_at_stop(tok.decode(ids)[len(tok.decode(prompt)) :], stop)
                assert tok.decode(ids).startswith(tok.decode(prompt)), (text, cut)
                assert "".join(pieces) == s.text == want and s.stopped == hit, (text, cut, stop)
                assert s.ids == reply[: len(s.ids)]  # `ids` are the reply's alone
                if kind != "sentencepiece":
                    assert pieces == stream_all(tok, s.ids, stop)[0], (text, cut, stop)
    for _ in range(30):  # arbitrary ids, a prompt ending inside a character included
        ids = [
            t
            for t in (rng.randrange(tok.vocab_size) for _ in range(rng.randrange(2, 40)))
            if t not in (tok.eos_id, tok.pad_id)
        ] or [ord("a"), ord("b")]
        cut = rng.randrange(1, len(ids)) if len(ids) > 1 else 1
        s = TextStream(tok, context=ids[:cut])
        pieces = [s.push(t)[0] for t in ids[cut:]] + [s.finish()]
        whole, before = tok.decode(ids), tok.decode(ids[:cut])
        if not before.endswith("\ufffd") and whole.startswith(before):
            assert "".join(pieces) == whole[len(before) :], ids
        else:  # no usable context: the reply decoded on its own
            assert "".join(pieces) == tok.decode(ids[cut:]), ids


def test_a_sentencepiece_reply_keeps_its_first_space_after_the_prompt():
    sp = sentencepiece_tokenizer()
    prompt, reply = sp.encode("a looped model"), sp.encode("the end")
    assert sp.decode(reply[:1]) == "the"  # alone, a text's first space is dropped
    s = TextStream(sp, context=prompt)
    assert s.push(reply[0]) == (" the", False)
    assert s.push(reply[1])[0] == " end" and s.finish() == "" and s.text == " the end"
    assert stream_all(sp, reply)[1].text == "the end"  # without context: the text on its own


def test_a_stop_prefix_and_an_incomplete_character_are_held_back():
    tok = ByteTokenizer()
    s = TextStream(tok, ("STOP",))
    assert s.push(ord("a")) == ("a", False)
    assert s.push(ord("S")) == ("", False)  # may become STOP
    assert s.push(ord("T")) == ("", False)
    assert s.push(ord("x")) == ("STx", False)  # it did not
    e_acute = "é".encode()
    assert s.push(e_acute[0]) == ("", False)  # half a character
    assert s.push(e_acute[1]) == ("é", False)
    for c in "STO":
        s.push(ord(c))
    assert s.push(ord("P")) == ("", True)
    assert s.text == "aSTxé"


class CountingTokenizer(ByteTokenizer):
    """Counts the ids it is asked to decode."""

    decoded = 0

    def decode(self, ids):
        self.decoded += len(ids)
        return super().decode(ids)


def test_a_step_decodes_a_window_not_the_whole_output():
    tok = CountingTokenizer()
    s = TextStream(tok, ("never",))
    for t in ("abc é " * 200).encode():
        s.push(t)
    per_token = tok.decoded / len(s.ids)
    assert per_token < 8, per_token  # decoding the whole output each step would average ~600
    assert s.text == ("abc é " * 200)


def test_depth_rule_checks_once_with_one_message():
    ok = DepthRule(depth=4, prefill_depth=8, exit_tau=0.1, min_depth=2)
    assert ok.check(8) is ok
    assert ok.decode_plan().exit_tau == 0.1 and ok.prefill_plan().exit_tau is None
    assert ok.prefill_plan().depth == 8
    gated = DepthRule(depth=4, exit_gate=0.0)  # the threshold's whole range [0, 1] is allowed
    assert DepthRule(depth=4, exit_gate=1.0).exit_gate == 1.0
    assert gated.prefill_plan().exit_gate == gated.decode_plan().exit_gate == 0.0  # the prompt's tokens exit too
    assert DepthRule(depth=4, exit_gate=0.7).prefill_plan(2) == DepthPlan(2, exit_gate=0.7)
    cases = [
        (DepthRule(depth=9), {}, "depth must be in 1..8, got 9"),
        (DepthRule(depth=2, prefill_depth=0), {}, "prefill_depth must be in 1..8, got 0"),
        (DepthRule(depth=2, exit_tau=0.1), dict(cache="full"), "needs the terminal cache"),
        (DepthRule(depth=2, exit_tau=0.1, min_depth=3), {}, "min_depth 3 exceeds"),
        (DepthRule(depth=2), dict(cache="paged"), "unknown cache mode"),
        (DepthRule(depth=2, exit_gate=0.5), {}, "needs a model with an exit gate"),
    ]
    for rule, where, message in cases:
        with pytest.raises(ValueError, match=message):
            rule.check(8, **where)
    for fields, message in (
        (dict(exit_tau=0.0), "exit_tau must be > 0"),
        (dict(min_depth=0), "min_depth must be an integer >= 1"),
        (dict(exit_tau=0.1, min_depth=2.5), "min_depth must be an integer >= 1"),  # was truncated to 2
        (dict(exit_gate=1.5), "exit_gate must be a probability"),
        (dict(exit_tau=0.1, exit_gate=0.5), "choose one exit rule"),
    ):
        with pytest.raises(ValueError, match=message):  # an exit rule no model could run: refused when made
            DepthRule(2, **fields)


def test_cut_at_stop_cuts_at_the_earliest_stop_in_the_text_not_the_first_listed():
    assert cut_at_stop("say ok then world", ("world", "ok")) == ("say ", True)
    assert cut_at_stop("say ok then world", ("ok", "world")) == ("say ", True)
    assert cut_at_stop("nothing here", ("world",)) == ("nothing here", False)


def test_decode_context_keeps_the_prompts_last_ids():
    """The last CONTEXT_IDS ids (what a reply continues), or none when they end inside a character."""
    tok = ByteTokenizer()
    ids = tok.encode("a long prompt of many bytes")
    assert decode_context(tok, ids) == ids[-CONTEXT_IDS:]
    assert decode_context(tok, ids[:3]) == ids[:3]
    assert decode_context(tok, [*ids, "é".encode()[0]]) == []


def test_token_vocab_is_the_smaller_of_the_model_and_the_tokenizer():
    tok = ByteTokenizer()
    for model_vocab in (tok.vocab_size + 62, tok.vocab_size, 50):
        model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=model_vocab))
        assert token_vocab(model, tok) == min(model_vocab, tok.vocab_size)


def test_a_top_k_larger_than_the_vocabulary_keeps_every_token():
    """top_k past the logits' width is every token: softmax(logits / T), by hand."""
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0], [3.0, 1.0, -2.0, 1.5]])
    got = probabilities(logits, SamplingConfig(temperature=0.7, top_k=10))
    e = (logits / 0.7).exp()
    assert torch.allclose(got, e / e.sum(-1, keepdim=True), atol=1e-6)


class CleanUpTokenizer(ByteTokenizer):
    """Bytes whose decode drops the space before "." (as Transformers' clean_up_tokenization_spaces):
    a window's text then need not start with the text of its first ids."""

    def decode(self, ids):
        return super().decode(ids).replace(" .", ".")


def test_a_window_that_rewrites_its_start_is_not_appended():
    """ "a", " ", ".", "b": decoding " ." rewrites the released space, so the window " .b" decodes to ".b",
    which does not extend " "; nothing more may be appended then, and the text is the whole decode."""
    tok = CleanUpTokenizer()
    ids = tok.encode("a .b")
    pieces, s = stream_all(tok, ids)
    assert s.text == "a.b" == tok.decode(ids)


def test_a_stop_string_in_the_text_decoded_at_the_end_cuts_it():
    """The window held back at the end (" .b" does not extend " ") is decoded by `finish`; a stop string
    that only the whole decode "a.b" contains still cuts the text there."""
    tok = CleanUpTokenizer()
    pieces, s = stream_all(tok, tok.encode("a .b"), stop=(".",))
    assert s.text == "a" and s.stopped
