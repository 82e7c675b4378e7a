"""Data layer: tokenizers, procedural tasks, document sources, packing and sampling."""

from .datasets import build_datasets
from .packing import (
    IGNORE_INDEX,
    Batch,
    PackedDataset,
    batch_indices,
    epoch_permutation,
    prepare_caches,
)
from .pretokenized import (
    is_pretokenized,
    open_pretokenized,
    pretokenized_info,
    tokenize_corpus,
)
from .sources import DataError, Document, describe_source, iter_documents
from .tasks import TASKS, Example, TaskConfig, check_answer, generate_examples, get_task
from .tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    build_tokenizer,
    load_tokenizer,
)

__all__ = [
    "IGNORE_INDEX",
    "TASKS",
    "BPETokenizer",
    "Batch",
    "ByteTokenizer",
    "DataError",
    "Document",
    "Example",
    "PackedDataset",
    "TaskConfig",
    "Tokenizer",
    "batch_indices",
    "build_datasets",
    "build_tokenizer",
    "check_answer",
    "describe_source",
    "epoch_permutation",
    "generate_examples",
    "get_task",
    "is_pretokenized",
    "iter_documents",
    "load_tokenizer",
    "open_pretokenized",
    "prepare_caches",
    "pretokenized_info",
    "tokenize_corpus",
]
