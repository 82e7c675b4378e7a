"""Evaluation helpers against direct references."""

import math

import torch
import torch.nn.functional as F

from looplm.config import ModelConfig
from looplm.data import ByteTokenizer, Example
from looplm.eval.perplexity import native_perplexity
from looplm.eval.tasks import task_accuracy
from looplm.model import LoopedLM


class _Data:
    """A tiny in-memory stand-in for PackedDataset (inputs, targets, no documents)."""

    def __init__(self, tokens):
        self.tokens = tokens

    def __len__(self):
        return self.tokens.shape[0]

    def get_batch(self, idx):
        from looplm.data import Batch

        x = self.tokens[idx]
        return Batch(inputs=x[:, :-1], targets=x[:, 1:], doc_ids=torch.zeros_like(x[:, :-1]),
                     positions=torch.arange(x.shape[1] - 1).expand(len(idx), -1), example_ids=torch.tensor(idx))


def test_native_perplexity_and_state_change_match_a_direct_computation():
    torch.manual_seed(0)
    m = LoopedLM(ModelConfig(vocab_size=20, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)).eval()
    toks = torch.randint(0, 20, (5, 13))
    got = native_perplexity(m, _Data(toks), [1, 3], batch_size=2)
    with torch.no_grad():
        out = m(toks[:, :-1], 3, init="seeded", example_ids=torch.arange(5), return_states=True)
    ce = F.cross_entropy(out.logits.flatten(0, 1), toks[:, 1:].flatten())
    assert math.isclose(got[3]["ppl"], math.exp(ce.item()), rel_tol=1e-5)
    prev, last = out.states[1], out.states[2]
    change = ((last - prev).norm(dim=-1) / prev.norm(dim=-1)).mean().item()
    assert math.isclose(got[3]["state_change"], change, rel_tol=1e-5)
    assert got[1]["state_change"] is None


def test_task_accuracy_equals_greedy_decoding():
    """Teacher-forced argmax over the answer span agrees with greedy decoding of it, per example."""
    torch.manual_seed(1)
    tok = ByteTokenizer()
    m = LoopedLM(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64,
                             max_seq_len=32)).eval()
    examples = [Example(f"+{a},{b}=", str(a + b), "add_msd", 1) for a, b in [(1, 2), (3, 4), (5, 5), (9, 9)]]
    with torch.no_grad():
        greedy = []
        for i, ex in enumerate(examples):
            ids = tok.encode(ex.prompt)
            target = tok.encode(ex.answer + "\n")
            ok = True
            for t in target:
                logits = m(torch.tensor([ids]), 2, init="seeded", example_ids=torch.tensor([i])).logits
                ok &= int(logits[0, -1].argmax()) == t
                ids.append(t)
            greedy.append(ok)
    got = task_accuracy(m, tok, examples, [2], batch_size=3)[2]
    assert got["acc"] == sum(greedy) / len(greedy)


def test_cached_perplexity_full_cache_equals_native_and_penalty_formula(tmp_path):
    from looplm.data import build_datasets
    from looplm.eval.cached import _midpoint_document, cached_perplexity, sharing_table

    tok = ByteTokenizer()
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"{i}.txt").write_text(("the quick brown fox %d jumps. " % i) * (3 + i))
    _, val = build_datasets(str(docs), tok, seq_len=48, holdout=0.5, cache_dir=tmp_path / "cache")
    torch.manual_seed(0)
    m = LoopedLM(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64,
                             max_seq_len=48)).eval()
    full = cached_perplexity(m, val, 3, "full", max_sequences=3)
    # reference: the native forward over each midpoint document, scoring its second part
    total, count = 0.0, 0
    for i in range(min(3, len(val))):
        b = val.get_batch([i])
        start, mid, end = _midpoint_document(b.doc_ids[0])
        with torch.no_grad():
            logits = m(b.inputs[:, start:end], 3, init="seeded", example_ids=b.example_ids).logits
        t = b.targets[:, mid:end]
        total += F.cross_entropy(logits[:, mid - start:].flatten(0, 1), t.flatten(), ignore_index=-100,
                                 reduction="sum").item()
        count += int((t != -100).sum())
    assert count == full["tokens"]
    assert math.isclose(full["ppl"], math.exp(total / count), rel_tol=1e-5)
    table = sharing_table(m, val, [1, 3], max_sequences=3)
    assert table[1]["sharing_penalty"] == 0.0  # at R = 1 the terminal bank is the only bank
    row = table[3]
    assert math.isclose(row["sharing_penalty"], 100 * (row["terminal_ppl"] / row["full_ppl"] - 1))
    assert row["terminal_ppl"] != row["full_ppl"]  # an untrained model at R = 3 does depend on the banks
    assert math.isclose(row["cacheeval_penalty"], 100 * (row["cacheeval_terminal_ppl"] / row["full_ppl"] - 1))
    # one-token decoding with the full cache is the native forward too
    step_full = cached_perplexity(m, val, 3, "full", max_sequences=3, stepwise=True)
    assert math.isclose(step_full["ppl"], full["ppl"], rel_tol=1e-5)
    assert table[1]["cacheeval_penalty"] == 0.0


def test_cacheeval_span_protocol(tmp_path):
    from looplm.data import build_datasets
    from looplm.eval.cached import _document_with_room, cached_perplexity

    assert _document_with_room(torch.tensor([0, 0, 1, 1, 1, 2]), 3) == 2
    assert _document_with_room(torch.tensor([0, 0, 1, 1, 1, 2]), 4) is None
    tok = ByteTokenizer()
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"{i}.txt").write_text("to be or not to be, that is the question. " * 3)
    _, val = build_datasets(str(docs), tok, seq_len=48, holdout=0.5, cache_dir=tmp_path / "cache")
    torch.manual_seed(0)
    m = LoopedLM(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64,
                             max_seq_len=48)).eval()
    got = cached_perplexity(m, val, 2, "full", max_sequences=2, stepwise=True, span=(16, 8))
    total, count = 0.0, 0
    for i in range(2):
        b = val.get_batch([i])
        s = _document_with_room(b.doc_ids[0], 24)
        with torch.no_grad():
            logits = m(b.inputs[:, s:s + 24], 2, init="seeded", example_ids=b.example_ids).logits
        t = b.targets[:, s + 16:s + 24]
        total += F.cross_entropy(logits[:, 16:].flatten(0, 1), t.flatten(), ignore_index=-100, reduction="sum").item()
        count += int((t != -100).sum())
    assert got["tokens"] == count and math.isclose(got["ppl"], math.exp(total / count), rel_tol=1e-5)
