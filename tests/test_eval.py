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
