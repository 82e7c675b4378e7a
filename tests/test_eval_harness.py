"""lm-evaluation-harness adapter, run offline on a local task YAML over a JSONL file."""

import math

import pytest
import torch
from _jobs import write_choice_task

lm_eval = pytest.importorskip("lm_eval", reason="optional extra: pip install -e '.[lm-eval]'")

from looplm.config import ModelConfig  # noqa: E402
from looplm.data import ByteTokenizer  # noqa: E402
from looplm.eval.choice import score_continuation, score_tokens  # noqa: E402
from looplm.eval.harness import LoopLMHarness, stable_id  # noqa: E402
from looplm.infer.generate import DepthRule, SamplingConfig, generate  # noqa: E402
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


def _native_logp(m, ids: list[int], depth: int, example_id: int) -> torch.Tensor:
    """log p of every next token of `ids` under the native forward (no cache): [n, V] in float64."""
    with torch.no_grad():
        logits = m(torch.tensor([ids]), depth, init="seeded", example_ids=torch.tensor([example_id])).logits[0]
    return torch.log_softmax(logits.double(), -1)


def test_rolling_windows_follow_lm_evals_contract(adapter):
    """A text longer than the context: lm-eval's windows (context length 1) predict the first L tokens
    after the text-start token, then up to L tokens after the L + 1 - n tokens before them (n of
    them predicted: the last window sees a full context). The adapter cut the text into windows that
    each restarted after a fresh end-of-text token (20 nats off on a 43-token text at L = 16)."""
    m = adapter.model
    L = m.cfg.max_seq_len
    text = "".join(chr(97 + (7 * i) % 26) for i in range(2 * L + 37))  # 2 full windows and a part
    ids, sid = TOK.encode(text), stable_id(text)
    want, done = 0.0, 0
    while done < len(ids):  # the windows written out from lm-eval's docstring
        n = min(L, len(ids) - done)
        ctx = [TOK.eos_id] if done == 0 else ids[done - (L + 1 - n) : done]
        x = ctx + ids[done : done + n]
        logp = _native_logp(m, x[:-1], 3, sid)  # the full cache at one depth: the native forward
        want += sum(float(logp[len(ctx) - 1 + j, x[len(ctx) + j]]) for j in range(n))
        done += n
    got = adapter.loglikelihood_rolling([_Req(text)])[0]
    assert math.isclose(got, want, rel_tol=1e-6), (got, want)


def test_an_empty_context_is_scored_by_the_cached_protocol():
    """An empty context used to go through the native forward at `depth`, whatever `cache` and
    `prefill_depth` said; it is now the text-start token prefilled at prefill_depth, then the
    continuation decoded at depth, as every other request."""
    torch.manual_seed(1)
    m = LoopedLM(
        ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    ).eval()
    cont = "the cat"
    scores = {}
    for cache in ("terminal", "full"):
        for pre in (1, 4):
            harness = LoopLMHarness(model=m, tokenizer=TOK, depth=4, prefill_depth=pre, cache=cache)
            scores[cache, pre] = harness.loglikelihood([_Req("", cont)])[0][0]
            # the same as the context given explicitly as the text-start token
            ids = TOK.encode(cont)
            explicit = score_tokens(
                m, [TOK.eos_id], ids, depth=4, prefill_depth=pre, cache=cache, example_id=stable_id("")
            )
            assert scores[cache, pre] == explicit[0]
    assert len(set(scores.values())) == 4  # the cache and the prefill depth are honoured
    x = [TOK.eos_id, *TOK.encode(cont)]  # full cache, prefill depth = depth: the native forward
    logp = _native_logp(m, x, 4, stable_id(""))
    assert math.isclose(scores["full", 4], sum(float(logp[t - 1, x[t]]) for t in range(1, len(x))), rel_tol=1e-6)


def test_generate_until_keeps_the_last_tokens_of_a_long_context(adapter):
    """A context longer than the model's context crashed the whole lm-eval run (a UserError from the
    prompt check); as lm-eval's own models, it keeps its last max_seq_len - max_gen_toks + 1 tokens."""
    L = adapter.model.cfg.max_seq_len
    context = "".join(chr(97 + (5 * i) % 26) for i in range(L + 8))
    got = adapter.generate_until([_Req(context, {"until": ["\n"], "max_gen_toks": 6})])
    kept = TOK.encode(context)[-(L - 6 + 1) :]
    want = generate(
        adapter.model, TOK, [TOK.decode(kept)], DepthRule(3), cache="full",
        sampling=SamplingConfig(max_new_tokens=6, stop=("\n",)), example_ids=[stable_id(context)],
    )  # fmt: skip
    assert got == want


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


class _Req:
    def __init__(self, *args):
        self.args = args


def _native_continuation(model, ids: list[int], n_ctx: int, example_id: int, vocab: int) -> float:
    """Sum of ln p of ids[n_ctx:] under the native forward, over the first `vocab` ids."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]), 3, init="seeded", example_ids=torch.tensor([example_id])).logits[0]
    lp = torch.log_softmax(logits[:, :vocab].double(), -1)
    return sum(float(lp[t - 1, ids[t]]) for t in range(n_ctx, len(ids)))


def test_the_harness_scores_as_lm_evals_own_models_do():
    """A context's trailing whitespace starts the continuation (with a BPE tokenizer "is " + "Paris"
    would otherwise add no token of its own), a context too long for the model keeps its last tokens,
    and a padded embedding's rows past the tokenizer's ids (here made to win) are no token."""
    from _models import decisive_model

    from looplm.data.tokenizer import BPETokenizer

    bpe = BPETokenizer.train(["The capital of France is Paris. The answer is Paris and Rome."] * 50, 300)
    model = decisive_model(bpe.vocab_size)
    harness = LoopLMHarness(model=model, tokenizer=bpe, depth=3, cache="full", device="cpu")
    ((ll, _),) = harness.loglikelihood([_Req("The answer is ", "Paris")])
    ctx = bpe.encode_prompt("The answer is")
    want = _native_continuation(
        model, bpe.encode_prompt("The answer is Paris"), len(ctx), stable_id("The answer is "), 10**9
    )
    assert abs(ll - want) <= 1e-4

    tok = ByteTokenizer()
    padded = decisive_model(320, max_seq_len=64)
    with torch.no_grad():
        padded.head.weight[258:] = 8 * padded.head.weight[:62]
    harness = LoopLMHarness(model=padded, tokenizer=tok, depth=3, cache="full", device="cpu")
    long = "x" * 70 + "yz"  # 72 tokens: the model holds 64
    ((ll, _),) = harness.loglikelihood([_Req(long, " 2")])
    ids = tok.encode(long + " 2")[-65:]  # the last 63 context tokens and the 2 targets
    assert abs(ll - _native_continuation(padded, ids, 63, stable_id(long), 258)) <= 1e-4
    assert abs(ll - _native_continuation(padded, ids, 63, stable_id(long), 320)) > 1.0  # the padded rows mattered


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (dict(depth=0), "model_args depth must be in 1..64"),
        (dict(prefill_depth=0), "model_args prefill_depth must be in 1..64"),  # read as `depth` in scoring
        (dict(max_gen_toks=0), "model_args max_gen_toks must be >= 1"),  # generated one token
        (dict(max_gen_toks=True), "model_args max_gen_toks must be >= 1"),  # lm-eval reads `true` as True: not 1
        (dict(depth="x"), "model_args depth must be an integer"),
    ],
)
def test_depths_and_lengths_out_of_range_are_refused(adapter, args, message):
    with pytest.raises(ValueError, match=message):
        LoopLMHarness(model=adapter.model, tokenizer=TOK, **args)


class _BosBytes(ByteTokenizer):
    """The byte tokenizer with a beginning-of-text token (byte 2 stands in for it)."""

    @property
    def bos_id(self):
        return 2


def test_rolling_windows_of_a_bos_tokenizer_start_after_bos(adapter):
    """lm-eval's prefix token is the text-start token: BOS when the tokenizer has one (EOS only without):
    the rolling log-likelihood of a short text is the native forward's over the text after BOS."""
    m, tok, text = adapter.model, _BosBytes(), "abc de"
    harness = LoopLMHarness(model=m, tokenizer=tok, depth=3, cache="full")
    got = harness.loglikelihood_rolling([_Req(text)])[0]
    x = [2, *tok.encode(text)]
    logp = _native_logp(m, x[:-1], 3, stable_id(text))
    assert math.isclose(got, sum(float(logp[t - 1, x[t]]) for t in range(1, len(x))), rel_tol=1e-6)


def test_generate_until_takes_a_single_stop_string_whole(adapter):
    """`until` given as one string is one stop string, not a set of characters: a string whose first
    character the greedy text holds (but not the string) stops nothing."""
    sid = stable_id("hi")
    full = generate(
        adapter.model, TOK, ["hi"], DepthRule(3), cache="full",
        sampling=SamplingConfig(max_new_tokens=8), example_ids=[sid],
    )[0]  # fmt: skip
    assert len(full) > 1
    until = full[-1] + "\x01"
    assert until not in full
    assert adapter.generate_until([_Req("hi", {"until": until, "max_gen_toks": 8})]) == [full]
    assert adapter.generate_until([_Req("hi", {"until": [full[-1]], "max_gen_toks": 8})]) == [
        full[: full.index(full[-1])]
    ]


def test_generate_until_caps_max_gen_toks_at_the_model_context(adapter):
    """max_gen_toks past the model's context generates at most max_seq_len tokens after the context's last
    token (what fits), instead of failing the run."""
    L = adapter.model.cfg.max_seq_len
    context = "some context"
    got = adapter.generate_until([_Req(context, {"until": [], "max_gen_toks": 10 * L})])
    want = generate(
        adapter.model, TOK, [context[-1:]], DepthRule(3), cache="full",
        sampling=SamplingConfig(max_new_tokens=L), example_ids=[stable_id(context)],
    )  # fmt: skip
    assert got == want


def test_generate_until_after_an_empty_context_starts_from_the_text_start_token(adapter):
    """The text-start token (EOS here) is the prompt: the greedy tokens of the native forward after it."""
    got = adapter.generate_until([_Req("", {"until": [], "max_gen_toks": 4})])
    ids = [TOK.eos_id]
    for _ in range(4):
        ids.append(int(_native_logp(adapter.model, ids, 3, stable_id(""))[-1].argmax()))
    assert got == [TOK.decode(ids[1:])]
