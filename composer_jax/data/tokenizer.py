"""Tokenizers.

The byte tokenizer needs no vocabulary file, so pretraining and evaluation run fully offline and
bits-per-byte is directly comparable across runs.
"""

import numpy as np


class ByteTokenizer:
    """Byte-level tokenizer over UTF-8: ids 0..255 are bytes, then three special tokens."""

    pad_id = 256
    bos_id = 257
    eos_id = 258

    @property
    def vocab_size(self) -> int:
        return 259

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
        """Returns int32 ids of the UTF-8 bytes of `text`, optionally framed by bos/eos."""
        byte_ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        ids = np.empty(len(byte_ids) + add_bos + add_eos, dtype=np.int32)
        if add_bos:
            ids[0] = self.bos_id
        ids[int(add_bos) : int(add_bos) + len(byte_ids)] = byte_ids
        if add_eos:
            ids[-1] = self.eos_id
        return ids

    def decode(self, ids) -> str:
        """Decodes ids, dropping special tokens; invalid UTF-8 (a cut character) becomes U+FFFD."""
        ids = np.asarray(ids).reshape(-1)
        byte_ids = ids[(ids >= 0) & (ids < 256)].astype(np.uint8)
        return byte_ids.tobytes().decode("utf-8", errors="replace")

    def num_bytes(self, text: str) -> int:
        return len(text.encode("utf-8"))


def get_tokenizer(name: str) -> ByteTokenizer:
    """Looks a tokenizer up by the name used in configs."""
    if name == "byte":
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer {name!r}; available: 'byte'")
