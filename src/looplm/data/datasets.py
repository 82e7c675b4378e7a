"""The train and validation datasets of a data source: a folder written by `looplm tokenize`
(`looplm.data.pretokenized`), read as it is, or any other source tokenized once into the packed
token cache (`looplm.data.packing`)."""

from __future__ import annotations

from pathlib import Path

from .packing import PackedDataset, prepare_caches
from .pretokenized import is_pretokenized, open_pretokenized
from .sources import DataError
from .tasks import DEFAULT_TASK_EXAMPLES, TaskConfig
from .tokenizer import Tokenizer


def build_datasets(
    source: str,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    holdout: float = 0.05,
    cache_dir: Path = Path(".cache/looplm"),
    text_field: str = "text",
    task_config: TaskConfig | None = None,
    n_task_examples: int = DEFAULT_TASK_EXAMPLES,
    seed: int = 0,
) -> tuple[PackedDataset, PackedDataset]:
    """Train and validation datasets for ``source`` (see :func:`prepare_caches`); a folder written
    by ``looplm tokenize`` is read as it is (its tokenizer must be ``tokenizer``)."""
    if is_pretokenized(source):
        saved, train, val = open_pretokenized(source, seq_len)
        if saved.fingerprint() != tokenizer.fingerprint():
            raise DataError(
                f"{source} was tokenized with another tokenizer ({saved.summary()}) than this run's "
                f"({tokenizer.summary()}); was the folder replaced? `looplm tokenize` with --tokenizer "
                "set to the checkpoint folder writes one this run can read"
            )
        return train, val
    train_dir, val_dir = prepare_caches(
        source,
        tokenizer,
        holdout=holdout,
        cache_dir=cache_dir,
        text_field=text_field,
        task_config=task_config,
        n_task_examples=n_task_examples,
        seed=seed,
    )
    return PackedDataset(train_dir, seq_len), PackedDataset(val_dir, seq_len)
