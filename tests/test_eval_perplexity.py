"""Bits per byte: the summed CE in bits over the UTF-8 bytes of the scored text."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from looplm.data import ByteTokenizer, build_datasets, build_tokenizer
from looplm.eval.perplexity import native_perplexity
from looplm.model import LoopedLM

TEXTS = [
    "Blow, winds, and crack your cheeks! rage! blow!",
    "Ay, every inch a king: when I do stare, see how the subject quakes.",
    "Là où il y a de l'été, naïve café.",
    "Nothing will come of nothing: speak again.",
] * 6


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_bits_per_byte_against_a_direct_count(tmp_path, tiny_model_config, kind):
    folder = tmp_path / "texts"
    folder.mkdir()
    for i, t in enumerate(TEXTS):
        (folder / f"{i:02d}.txt").write_text(t)
    tok = ByteTokenizer() if kind == "byte" else build_tokenizer("bpe", lambda: iter(TEXTS), 300)
    _, val = build_datasets(str(folder), tok, seq_len=24, holdout=0.3, cache_dir=tmp_path / "cache")
    model = LoopedLM(tiny_model_config(vocab_size=tok.vocab_size, max_seq_len=24))
    got = native_perplexity(model, val, [2], batch_size=3, max_sequences=5, tokenizer=tok)[2]
    nats = n_bytes = 0.0
    n_targets = n_ignored = 0
    with torch.no_grad():
        for i in range(min(5, len(val))):
            b = val.get_batch([i])
            logits = model(
                b.inputs, 2, doc_ids=b.doc_ids, positions=b.positions, init="seeded", example_ids=b.example_ids
            ).logits
            keep = b.targets[0] != -100
            n_targets, n_ignored = n_targets + int(keep.sum()), n_ignored + int((~keep).sum())
            nats += F.cross_entropy(logits[0][keep], b.targets[0][keep], reduction="sum").item()
            ids = b.targets[0][keep].tolist()
            # bytes of the scored text, written out per tokenizer: raw byte ids; BPE pieces decoded one run
            n_bytes += sum(1 for t in ids if t < 256) if kind == "byte" else len(tok.decode(ids).encode())
    assert n_bytes > 0
    assert got["bits_per_byte"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)
    assert n_ignored > 0  # targets that are no token (past a document's end): not counted
    assert got["tokens"] == n_targets
    assert got["loss"] == pytest.approx(nats / n_targets, rel=1e-5)


def test_scored_bytes_count_each_target_bytes_once(tmp_path):
    """bits per byte divides by the bytes the scored targets add: with the byte tokenizer, one per
    byte target, also for a byte of an accented character whose first byte is not a target (a
    decode would make it U+FFFD, 3 bytes); end-of-text adds none."""
    from looplm.eval.perplexity import scored_bytes

    (tmp_path / "t").mkdir()
    for i in range(8):
        (tmp_path / "t" / f"{i:02d}.txt").write_text("été à la plage, où ça? " * 3)
    tok = ByteTokenizer()
    _, val = build_datasets(str(tmp_path / "t"), tok, seq_len=25, holdout=0.5, cache_dir=tmp_path / "c")
    want = 0
    for i in range(len(val)):
        targets = val.get_batch([i]).targets[0].tolist()
        want += sum(1 for t in targets if 0 <= t < 256)
    assert scored_bytes(val, len(val), tok) == want


def test_progress_reports_each_batch_with_its_depth(tmp_path, tiny_model_config):
    """`progress(depth)` once per batch and depth: a batch at R costs about R batches at 1, so the
    caller's bar advances by the depth."""
    (tmp_path / "t").mkdir()
    for i in range(6):
        (tmp_path / "t" / f"{i}.txt").write_text(TEXTS[i])
    tok = ByteTokenizer()
    _, val = build_datasets(str(tmp_path / "t"), tok, seq_len=24, holdout=0.5, cache_dir=tmp_path / "c")
    n = min(5, len(val))
    assert n >= 3
    calls = []
    model = LoopedLM(tiny_model_config(vocab_size=tok.vocab_size, max_seq_len=24))
    native_perplexity(model, val, [1, 3], batch_size=2, max_sequences=5, progress=calls.append)
    batches = -(-n // 2)
    assert calls == [1] * batches + [3] * batches
