"""lm-evaluation-harness adapter, run offline on a local task YAML over a JSONL file."""

import math

import pytest
import torch
from _jobs import write_choice_task

lm_eval = pytest.importorskip("lm_eval", reason="optional extra: pip install -e '.[lm-eval]'")

from looplm.config import ModelConfig  # noqa: E402
from looplm.data import ByteTokenizer  # noqa: E402
from looplm.eval.choice import score_continuation  # noqa: E402
from looplm.eval.harness import LoopLMHarness, stable_id  # noqa: E402
from looplm.model import LoopedLM  # noqa: E402

TOK = ByteTokenizer()


class _Req:
    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def adapter():
    torch.manual_seed(0)
    m = LoopedLM(
        ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    ).eval()
    return LoopLMHarness(model=m, tokenizer=TOK, depth=3, cache="full")


def test_request_types_against_native_forward(adapter):
    m = adapter.model
    ll, greedy = adapter.loglikelihood([_Req("Q: 1+1=", " 2")])[0]
    ids = TOK.encode("Q: 1+1= 2")
    sid = torch.tensor([stable_id("Q: 1+1=")])
    with torch.no_grad():
        logp = torch.log_softmax(m(torch.tensor([ids]), 3, init="seeded", example_ids=sid).logits[0].double(), -1)
    n_ctx = len(TOK.encode("Q: 1+1="))
    ref = sum(float(logp[t - 1, ids[t]]) for t in range(n_ctx, len(ids)))
    assert math.isclose(ll, ref, rel_tol=1e-6)
    # rolling: every token after an end-of-text token
    roll = adapter.loglikelihood_rolling([_Req("abc")])[0]
    x = [TOK.eos_id, *TOK.encode("abc")]
    with torch.no_grad():
        lp = torch.log_softmax(
            m(torch.tensor([x]), 3, init="seeded", example_ids=torch.tensor([stable_id("abc")])).logits[0].double(), -1
        )
    assert math.isclose(roll, sum(float(lp[t - 1, x[t]]) for t in range(1, len(x))), rel_tol=1e-6)
    out = adapter.generate_until([_Req("hi", {"until": ["\n"], "max_gen_toks": 5})])
    assert len(out) == 1 and "\n" not in out[0]


@pytest.mark.slow
def test_simple_evaluate_on_local_yaml(adapter, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [
        {"context": "+1,2=", "choices": ["3", "4"], "gold": 0},
        {"context": "+2,2=", "choices": ["4", "5", "6"], "gold": 0},
        {"context": "+1,1=", "choices": ["2", "7"], "gold": 0},
    ]
    write_choice_task(tmp_path, rows)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    res = simple_evaluate(
        model=adapter,
        tasks=["looplm_choice"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
    )
    acc = res["results"]["looplm_choice"]["acc,none"]
    # independent: the same scores through looplm's own choice scorer
    hits = 0
    for r in rows:
        lls = [
            score_continuation(
                adapter.model, TOK, r["context"], c, depth=3, cache="full", example_id=stable_id(r["context"])
            )[0]
            for c in r["choices"]
        ]
        hits += max(range(len(lls)), key=lambda i: (lls[i], -i)) == r["gold"]
    assert math.isclose(acc, hits / len(rows))
