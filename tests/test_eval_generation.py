import itertools
import json

import pytest
import torch

from looplm.config import ModelConfig
from looplm.data import ByteTokenizer, Example
from looplm.data.tasks import TaskConfig, check_answer, generate_examples
from looplm.eval.generation import (
    GenItem,
    exact_match_generator_tasks,
    exact_match_gsm8k,
    extract_final_number,
    load_gsm8k_jsonl,
    pass_at_k,
)
from looplm.eval.tasks import task_accuracy
from looplm.infer.generate import DepthRule, SamplingConfig, generate
from looplm.model import LoopedLM

CFG = ModelConfig(vocab_size=258, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
NL = 10


@pytest.fixture
def model():
    torch.manual_seed(0)
    m = LoopedLM(CFG).eval()
    with torch.no_grad():  # make "\n" the argmax wherever the (frequent) byte 145 was, so answers end
        w = m.head.weight
        w[[NL, 145]] = w[[145, NL]].clone()
    return m


def native_greedy(model, prompt, depth, example_id, steps):
    """Greedy tokens by repeated native forwards (no cache)."""
    ids = ByteTokenizer().encode(prompt)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids]), depth, init="seeded", example_ids=torch.tensor([example_id])).logits
            t = int(logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
            if t == NL:
                break
    return out


def constructed_examples(model, depth, n=8, steps=6):
    """Task examples whose answers are (or are not) the model's own greedy line: the outcome is known."""
    base = generate_examples(TaskConfig(max_difficulty=2), n, seed=1)
    examples, expected = [], []
    for i, ex in enumerate(base):
        toks = native_greedy(model, ex.prompt, depth, i, steps)
        line = toks[:-1] if toks and toks[-1] == NL else None
        if line and all(33 <= t < 127 for t in line) and i % 3 != 2:
            examples.append(Example(ex.prompt, bytes(line).decode(), ex.kind, ex.difficulty))
            expected.append(True)
        else:
            examples.append(Example(ex.prompt, "#wrong", ex.kind, ex.difficulty))
            expected.append(False)
    return examples, expected


@pytest.mark.parametrize(
    "text, want",
    [
        ("The answer is 42.", "42"),
        ("-3", "-3"),
        ("from 5 to -3 degrees", "-3"),
        ("It costs $1,234 in total", "1234"),
        ("pay 3.50 now", "3.5"),
        ("2.0", "2"),
        ("1,234,567.50", "1234567.5"),
        ("values 1, 2, 3", "3"),
        ("no digits here", None),
        ("", None),
        ("x=7\n#### 18", "18"),
        ("#### 5 apples (from 2 baskets)", "5"),  # the answer mark wins over numbers after it
        ("#### 72\nQuestion 2: how many", "72"),
        ("#### none\nso 4", "4"),  # no number after the mark: the last number
        ("1,2345", "2345"),  # not a thousands group: no '5' cut off a number
        ("#### 3 first try\n#### 5", "5"),  # the last answer mark, not the first
        ("#### .5", "0.5"),  # a bare fraction was read as 5
        ("it is -.25 now", "-0.25"),
        ("is 42.5.", "42.5"),
    ],
)
def test_extract_final_number(text, want):
    assert extract_final_number(text) == want


def brute_pass_at_k(n, c, k):
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_brute_force():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 0)


def test_generator_tasks_full_cache_matches_native_and_task_accuracy(model, single_thread):
    depth = 2
    examples, expected = constructed_examples(model, depth)
    assert any(expected) and not all(expected), "the constructed case should mix right and wrong answers"
    out = exact_match_generator_tasks(
        model, ByteTokenizer(), examples, depth=depth, cache="full", max_new_tokens=8, batch_size=3
    )
    assert out["correct"] == expected
    assert out["n"] == len(examples)
    assert out["acc"] == pytest.approx(sum(expected) / len(expected))
    ref = task_accuracy(model, ByteTokenizer(), examples, [depth])[depth]
    assert out["acc"] == pytest.approx(ref["acc"])
    assert out["by_kind"] == pytest.approx(ref["by_kind"])


def test_generator_tasks_independent_of_batching(model, single_thread):
    examples = generate_examples(TaskConfig(max_difficulty=2), 6, seed=3)
    runs = [
        exact_match_generator_tasks(model, ByteTokenizer(), examples, depth=2, max_new_tokens=6, batch_size=b)
        for b in (1, 4, 16)
    ]
    assert runs[0]["outputs"] == runs[1]["outputs"] == runs[2]["outputs"]
    assert runs[0]["correct"] == runs[1]["correct"] == runs[2]["correct"]


def test_generator_tasks_matches_generate(model, single_thread):
    # one example alone gets example id 0, exactly as `generate` numbers a single prompt
    examples = generate_examples(TaskConfig(max_difficulty=2), 4, seed=5)
    for ex in examples:
        for mode in ("terminal", "full"):
            mine = exact_match_generator_tasks(model, ByteTokenizer(), [ex], depth=3, cache=mode, max_new_tokens=6)
            text = generate(
                model,
                ByteTokenizer(),
                [ex.prompt],
                DepthRule(3),
                cache=mode,
                sampling=SamplingConfig(max_new_tokens=6, stop=("\n",)),
            )[0]
            assert mine["outputs"] == [text]
            assert mine["correct"] == [check_answer(ex, text)]


def test_gsm8k_exact_match(model, monkeypatch, single_thread):
    import looplm.eval.generation as gen

    items = [GenItem("q1", "... #### 12", "12"), GenItem("q2", "#### 1,000", "1000"), GenItem("q3", "#### 5", "5")]
    replies = {
        "Question: q1\nAnswer:": "so 3*4 = 12.",
        "Question: q2\nAnswer:": "It is 1,000.00",
        "Question: q3\nAnswer:": "no idea",
    }
    monkeypatch.setattr(gen, "greedy_generate", lambda m, t, prompts, ids, **kw: [replies[p] for p in prompts])
    out = exact_match_gsm8k(model, ByteTokenizer(), items, depth=1)
    assert out["correct"] == [True, True, False]
    assert out["acc"] == pytest.approx(2 / 3)
    assert out["predictions"] == ["12", "1000", None]


def test_gsm8k_runs_on_model(model, single_thread):
    out = exact_match_gsm8k(model, ByteTokenizer(), [GenItem("1+1?", "#### 2", "2")], depth=2, max_new_tokens=8)
    assert out["n"] == 1 and out["acc"] in (0.0, 1.0)


def test_load_gsm8k_jsonl(tmp_path):
    p = tmp_path / "gsm.jsonl"
    p.write_text(
        json.dumps({"question": "How many?", "answer": "2+2=4\n#### 1,234"})
        + "\n\n"
        + json.dumps({"question": "Q", "answer": "#### -3.50"})
        + "\n"
    )
    items = load_gsm8k_jsonl(p)
    assert [it.gold for it in items] == ["1234", "-3.5"]
    assert items[0].question == "How many?"


@pytest.mark.parametrize(
    "line, msg",
    [
        ("not json", "invalid JSON"),
        (json.dumps({"question": "Q"}), "missing field 'answer'"),
        (json.dumps({"answer": "#### 1"}), "missing field 'question'"),
        (json.dumps({"question": "Q", "answer": "42"}), "no '####"),
        (json.dumps({"question": "Q", "answer": "#### many"}), "not a number"),
        (json.dumps({"question": 3, "answer": "#### 1"}), "must be a string"),
        (json.dumps({"question": "Q", "answer": 5}), "'answer' must be a string"),
    ],
)
def test_load_gsm8k_jsonl_errors(tmp_path, line, msg):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"question": "Q", "answer": "#### 1"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=msg) as err:
        load_gsm8k_jsonl(p)
    assert f"{p}:2" in str(err.value)


def _replayed_lines(model, prompts, prefill, depth, n, stop=("\n",)) -> list[str]:
    """Greedy continuations decoded by hand (`_reference.greedy_replay`, terminal cache, example id =
    the prompt's index), cut before the first stop string."""
    from _reference import greedy_replay

    tok, out = ByteTokenizer(), []
    for i, prompt in enumerate(prompts):
        ids, _ = greedy_replay(model, "terminal", tok.encode(prompt), n, prefill, depth, eos=tok.eos_id, example_id=i)
        text = tok.decode(ids)
        cut = min([text.index(s) for s in stop if s in text], default=len(text))
        out.append(text[:cut])
    return out


def test_generator_tasks_prefill_at_prefill_depth_or_by_the_prefill_arm(single_thread):
    """The prompt is prefilled at prefill_depth (or by the `prefill` arm: r1 is one recurrence), the
    answer decoded at depth: the outputs equal a decode by hand (`_models.decisive_model`, whose text
    the prefill depth changes)."""
    from _models import decisive_model

    from looplm.infer.prefill import Prefill

    model = decisive_model()

    examples = generate_examples(TaskConfig(max_difficulty=2), 4, seed=3)
    prompts = [ex.prompt for ex in examples]
    tok = ByteTokenizer()
    at5 = exact_match_generator_tasks(model, tok, examples, depth=2, prefill_depth=5, max_new_tokens=6, batch_size=4)
    assert at5["outputs"] == _replayed_lines(model, prompts, 5, 2, 6)
    r1 = exact_match_generator_tasks(model, tok, examples, depth=3, prefill=Prefill("r1"), max_new_tokens=6)
    assert r1["outputs"] == _replayed_lines(model, prompts, 1, 3, 6)
    assert _replayed_lines(model, prompts, 5, 2, 6) != _replayed_lines(model, prompts, 2, 2, 6)
    assert _replayed_lines(model, prompts, 1, 3, 6) != _replayed_lines(model, prompts, 3, 3, 6)


def test_gsm8k_prefills_at_prefill_depth(single_thread):
    """exact_match_gsm8k hands prefill_depth on: its outputs are the greedy answers decoded by hand with the
    question prefilled at 5 recurrences and the answer at 2 (cut at its stop strings)."""
    from _models import decisive_model

    model = decisive_model()
    items = [GenItem("1+1?", "#### 2", "2"), GenItem("2+3?", "#### 5", "5"), GenItem("10-4?", "#### 6", "6")]
    stop = ("\n\n", "Question:")
    got = exact_match_gsm8k(model, ByteTokenizer(), items, depth=2, prefill_depth=5, max_new_tokens=8, stop=stop)
    prompts = [f"Question: {it.question}\nAnswer:" for it in items]
    assert got["outputs"] == _replayed_lines(model, prompts, 5, 2, 8, stop)
    assert _replayed_lines(model, prompts, 5, 2, 8, stop) != _replayed_lines(model, prompts, 2, 2, 8, stop)


@pytest.mark.parametrize(("answer", "gold"), [("#### .5", "0.5"), ("so #### 18 dollars", "18"), ("#### 1,200", "1200")])
def test_a_gold_answer_is_read_as_a_models_answer_is(tmp_path, answer, gold):
    """The gold came from the whole text after '####' as one number, the prediction from the number rule: a gold
    '.5' (0.5) never matched a prediction that repeats it (read as 5), and '18 dollars' failed to load."""
    p = tmp_path / "g.jsonl"
    p.write_text(json.dumps({"question": "q", "answer": answer}) + "\n")
    (item,) = load_gsm8k_jsonl(p)
    assert item.gold == gold == extract_final_number(answer)


def test_a_final_answer_that_is_not_a_finite_number_is_refused(tmp_path):
    """NaN and infinity parse as Decimals but are no answer: None from normalize_number, a one-line error
    from the loader (infinity used to raise OverflowError, NaN became the gold 'NaN')."""
    from looplm.eval.generation import normalize_number

    for text in ("NaN", "inf", "-Infinity", "sNaN"):
        assert normalize_number(text) is None, text
    for text in ("NaN", "Infinity"):
        p = tmp_path / f"{text}.jsonl"
        p.write_text(json.dumps({"question": "q", "answer": f"so #### {text}"}) + "\n")
        with pytest.raises(ValueError, match="is not a number"):
            load_gsm8k_jsonl(p)


def test_task_accuracy_per_example_by_kind_and_difficulty(model, single_thread):
    """Teacher-forced exact match, example by example, in batches of 3: an answer is right only when
    every answer token and the closing newline are the argmax. Answers come from each example's own
    greedy tokens at its index (its example id): the whole line (right), a proper prefix of it after
    which the model goes on instead of ending the line (wrong: only the newline is missed) or junk."""
    depth = 2
    base = generate_examples(TaskConfig(max_difficulty=3), 12, seed=2)
    examples, expected, prefixes = [], [], 0
    for i, ex in enumerate(base):
        toks = native_greedy(model, ex.prompt, depth, i, 6)
        n = next((k for k, t in enumerate(toks) if not t < 128 or t == NL), len(toks))  # ASCII run before "\n"
        answer, ok = "#wrong", False
        if n < len(toks) and toks[n] == NL and i % 3 != 2:
            answer, ok = bytes(toks[:n]).decode(), True
        elif n < len(toks) and toks[n] != NL and n > 0:
            answer, prefixes = bytes(toks[:n]).decode(), prefixes + 1
        examples.append(Example(ex.prompt, answer, ex.kind, ex.difficulty))
        expected.append(ok)
    assert any(expected) and not all(expected) and prefixes > 0

    def rate(key):
        groups = {}
        for ex, ok in zip(examples, expected):
            groups.setdefault(key(ex), []).append(ok)
        return {k: sum(v) / len(v) for k, v in sorted(groups.items())}

    ids = []

    class Spy:  # records the example ids each forward is given
        cfg = model.cfg

        def __call__(self, x, d, **kw):
            ids.extend(kw["example_ids"].tolist())
            return model(x, d, **kw)

    got = task_accuracy(Spy(), ByteTokenizer(), examples, [depth], batch_size=3)[depth]
    assert ids == list(range(len(examples)))  # each example's index, across batches
    assert got["acc"] == pytest.approx(sum(expected) / len(expected))
    assert got["n"] == len(examples)
    assert got["by_kind"] == pytest.approx(rate(lambda ex: ex.kind))
    assert got["by_difficulty"] == pytest.approx(rate(lambda ex: ex.difficulty))
    assert len(got["by_difficulty"]) > 1


def test_the_gold_follows_the_last_answer_mark(tmp_path):
    """An answer with two '####' marks has the number after the last one as its gold."""
    p = tmp_path / "gsm.jsonl"
    p.write_text(json.dumps({"question": "Q", "answer": "first #### 3, corrected\n#### 7"}) + "\n")
    assert [it.gold for it in load_gsm8k_jsonl(p)] == ["7"]


def test_gsm8k_prompts_with_the_template_given(model, monkeypatch):
    """Each question is put in `prompt_template`."""
    import looplm.eval.generation as gen

    seen = []
    monkeypatch.setattr(
        gen, "greedy_generate", lambda m, t, prompts, ids, **kw: seen.extend(prompts) or ["7"] * len(prompts)
    )
    items = [GenItem("3+4?", "#### 7", "7"), GenItem("2+5?", "#### 7", "7")]
    out = exact_match_gsm8k(model, ByteTokenizer(), items, depth=1, prompt_template="Q: {question}\nA:")
    assert seen == ["Q: 3+4?\nA:", "Q: 2+5?\nA:"] and out["acc"] == 1.0


def test_greedy_generate_without_stop_strings_runs_past_newlines(model, single_thread):
    """`stop=()` cuts nothing, so the text is every greedy token (the native forward's, newlines included) up to
    max_new_tokens."""
    from looplm.eval.generation import greedy_generate

    tok = ByteTokenizer()
    for prompt in ("abc", "Q: 1", "hello", "xyz", "0 1 2"):
        ids, toks = tok.encode(prompt), []
        with torch.no_grad():
            for _ in range(8):
                logits = model(torch.tensor([ids]), 2, init="seeded", example_ids=torch.tensor([0])).logits
                toks.append(int(logits[0, -1].argmax()))
                ids.append(toks[-1])
        if NL in toks[:-1] and tok.eos_id not in toks:
            break
    else:
        pytest.skip("no prompt whose greedy text holds a newline")
    got = greedy_generate(model, tok, [prompt], [0], depth=2, cache="full", max_new_tokens=8, stop=())
    assert got == [tok.decode(toks)] and "\n" in got[0]
