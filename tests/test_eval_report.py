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
    """Mutant ev-span-ge: P + C equal to the rows' length fits; one more token does not."""
    from looplm.eval.report import EvalConfig

    EvalConfig(cacheeval_span=(40, 24)).check_span(64)
    with pytest.raises(ValueError, match=r"--cacheeval-span: P \+ C = 65 tokens do not fit the data's rows of 64"):
        EvalConfig(cacheeval_span=(40, 25)).check_span(64, prefix="--")


def test_the_default_sample_prompt_is_the_first_line_of_the_first_held_out_document():
    """Mutants ev-prompt-32 (the whole held-out split decoded, not 32 tokens) and ev-prompt-line (the
    32 tokens given, not their first line): a first line and its newline; a first line longer than 32
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
    """BUG (fails on the current source): the held-out split packs documents back to back, each followed
    by eos (looplm.data.packing). A first document shorter than 32 tokens without a newline gave its 32
    tokens read on into the next document, and decode skips the eos, so the prompt glued two documents
    ("HiNext document\\n"). The prompt is the first document's text only."""
    from types import SimpleNamespace

    import numpy as np

    from looplm.data import ByteTokenizer
    from looplm.data.record import DataRecord
    from looplm.eval.report import EvalConfig, sample_prompt_for

    tok = ByteTokenizer()
    docs = [tok.encode("Hi") + [tok.eos_id], tok.encode("Next document\n") + [tok.eos_id]]
    val = SimpleNamespace(tokens=np.array(docs[0] + docs[1]), doc_starts=np.array([0, len(docs[0])]))
    assert sample_prompt_for(EvalConfig(), DataRecord(source="/corpora/held.txt"), val, tok) == "Hi"
