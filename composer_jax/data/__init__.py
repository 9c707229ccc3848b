"""Tokenizer, code corpora and the grain pretraining pipeline."""

from composer_jax.data.corpus import (
    CodeCorpus,
    default_code_root,
    list_source_files,
    read_source,
)
from composer_jax.data.pipeline import (
    document_dataset,
    iterator_state_to_json,
    make_pretrain_dataset,
    make_pretrain_iterator,
    restore_iterator_from_json,
)
from composer_jax.data.tokenizer import ByteTokenizer, get_tokenizer

__all__ = [
    "ByteTokenizer",
    "CodeCorpus",
    "default_code_root",
    "document_dataset",
    "get_tokenizer",
    "iterator_state_to_json",
    "list_source_files",
    "make_pretrain_dataset",
    "make_pretrain_iterator",
    "read_source",
    "restore_iterator_from_json",
]
