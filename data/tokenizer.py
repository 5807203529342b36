"""Byte-level tokenizer: ids 0..255 are the UTF-8 bytes, 256 is end-of-document.

Nothing to download or train, identical on every machine, and exact on any text. The model pads
the 257-entry vocabulary up to a multiple of `model.make_vocab_size_divisible_by`.
"""

from __future__ import annotations

import functools

import numpy as np
from megatron.core.tokenizers import MegatronTokenizerBase


class ByteTokenizer(MegatronTokenizerBase):
    """The tokenizer object megatron's GPTDataset expects (`eod`, `vocab_size`), over raw bytes."""

    name = "byte-v1"  # part of the data cache key: change it when the encoding changes
    EOD = 256

    def __init__(self):
        super().__init__(path="", config={})
        # megatron hashes this into the names of its cached sample indices
        self.unique_identifiers = {"class": type(self).__name__, "name": self.name}

    def tokenize(self, text: str | bytes) -> np.ndarray:
        """Encode to int32 ids [N]; str is encoded as UTF-8."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def detokenize(self, ids) -> str:
        """Decode ids (EOD becomes a newline, invalid UTF-8 is replaced)."""
        ids = np.asarray(ids)
        out = bytes(int(i) if i < 256 else 10 for i in ids.tolist())
        return out.decode("utf-8", errors="replace")

    @property
    def vocab(self) -> dict[str, int]:
        return {**{f"<0x{i:02X}>": i for i in range(256)}, "<eod>": self.EOD}

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eod(self) -> int:
        return self.EOD

    @property
    def pad(self) -> int:
        # no pad token: megatron then pads with its own sentinel (-1) and masks it out of the loss
        return -1

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("the byte tokenizer has no chat template")


@functools.lru_cache(maxsize=None)
def build_tokenizer(name: str) -> ByteTokenizer:
    """The tokenizer named `name`, built once per process (the trainer, the data pipeline and the
    eval all ask for it)."""
    if name != "byte":
        raise ValueError(f"data.tokenizer: unknown tokenizer {name!r} (available: byte)")
    return ByteTokenizer()
