"""The data record of a checkpoint (`looplm.data.record`, `looplm.checkpoint.load_data`): what eval,
analyze, distill and rl read back; checkpoints written before it existed; converted checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _jobs import tiny_job, write_random_run
from test_convert_ouro import make_ouro

from looplm import checkpoint as ckpt
from looplm.analyze.report import AnalyzeConfig
from looplm.cli import main
from looplm.convert import convert_ouro
from looplm.data import ByteTokenizer, TaskConfig
from looplm.data.record import BUILTIN_TEXT, DataRecord
from looplm.model import LoopedLM

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread

CHEAP_EVAL = ["--depths", "1", "--max-sequences", "2", "--sharing-sequences", "0", "--device", "cpu"]


def test_record_of_a_training_job(tmp_path):
    job = tiny_job(tmp_path, data__holdout=0.1, train__seed=3)
    record = DataRecord.from_job(job.to_dict())
    d = job.data
    assert (record.source, record.seq_len, record.holdout, record.text_field, record.cache_dir) == (
        d.source,
        d.seq_len,
        0.1,
        d.text_field,
        str(d.cache_dir),
    )
    assert (record.n_task_examples, record.tasks, record.seed, record.origin) == (
        d.n_task_examples,
        d.tasks,
        3,
        "trained",
    )
    assert DataRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    with pytest.raises(ValueError, match="unknown data record fields"):
        DataRecord.from_dict({**record.to_dict(), "sorce": "tasks"})


def test_checkpoints_store_their_record(tmp_path):
    run = write_random_run(tmp_path / "run", data__source="shakespeare")
    path = ckpt.resolve(run)
    stored = json.loads((path / ckpt.DATA_RECORD).read_text())
    assert (
        DataRecord.from_dict(stored) == ckpt.load_data(run) == DataRecord.from_job(ckpt.read_json(path, "config.json"))
    )
    assert ckpt.load_data(run).source == "shakespeare"
    assert ckpt.DATA_RECORD in ckpt.verify(path)["sha256"]


def test_reading_data_that_splits_otherwise_than_the_record_says_is_warned_of(tmp_path, capsys):
    """A record keeps how its data split (documents and tokens per split, written out here by counting the
    folder's documents); reading the held-out split of a folder that gained a document since warns that it
    may hold trained-on documents. Another source (`--data`) says nothing of the run's split."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"doc{i:02d}.txt").write_text(f"doc {i} " * (10 + i))
    record = DataRecord(source=str(corpus), seq_len=32, cache_dir=str(tmp_path / "cache"))
    train, val = record.datasets(ByteTokenizer())
    assert train.n_docs + val.n_docs == 20  # one document per file
    assert train.n_tokens + val.n_tokens == sum(len(f"doc {i} " * (10 + i)) + 1 for i in range(20))  # + eos
    record = record.with_splits(train, val)
    assert DataRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    record.validation(ByteTokenizer())
    assert "warning" not in capsys.readouterr().err
    (corpus / "doc99.txt").write_text("added since " * 10)
    record.validation(ByteTokenizer())
    err = capsys.readouterr().err
    assert f"warning: {corpus} no longer splits as it did when this run started" in err
    assert "held-out documents may include ones the model trained on" in err
    assert record.with_source(str(corpus)).splits is None


def write_old_checkpoint(folder: Path, job: dict, conversion: dict | None = None) -> Path:
    """A checkpoint folder in the layout written before data records: weights, config.json (the job),
    the tokenizer, conversion.json for a converted one, and the manifest; no data.json."""

    def populate(tmp: Path) -> None:
        torch.manual_seed(0)
        ckpt.save_tensors(tmp, "model.safetensors", LoopedLM(ModelFromJob(job)).state_dict())
        (tmp / "config.json").write_text(json.dumps(job, indent=1, sort_keys=True))
        if conversion is not None:
            (tmp / "conversion.json").write_text(json.dumps(conversion))
        ByteTokenizer().save(tmp)

    return ckpt.write_atomic(folder, populate)


def ModelFromJob(job: dict):  # noqa: N802 - reads like the config it builds
    from looplm.config import ModelConfig

    return ModelConfig.from_dict(job["model"])


def old_job(tmp_path: Path, **overrides) -> dict:
    job = tiny_job(tmp_path, **overrides)
    job.model.vocab_size = ByteTokenizer().vocab_size
    return job.to_dict()


def test_a_checkpoint_written_before_data_records_still_loads_and_evaluates(tmp_path, capsys):
    job = old_job(tmp_path)
    old = write_old_checkpoint(tmp_path / "old", job)
    assert not (old / ckpt.DATA_RECORD).exists()
    model, tokenizer, config = ckpt.load_model(old)
    assert config == job
    record = ckpt.load_data(old)
    assert record == DataRecord.from_job(job)
    assert (record.source, record.tasks) == (
        "tasks",
        TaskConfig(kinds=("add_msd",), min_difficulty=1, max_difficulty=3),
    )
    assert main(["eval", str(old), *CHEAP_EVAL, "--task-examples", "8"]) == 0
    report = json.loads((old / "eval.json").read_text())  # a standalone folder keeps its report
    assert sorted(report["tasks"]) == ["1"]


def test_an_old_converted_checkpoint_holds_out_text_not_the_task_generator(tmp_path):
    """Before data records, `looplm convert` wrote the task generator as the data of every release that was
    not given --data; reading such a checkpoint gives the built-in text instead. A --data it was given stays."""
    provenance = {"from": "ouro", "source": "/releases/Ouro-1.4B"}
    old = write_old_checkpoint(tmp_path / "old", old_job(tmp_path), provenance)
    record = ckpt.load_data(old)
    assert (record.source, record.origin) == (BUILTIN_TEXT, "converted")
    given = write_old_checkpoint(tmp_path / "given", old_job(tmp_path, data__source="/corpora/held.txt"), provenance)
    assert ckpt.load_data(given).source == "/corpora/held.txt"


def test_a_converted_release_is_evaluated_on_text_by_default(tmp_path, monkeypatch, capsys):
    """`looplm eval` of a converted model scored addition accuracy (0.0% everywhere) unless convert had
    --data; now it measures text perplexity on the built-in corpus, and --data chooses other data."""
    monkeypatch.chdir(tmp_path)  # the record's token cache (.cache/looplm) is relative to the working folder
    out = convert_ouro(make_ouro(tmp_path / "ouro"), tmp_path / "converted")
    record = ckpt.load_data(out)
    assert (record.source, record.origin, record.seq_len) == (BUILTIN_TEXT, "converted", 64)
    assert main(["eval", str(out), *CHEAP_EVAL]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["tasks"] is None
    assert report["perplexity"]["1"]["tokens"] > 100  # every token of 2 text rows, not just answer digits
    assert report["perplexity"]["1"]["bits_per_byte"] > 0

    held = tmp_path / "held.jsonl"  # 400 short documents: the held-out split is a few rows
    held.write_text(
        "".join(json.dumps({"text": f"the recurrent model thinks deeper, take {i}."}) + "\n" for i in range(400))
    )
    assert main(["eval", str(out), *CHEAP_EVAL, "--data", str(held), "--output", str(tmp_path / "held.json")]) == 0
    on_held = json.loads((tmp_path / "held.json").read_text())["perplexity"]["1"]
    assert (
        on_held["tokens"] < report["perplexity"]["1"]["tokens"] and on_held["ppl"] != report["perplexity"]["1"]["ppl"]
    )
    assert (
        main(
            [
                "analyze",
                str(out),
                "--data",
                str(held),
                "--horizon",
                "4",
                "--kv-depths",
                "2",
                "--solve-spans",
                "0",
                "--sharing-sequences",
                "0",
                "--no-plots",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    analysis = json.loads((out / "analyze-held.jsonl" / "report.json").read_text())  # other data: its own folder
    assert analysis["data"] == str(held)
    val = record.with_source(str(held)).validation(ckpt.load_model(out)[1])  # a row or two of the held text
    assert len(val) < AnalyzeConfig().sequences < len(record.validation(ckpt.load_model(out)[1]))
    assert analysis["convergence"]["tokens"] == len(val) * 64


@pytest.mark.parametrize("source", ["data/corpus.jsonl", "data/corpus-tok"])
def test_a_relative_data_source_is_read_back_from_another_folder(tmp_path, monkeypatch, source):
    """A run trained with `--data.source data/...` (and the default relative token cache) recorded the
    paths as typed, so `looplm eval` from another folder failed with "data source not found"; the
    record now holds them absolute (the README lets run folders move, not the data)."""
    from looplm.data import tokenize_corpus
    from looplm.train.trainer import Trainer

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "data").mkdir(parents=True)
    elsewhere.mkdir()
    (project / "data" / "corpus.jsonl").write_text(
        "".join(json.dumps({"text": f"a looped model reads document {i} again and again."}) + "\n" for i in range(60))
    )
    monkeypatch.chdir(project)
    if source.endswith("-tok"):
        tokenize_corpus("data/corpus.jsonl", source, holdout=0.1, progress=False)
    job = tiny_job(
        project,
        "run",
        data__source=source,
        data__cache_dir=Path(".cache/looplm"),
        data__holdout=0.1,
        train__steps=1,
        model__max_seq_len=32,
        data__seq_len=32,
    )
    Trainer(job).fit()
    record = ckpt.load_data(project / "run")
    assert record.source == str(project / source) and record.cache_dir == str(project / ".cache/looplm")

    monkeypatch.chdir(elsewhere)
    assert main(["eval", str(project / "run"), *CHEAP_EVAL, "--output", str(elsewhere / "eval.json")]) == 0
    assert json.loads((elsewhere / "eval.json").read_text())["perplexity"]["1"]["tokens"] > 0
    # the report and its pictures, no second token cache here
    assert sorted(p.name for p in elsewhere.iterdir() if p.suffix != ".png") == ["eval.json"]


def test_held_out_examples_with_the_training_seed_are_still_fresh():
    # eval draws with EvalConfig.task_seed (1234): a run trained with seed 1234 got no example at all
    from looplm.data import TaskConfig, generate_examples
    from looplm.data.record import DataRecord

    tasks = TaskConfig(kinds=("add",), max_difficulty=3)
    record = DataRecord(source="tasks", tasks=tasks, n_task_examples=500, seed=1234)
    seen = {ex.prompt for ex in generate_examples(tasks, 500, 1234)}
    fresh = record.held_out_examples(100, 1234)
    assert len(fresh) > 50 and not {ex.prompt for ex in fresh} & seen


def test_held_out_examples_hold_each_prompt_once():
    """The generator draws some problems again: each was scored and counted once per draw (asked for 600
    add problems of difficulty <= 3, 389 came back, 386 of them distinct)."""
    from looplm.data import TaskConfig, generate_examples
    from looplm.data.record import DataRecord

    tasks = TaskConfig(kinds=("add",), max_difficulty=3)
    record = DataRecord(source="tasks", tasks=tasks, n_task_examples=500, seed=0)
    drawn = [ex.prompt for ex in generate_examples(tasks, 600, 7)]
    assert len(set(drawn)) < len(drawn), "the generator repeats prompts in this draw"
    got = [ex.prompt for ex in record.held_out_examples(600, 7)]
    seen = {ex.prompt for ex in generate_examples(tasks, 500, 0)}
    assert len(got) == len(set(got)) and not set(got) & seen
    assert got == list(dict.fromkeys(p for p in drawn if p not in seen))  # the first of each, in draw order


def test_a_data_record_with_a_bad_tasks_section_is_a_data_error():
    from looplm.data.record import DataRecord
    from looplm.data.sources import DataError

    base = DataRecord(source="tasks").to_dict()
    for tasks, message in (
        ({**base["tasks"], "extra": 1}, "unknown task config fields"),  # a newer looplm's record
        (["add"], "not a mapping"),
    ):
        with pytest.raises(DataError, match=message):
            DataRecord.from_dict({**base, "tasks": tasks})
    without_kinds = {k: v for k, v in base["tasks"].items() if k != "kinds"}
    assert DataRecord.from_dict({**base, "tasks": without_kinds}).tasks.kinds == DataRecord().tasks.kinds


def test_an_unknown_origin_is_refused():
    """A data.json whose origin is neither 'trained' nor 'converted'."""
    from looplm.data.record import DataRecord
    from looplm.data.sources import DataError

    with pytest.raises(DataError, match="unknown data record origin 'copied'"):
        DataRecord.from_dict({**DataRecord().to_dict(), "origin": "copied"})
    assert DataRecord.from_dict({**DataRecord().to_dict(), "origin": "converted"}).origin == "converted"


def test_validation_rows_take_the_asked_length(tmp_path):
    """`validation(tok, seq_len)` cuts rows of that length."""
    from looplm.data import ByteTokenizer
    from looplm.data.record import DataRecord

    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(8):
        (folder / f"{i}.txt").write_text(f"document {i} " + "a few words of text " * 10)
    record = DataRecord(source=str(folder), seq_len=32, holdout=0.5, cache_dir=str(tmp_path / "cache"))
    assert record.validation(ByteTokenizer()).seq_len == 32
    val = record.validation(ByteTokenizer(), seq_len=12)
    assert val.seq_len == 12 and val.get_batch([0]).inputs.shape == (1, 12)


def test_a_record_dict_equals_its_json_round_trip():
    """to_dict() is what data.json holds: JSON types only (the task kinds a list, not a tuple)."""
    d = DataRecord(source="tasks", tasks=TaskConfig(kinds=("add", "sum"))).to_dict()
    assert d == json.loads(json.dumps(d)) and d["tasks"]["kinds"] == ["add", "sum"]


def test_a_relative_cache_dir_is_made_absolute(tmp_path, monkeypatch):
    """The record's cache folder is absolute against the training folder, so readers elsewhere find it."""
    monkeypatch.chdir(tmp_path)
    job = tiny_job(tmp_path).to_dict()
    job["data"]["cache_dir"] = "rel/cache"
    assert DataRecord.from_job(job).cache_dir == str(tmp_path / "rel" / "cache")
