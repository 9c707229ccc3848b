"""Tokenizers, chat format, document sources and the grain pretraining pipeline.

The tokenizer and chat-format modules import no JAX; the pipeline (grain) is loaded on first use
of its names, so `from composer_jax.data import load_tokenizer` stays light.
"""

import importlib

from composer_jax.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    TokenizerError,
    check_vocab,
    get_tokenizer,
    load_tokenizer,
)

_LAZY = {
    "CodeCorpus": "composer_jax.data.corpus",
    "default_code_root": "composer_jax.data.corpus",
    "list_source_files": "composer_jax.data.corpus",
    "read_source": "composer_jax.data.corpus",
    "document_dataset": "composer_jax.data.pipeline",
    "iterator_state_to_json": "composer_jax.data.pipeline",
    "make_pretrain_dataset": "composer_jax.data.pipeline",
    "make_pretrain_iterator": "composer_jax.data.pipeline",
    "restore_iterator_from_json": "composer_jax.data.pipeline",
    "ChatFormat": "composer_jax.data.chat",
    "chat_format_for": "composer_jax.data.chat",
    "open_documents": "composer_jax.data.sources",
    "JsonlDocuments": "composer_jax.data.sources",
    "ParquetDocuments": "composer_jax.data.sources",
    "ArrayRecordDocuments": "composer_jax.data.sources",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'composer_jax.data' has no attribute {name!r}")


__all__ = [
    "ArrayRecordDocuments",
    "ByteTokenizer",
    "ChatFormat",
    "CodeCorpus",
    "HFTokenizer",
    "JsonlDocuments",
    "ParquetDocuments",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerError",
    "chat_format_for",
    "check_vocab",
    "default_code_root",
    "document_dataset",
    "get_tokenizer",
    "iterator_state_to_json",
    "list_source_files",
    "load_tokenizer",
    "make_pretrain_dataset",
    "make_pretrain_iterator",
    "open_documents",
    "read_source",
    "restore_iterator_from_json",
]
