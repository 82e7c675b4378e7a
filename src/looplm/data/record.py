"""The data record of a checkpoint: what its model was trained on, as the commands that read a
checkpoint need it back.

`looplm eval` and `analyze` score the held-out split of this data, `distill` trains its student on
it, `rl` and `generate` draw generator tasks like it (or treat it as text). A checkpoint stores the
record as data.json (`looplm.checkpoint`); a training run's record is read off its job
(`DataRecord.from_job`), which is also how checkpoints written before data.json are read.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .corpus import CORPORA
from .sources import DataError
from .tasks import DEFAULT_TASK_EXAMPLES, Example, TaskConfig, generate_examples

BUILTIN_TEXT = "shakespeare"
"""The held-out text of a checkpoint that does not say what it was trained on (a converted release):
the built-in corpus, so `looplm eval` of such a model measures text perplexity."""
TASKS_SOURCE = "tasks"
Origin = Literal["trained", "converted"]


@dataclass(frozen=True)
class DataRecord:
    """Where a checkpoint's training (or held-out) documents come from and how they were cut."""

    source: str = BUILTIN_TEXT
    """'tasks', a built-in corpus, a text file or folder, a .jsonl, a `looplm tokenize` folder or hf:<name>[:<split>]."""
    seq_len: int = 256
    """Tokens per packed row."""
    holdout: float = 0.05
    """Fraction of documents held out for validation."""
    text_field: str = "text"
    """Field of each JSONL record (or HF dataset row) that holds the text."""
    cache_dir: str = ".cache/looplm"
    """Where memory-mapped token caches are written."""
    n_task_examples: int = DEFAULT_TASK_EXAMPLES
    """Training examples drawn from the generator (source 'tasks')."""
    tasks: TaskConfig = field(default_factory=TaskConfig)
    """Generator tasks and difficulties (source 'tasks')."""
    seed: int = 0
    """Seed of the held-out draw and of the generator (the training seed)."""
    origin: Origin = "trained"
    """'trained' (the data the model learned from) or 'converted' (a released model: `source` is only
    the text held out for evaluation, chosen at conversion)."""
    splits: tuple[int, int, int, int] | None = None
    """How the data split when the run read it: training documents and tokens, held-out documents and
    tokens. The held-out draw depends on the number of documents, so a source that gained or lost one
    (or a `looplm tokenize` folder made again) splits otherwise: a resume refuses it, and the commands
    that read the held-out split say so (`split_change`). None: a record written before this field."""

    @property
    def is_tasks(self) -> bool:
        """Whether the model was trained on the task generator (prompt -> answer lines) rather than text."""
        return self.source == TASKS_SOURCE

    def with_source(self, source: str | None) -> DataRecord:
        """This record with another source (`--data`), or itself for None."""
        return self if source is None else dataclasses.replace(self, source=str(source), splits=None)

    def with_splits(self, train, val) -> DataRecord:
        """This record with the split of the (train, held-out) PackedDatasets a run read."""
        return dataclasses.replace(self, splits=_counts(train, val))

    def split_change(self, train, val) -> str | None:
        """How the (train, held-out) PackedDatasets split otherwise than the record says, or None (also
        for a record that does not say)."""
        if self.splits is None or _counts(train, val) == self.splits:
            return None
        (a, b, c, d), (e, f, g, h) = self.splits, _counts(train, val)
        return (
            f"{self.source} no longer splits as it did when this run started (training {a:,} documents, "
            f"{b:,} tokens; held out {c:,}, {d:,}); now {e:,}, {f:,}; {g:,}, {h:,}"
        )

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["tasks"]["kinds"] = list(self.tasks.kinds)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> DataRecord:
        """The record of a data.json; a field it lacks has its default, an unknown one is refused."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DataError(f"unknown data record fields {unknown}")
        values = dict(data)
        if "tasks" in values:
            values["tasks"] = _task_config(values["tasks"])
        if values.get("splits") is not None:
            values["splits"] = tuple(int(n) for n in values["splits"])
        if values.get("origin", "trained") not in ("trained", "converted"):
            raise DataError(f"unknown data record origin {values['origin']!r}")
        return cls(**values)

    @classmethod
    def from_job(cls, job: dict, origin: Origin = "trained") -> DataRecord:
        """The record of a training job's dict (`TrainJob.to_dict()`: its data section and training seed),
        with a local source and the cache folder made absolute against the working folder: the commands
        that read the record back may run from another one."""
        try:
            data, seed = job["data"], job["train"]["seed"]
            return cls(
                source=absolute_source(str(data["source"])),
                seq_len=int(data["seq_len"]),
                holdout=float(data["holdout"]),
                text_field=str(data["text_field"]),
                cache_dir=os.path.abspath(str(data["cache_dir"])),
                n_task_examples=int(data["n_task_examples"]),
                tasks=_task_config(data["tasks"]),
                seed=int(seed),
                origin=origin,
            )
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"the job does not record its data ({type(err).__name__}: {err})") from None

    # -- reading the data back ---------------------------------------------------------------------
    def datasets(self, tokenizer, seq_len: int | None = None):
        """(train, held-out) PackedDatasets of this data, in rows of `seq_len` tokens (default: the record's)."""
        from .datasets import build_datasets

        return build_datasets(
            self.source,
            tokenizer,
            seq_len=seq_len or self.seq_len,
            holdout=self.holdout,
            cache_dir=Path(self.cache_dir),
            text_field=self.text_field,
            task_config=self.tasks,
            n_task_examples=self.n_task_examples,
            seed=self.seed,
        )

    def checked_datasets(self, tokenizer, seq_len: int | None = None):
        """`datasets`, with a warning line on stderr where the data no longer splits as the record says: the
        held-out documents may then include ones the model trained on."""
        train, val = self.datasets(tokenizer, seq_len)
        change = self.split_change(train, val)
        if change is not None:
            print(f"warning: {change}: its held-out documents may include ones the model trained on", file=sys.stderr)
        return train, val

    def validation(self, tokenizer, seq_len: int | None = None):
        """The held-out split (a PackedDataset), checked as `checked_datasets` does."""
        return self.checked_datasets(tokenizer, seq_len)[1]

    def held_out_examples(self, n: int, seed: int) -> list[Example]:
        """Up to `n` fresh generator examples (drawn with `seed`) whose prompts the training set does not hold,
        each prompt once (the generator draws some again).
        A `seed` equal to the training seed would draw the training set's first examples (every one of
        them dropped), so that draw takes a seed derived from both instead."""
        return list(_held_out(self, n, seed))  # kept: a progress bar counts them before the report scores them


@functools.lru_cache(maxsize=4)
def _held_out(record: DataRecord, n: int, seed: int) -> tuple[Example, ...]:
    seen = {ex.prompt for ex in generate_examples(record.tasks, record.n_task_examples, record.seed)}
    if seed == record.seed:
        seed = int.from_bytes(hashlib.sha256(f"looplm-held-out-{seed}".encode()).digest()[:8], "little")
    kept = []
    for ex in generate_examples(record.tasks, n, seed):
        if ex.prompt not in seen:  # neither a training prompt nor one drawn again (it would count twice)
            seen.add(ex.prompt)
            kept.append(ex)
    return tuple(kept)


def _counts(train, val) -> tuple[int, int, int, int]:
    return (train.n_docs, train.n_tokens, val.n_docs, val.n_tokens)


def absolute_source(source: str) -> str:
    """An existing local file or folder as an absolute path (against the working folder); the generator, a built-in corpus, hf:<name>
    and a path that does not exist (its error names it as typed) as they are."""
    if source == TASKS_SOURCE or source in CORPORA or source.startswith("hf:") or not os.path.exists(source):
        return source
    return os.path.abspath(source)


def _task_config(data) -> TaskConfig:
    if isinstance(data, TaskConfig):
        return data
    if not isinstance(data, dict):
        raise DataError(f"the data record's tasks section is not a mapping: {data!r}")
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(TaskConfig)})
    if unknown:
        raise DataError(f"unknown task config fields {unknown} in the data record (written by a newer looplm?)")
    values = dict(data)
    if "kinds" in values:
        values["kinds"] = tuple(values["kinds"])
    return TaskConfig(**values)
