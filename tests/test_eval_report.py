"""`looplm eval` on a random tiny run: inputs checked before any measuring, the report's file name per
data source, samples that fit the run's data."""

from __future__ import annotations

import json

import pytest
from _jobs import write_random_run
from test_cli import assert_clean_exit, run_main

pytestmark = pytest.mark.usefixtures("single_thread")
FAST = ["--depths", "1", "--max-sequences", "2", "--sharing-sequences", "0", "--task-examples", "0", "--device", "cpu"]


@pytest.fixture
def text_run(tmp_path):
    return write_random_run(tmp_path / "run", data__source="shakespeare")


@pytest.mark.parametrize(
    ("option", "line", "message"),
    [
        ("--choice-tasks", '{"context": "a", "choices": ["b"], "gold": 0}', "need at least 2 choices"),
        ("--choice-tasks", "not json", "invalid JSON"),
        ("--choice-tasks", "", "no items"),
        ("--gsm8k", '{"question": "1+1?", "answer": "2"}', "no '#### <number>' final answer"),
    ],
)
def test_eval_reads_its_input_files_before_it_measures(text_run, tmp_path, capsys, option, line, message):
    bad = tmp_path / "items.jsonl"
    bad.write_text(line + "\n")
    rc, out, err = run_main(["eval", text_run, *FAST, option, bad], capsys)
    assert_clean_exit(rc, err, looplm_error=True)
    assert f"{option}:" in err and message in err, err
    assert "val ppl" not in out and not list(text_run.glob("eval*.json")), out


def test_samples_of_a_task_run_start_from_a_generator_prompt(tmp_path, capsys):
    """Not the Shakespeare default ("KING." then nothing a task model would write): a prompt of its own data."""
    from looplm.eval.report import EvalConfig

    run = write_random_run(tmp_path / "tasks")
    rc, out, err = run_main(["eval", run, *FAST, "--sample-depths", "1", "--sample-tokens", "4"], capsys)
    assert rc == 0, err
    report = json.loads((run / "eval.json").read_text())
    from looplm.checkpoint import load_data, resolve

    record = load_data(resolve(run))
    prompts = {ex.prompt for ex in record.held_out_examples(50, EvalConfig.task_seed)}
    assert report["samples"]["prompt"] in prompts and "KING" not in out
    from looplm.data.record import DataRecord
    from looplm.eval.report import sample_prompt_for

    assert sample_prompt_for(EvalConfig(), DataRecord(source="shakespeare")) == "KING.\n"
    assert sample_prompt_for(EvalConfig(sample_prompt="Once"), record) == "Once"


def test_eval_on_other_data_keeps_the_runs_report(text_run, tmp_path, capsys):
    """--data other: its own eval-<source>.json beside the run's eval.json, which stays the main report."""
    assert run_main(["eval", text_run, *FAST], capsys)[0] == 0
    main_report = (text_run / "eval.json").read_text()
    held = tmp_path / "my held out"  # a folder: one document per file
    held.mkdir()
    for i in range(4):
        (held / f"doc{i}.txt").write_text("The recurrent model thinks deeper and deeper.\n" * 20)
    rc, out, err = run_main(["eval", text_run, *FAST, "--data", held], capsys)
    assert rc == 0, err
    assert (text_run / "eval.json").read_text() == main_report
    other = text_run / "eval-my-held-out.json"
    assert json.loads(other.read_text())["perplexity"]["1"]["tokens"] > 0 and f"report: {other}" in out
    from looplm.eval.report import report_name

    assert report_name("hf:org/set:test") == "eval-hf-org-set-test.json" and report_name(None) == "eval.json"


def test_a_sample_prompt_is_measured_with_its_bos_token():
    """The samples' prompt was measured without the BOS the decode adds: a prompt of max_seq_len - 1
    text tokens passed the up-front check, then the samples asked for one new token too many (and
    one of max_seq_len tokens, for a prompt that does not fit), after the eval's other work."""
    from _models import decisive_model

    from looplm.data import ByteTokenizer
    from looplm.eval.report import EvalConfig, depth_samples

    class BosBytes(ByteTokenizer):  # a tokenizer that starts every prompt with a BOS
        @property
        def bos_id(self):
            return self.eos_id

    tok, model = BosBytes(), decisive_model(258, max_seq_len=16)
    fits = EvalConfig(depths=(1,), sample_depths=(2,), sample_prompt="x" * 15, sample_tokens=8)
    fits.validate(model.cfg.max_depth, model.cfg.max_seq_len, prefix="--", tokenizer=tok)
    assert depth_samples(model, tok, fits, "cpu")["tokens"] == 1  # 16 tokens with the BOS: one new token
    too_long = EvalConfig(depths=(1,), sample_depths=(2,), sample_prompt="x" * 16, sample_tokens=8)
    with pytest.raises(ValueError, match="does not fit the context max_seq_len=16"):
        too_long.validate(model.cfg.max_depth, model.cfg.max_seq_len, prefix="--", tokenizer=tok)


def test_a_cacheeval_span_may_fill_a_row_exactly():
    """P + C equal to the rows' length fits; one more token does not."""
    from looplm.eval.report import EvalConfig

    EvalConfig(cacheeval_span=(40, 24)).check_span(64)
    with pytest.raises(ValueError, match=r"--cacheeval-span: P \+ C = 65 tokens do not fit the data's rows of 64"):
        EvalConfig(cacheeval_span=(40, 25)).check_span(64, prefix="--")


def test_the_default_sample_prompt_is_the_first_line_of_the_first_held_out_document():
    """A first line and its newline; a first line longer than 32
    tokens is cut at 32; blank text falls back to the built-in speaker line."""
    from types import SimpleNamespace

    import numpy as np

    from looplm.data import ByteTokenizer
    from looplm.data.record import DataRecord
    from looplm.eval.report import TEXT_SAMPLE_PROMPT, EvalConfig, sample_prompt_for

    tok, record = ByteTokenizer(), DataRecord(source="/corpora/held.txt")

    def val(*docs):
        ids = [tok.encode(d) for d in docs]
        starts = np.cumsum([0] + [len(i) for i in ids[:-1]])
        return SimpleNamespace(tokens=np.concatenate(ids), doc_starts=starts)

    cfg = EvalConfig()
    assert sample_prompt_for(cfg, record, val("First line\nsecond line\n", "other\n"), tok) == "First line\n"
    long = "w" * 40 + "\nnext\n"
    assert sample_prompt_for(cfg, record, val(long, "other\n"), tok) == "w" * 32
    assert sample_prompt_for(cfg, record, val("   \n\n   "), tok) == TEXT_SAMPLE_PROMPT


def test_the_default_sample_prompt_stays_inside_the_first_document():
    """The held-out split packs documents back to back, each followed by eos (looplm.data.packing), and
    decode skips the eos: a first document shorter than 32 tokens without a newline must not read on into
    the next one (a prompt "HiNext document\\n" glued two documents). The prompt is the first document's
    text only."""
    from types import SimpleNamespace

    import numpy as np

    from looplm.data import ByteTokenizer
    from looplm.data.record import DataRecord
    from looplm.eval.report import EvalConfig, sample_prompt_for

    tok = ByteTokenizer()
    docs = [tok.encode("Hi") + [tok.eos_id], tok.encode("Next document\n") + [tok.eos_id]]
    val = SimpleNamespace(tokens=np.array(docs[0] + docs[1]), doc_starts=np.array([0, len(docs[0])]))
    assert sample_prompt_for(EvalConfig(), DataRecord(source="/corpora/held.txt"), val, tok) == "Hi"


def test_validate_refuses_depths_temperatures_spans_and_prompts_that_would_fail_later(tmp_path):
    """Refused before any work: a NaN temperature (`< 0` is False for NaN), sample depths and a prefill depth out of
    range, a GSM8K prompt of exactly max_seq_len tokens (no token left to generate); a CacheEval span filling the
    context exactly is accepted."""
    from looplm.data import ByteTokenizer
    from looplm.eval.report import EvalConfig

    def check(**kw):
        EvalConfig(depths=(1,), **kw).validate(8, 64, prefix="--", tokenizer=ByteTokenizer())

    with pytest.raises(ValueError, match="--sample-temperature: must be >= 0, got nan"):
        check(sample_temperature=float("nan"))
    with pytest.raises(ValueError, match=r"--sample-depths: depth must be in 1\.\.8, got 9"):
        check(sample_depths=(1, 9), sample_prompt="x")
    with pytest.raises(ValueError, match=r"--prefill-depth: depth must be in 1\.\.8, got 0"):
        check(prefill_depth=0)
    with pytest.raises(ValueError, match="--depths: give each depth once, got 1 2 2"):  # R = 2 ran twice, one row
        EvalConfig(depths=(1, 2, 2)).validate(8, 64, prefix="--")
    with pytest.raises(ValueError, match="--output: is a folder; give the report's .json file path"):  # was Errno 21,
        check(output=tmp_path)  # after the whole evaluation
    check(cacheeval_span=(40, 24))  # P + C = max_seq_len fits
    with pytest.raises(ValueError, match="--cacheeval-span: P >= 1 prompt"):
        check(cacheeval_span=(40, 25))
    # "Question: " + q + "\nAnswer:" is 18 + len(q) byte tokens
    for q, fits in (("q" * 45, True), ("q" * 46, False)):
        path = tmp_path / f"{len(q)}.jsonl"
        path.write_text(json.dumps({"question": q, "answer": "#### 1"}) + "\n")
        if fits:
            check(gsm8k=path)
        else:
            with pytest.raises(ValueError, match="--gsm8k: a prompt of 64 tokens leaves no room"):
                check(gsm8k=path)


def test_the_report_hands_each_protocol_its_own_options(tmp_path, monkeypatch):
    """Each measurement of `depth_report` is called with the options meant for it (the sharing table:
    sharing_sequences rows and the CacheEval span; the decoding protocols: each depth, the prefill depth and the cache;
    generation and the prefill arms: generation_examples examples; the prefill arms: sharing_sequences rows; GSM8K: what
    the context leaves after the longest prompt), and the report keeps acc, n and by_kind of generation, acc, acc_norm
    and n of the choice tasks. The measurements are replaced by recorders that answer by their arguments."""
    from types import SimpleNamespace

    import looplm.eval.choice as choice
    import looplm.eval.generation as generation
    import looplm.eval.prefill_arms as prefill_arms
    import looplm.eval.report as report
    from looplm.data import ByteTokenizer
    from looplm.infer.prefill import Prefill

    calls: dict[str, list] = {}

    def recorder(name, answer):
        def record(*args, **kw):
            calls.setdefault(name, []).append((args, kw))
            return answer(*args, **kw)

        return record

    monkeypatch.setattr(report, "native_perplexity", recorder("ppl", lambda *a, **k: {}))
    monkeypatch.setattr(report, "task_accuracy", recorder("tasks", lambda *a, **k: {}))
    monkeypatch.setattr(report, "sharing_table", recorder("sharing", lambda *a, **k: "sharing table"))
    gen = dict(correct=[], outputs=[])
    monkeypatch.setattr(
        generation,
        "exact_match_generator_tasks",
        recorder("gen", lambda m, t, ex, depth, **k: dict(acc=depth / 10, n=len(ex), by_kind={"add": depth}, **gen)),
    )
    monkeypatch.setattr(
        generation, "exact_match_gsm8k", recorder("gsm", lambda m, t, it, depth, **k: dict(acc=depth, n=len(it), **gen))
    )
    monkeypatch.setattr(
        choice,
        "score_choices",
        recorder("choice", lambda m, t, it, depth, **k: dict(acc=depth / 10, acc_norm=depth / 5, n=len(it), items=[1])),
    )
    monkeypatch.setattr(prefill_arms, "prefill_table", recorder("prefill", lambda *a, **k: "prefill table"))

    (tmp_path / "c.jsonl").write_text(json.dumps({"context": "Q:", "choices": ["a", "b"], "gold": 0}) + "\n")
    (tmp_path / "g.jsonl").write_text(json.dumps({"question": "q" * 30, "answer": "#### 1"}) + "\n")
    cfg = report.EvalConfig(
        depths=(1, 3), max_sequences=5, task_examples=7, sharing_sequences=3, cacheeval_span=(8, 6),
        cache="full", prefill_depth=2, generation_examples=4, choice_tasks=tmp_path / "c.jsonl",
        gsm8k=tmp_path / "g.jsonl", gsm8k_max_new_tokens=100,
    )  # fmt: skip
    held_out = {n: [f"example {i} of {n}" for i in range(n)] for n in (4, 7)}
    data = SimpleNamespace(
        is_tasks=True, validation=lambda tok: "val", held_out_examples=lambda n, seed: held_out[n], source="tasks"
    )
    model = SimpleNamespace(cfg=SimpleNamespace(max_seq_len=64))
    got = report.depth_report(model, ByteTokenizer(), data, cfg, prefill=[Prefill("r1")])

    ((args, kw),) = calls["sharing"]
    assert args[1] == "val" and kw["max_sequences"] == 3 and kw["span"] == (8, 6)
    assert got["sharing"] == "sharing table"
    for name in ("gen", "choice", "gsm"):
        assert [kw["depth"] for _, kw in calls[name]] == [1, 3], name
        assert all(kw["prefill_depth"] == 2 and kw["cache"] == "full" for _, kw in calls[name]), name
    assert all(args[2] == held_out[4] for args, _ in calls["gen"])
    assert got["generation"] == {r: {"acc": r / 10, "n": 4, "by_kind": {"add": r}} for r in (1, 3)}
    assert got["choice"] == {r: {"acc": r / 10, "acc_norm": r / 5, "n": 1} for r in (1, 3)}
    assert all(kw["max_new_tokens"] == 64 - (18 + 30) for _, kw in calls["gsm"])  # the prompt is 48 tokens
    assert got["gsm8k"] == {r: {"acc": r, "n": 1} for r in (1, 3)}
    ((args, kw),) = calls["prefill"]
    assert args[3] == held_out[4] and kw["rows"] == 3 and got["prefill"] == "prefill table"


def test_the_reports_samples_start_from_the_held_out_documents_first_line(monkeypatch):
    """`depth_report` gives `sample_prompt_for` the held-out split and the tokenizer, so a text run's
    samples continue its own data's first line, not the built-in Shakespeare speaker line."""
    from types import SimpleNamespace

    import numpy as np

    import looplm.eval.report as report
    from looplm.data import ByteTokenizer

    tok = ByteTokenizer()
    ids = tok.encode("Dear diary,\ntoday it rained.\n") + [tok.eos_id] + tok.encode("Other\n") + [tok.eos_id]
    val = SimpleNamespace(tokens=np.array(ids), doc_starts=np.array([0, 29]))
    data = SimpleNamespace(is_tasks=False, source="/corpora/diary.txt", validation=lambda t: val)
    monkeypatch.setattr(report, "native_perplexity", lambda *a, **k: {})
    monkeypatch.setattr(report, "depth_samples", lambda model, tok, cfg, device, prompt=None: prompt)
    cfg = report.EvalConfig(depths=(1,), task_examples=0, sharing_sequences=0, sample_depths=(1,))
    assert report.depth_report(None, tok, data, cfg)["samples"] == "Dear diary,\n"


def test_the_printed_table_shows_each_depths_own_numbers():
    """The printed table shows each depth's own accuracy, the CacheEval decode column its decode perplexity (not the
    chunk's terminal one), and each sample after its prompt."""
    from looplm.eval.report import format_report

    report = {
        "perplexity": {1: {"ppl": 10.0, "state_change": 0.5}, 4: {"ppl": 5.0, "state_change": 0.125}},
        "tasks": {1: {"acc": 0.25, "by_kind": {"add": 0.5}}, 4: {"acc": 0.75, "by_kind": {"add": 1.0}}},
        "sharing": {
            4: {
                "tokens": 10,
                "span": [8, 6],
                "full_ppl": 2.0,
                "terminal_ppl": 3.0,
                "sharing_penalty": 50.0,
                "cacheeval_terminal_ppl": 7.0,
                "cacheeval_penalty": 250.0,
            }
        },  # fmt: skip
        "samples": {"prompt": "KING.\n", "temperature": 0.8, "tokens": 3, "seed": 1, "by_depth": {1: "abc", 4: "xyz"}},
    }
    lines = format_report(report).splitlines()
    rows = [line.split() for line in lines if line.split()[:1] in (["1"], ["4"])]
    assert rows[0] == ["1", "10.0000", "0.5000", "25.0%", "50.0%"]
    assert rows[1] == ["4", "5.0000", "0.1250", "75.0%", "100.0%"]
    assert rows[2] == ["4", "2.0000", "3.0000", "50.000%", "7.0000", "250.000%"]
    at = lines.index("--- R = 4 ---")
    assert lines[at + 1 : at + 3] == ["KING.", "xyz"]
