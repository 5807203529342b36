"""Tokenizers: `byte` (the embedded default) or a local Hugging Face tokenizer directory.

`data.tokenizer` names one of them: `byte`, or the path of a directory holding a Hugging Face
tokenizer (`tokenizer.json`, or `tokenizer_config.json` with its vocabulary files, or a
sentencepiece `tokenizer.model`), such as the `tokenizer/` folder a checkpoint conversion writes.
Nothing is downloaded. Both give megatron's GPTDataset what it asks of a tokenizer (`eod`,
`vocab_size`, `unique_identifiers`) and the data pipeline what it needs:

    tokenize(text) -> int32 ids [N]            no special tokens added
    tokenize_batch(texts) -> list of [N_i]     the same for many texts at once (fast path)
    eod, bos                                   end-of-document id; beginning-of-document id or None
    identity                                   what makes two tokenizers the same (see below)

The byte tokenizer: ids 0..255 are the UTF-8 bytes, 256 is end-of-document; nothing to download
or train, identical on every machine, exact on any text. The model pads the 257-entry vocabulary
up to a multiple of `model.make_vocab_size_divisible_by`.

A tokenizer's identity is {"name", "sha256", "vocab_size", "eod", "bos"}: the sha256 hashes its
serialized definition (vocabulary, merges, normalization, pre-tokenization, added tokens) and its
end-of-document id, so the same tokenizer saved twice keeps its identity while any change to
what ids the text becomes changes it. Prepared datasets and checkpoints record it; a run refuses
data or weights made with another tokenizer (data.tokenizer_mismatch=allow overrides).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path

import numpy as np
from megatron.core.tokenizers import MegatronTokenizerBase

log = logging.getLogger(__name__)

BYTE = "byte"
# the files of a Hugging Face tokenizer directory (what conversion copies and checkpoints keep)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "chat_template.jinja")
# files that make a directory loadable on their own (the rest only accompany one of these)
_LOADABLE = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
# the pad id of both tokenizers: megatron's sentinel (megatron.core.datasets.megatron_dataset's
# _PAD_TOKEN_ID), no token of any vocabulary. GPTDataset takes no loss where a label is the
# tokenizer's pad and gives the model id 0 in its place (the retrieval windows' filler)
PAD = -1


class TokenizerError(ValueError):
    """A tokenizer that cannot be used; the message names data.tokenizer's value and the cause."""


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

    def tokenize_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
        return [self.tokenize(t) for t in texts]

    def token_index(self, text: bytes, at: int) -> int:
        """The index, in tokenize(text), of the token holding byte `at`: the byte itself."""
        return at

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
    def bos(self) -> int | None:
        return None

    @property
    def pad(self) -> int:
        return PAD

    @property
    def identity(self) -> dict:
        return {"name": self.name, "sha256": hashlib.sha256(self.name.encode()).hexdigest(),
                "vocab_size": self.vocab_size, "eod": self.eod, "bos": None}

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("the byte tokenizer has no chat template")


class HFTokenizer(MegatronTokenizerBase):
    """A local Hugging Face tokenizer directory, loaded through megatron-core's Hugging Face
    tokenizer class (transformers' AutoTokenizer, no download). Texts are encoded by the fast
    (Rust) tokenizer without special tokens; documents get their end-of-document id (and, when
    asked, a beginning-of-document id) from the data pipeline, not from the tokenizer's template.
    """

    def __init__(self, path: str | Path, eod_token: str | None = None):
        super().__init__(path=str(path), config={})
        self.path = Path(path)
        self._hf = _load_hf(self.path)
        fast = getattr(self._hf.tokenizer, "backend_tokenizer", None)
        if fast is None:
            raise TokenizerError(f"data.tokenizer: {path} loads only as a slow (Python) tokenizer; save it as a "
                                 "fast one (tokenizer.json, e.g. with transformers' save_pretrained)")
        self._fast = fast
        hf = self._hf.tokenizer
        # a checkpoint's copy (msa_model/training/data_setup.py) keeps the name it was recorded with
        self.name = _recorded_name(self.path) or self.path.name
        eod_token = eod_token or hf.eos_token
        if eod_token is None:
            raise TokenizerError(f"data.tokenizer: {path} has no end-of-sequence token; name the token that ends "
                                 "a document with data.eod_token=...")
        eod = hf.convert_tokens_to_ids(eod_token)
        if eod is None or eod == hf.unk_token_id and eod_token != hf.unk_token:
            raise TokenizerError(f"data.eod_token: {eod_token!r} is not a token of {path}")
        self._eod = int(eod)
        self._bos = None if hf.bos_token_id is None else int(hf.bos_token_id)
        self._vocab_size = len(hf)
        digest = hashlib.sha256(self._fast.to_str().encode())
        digest.update(f"eod={self._eod}".encode())
        self._sha256 = digest.hexdigest()
        self.unique_identifiers = {"class": type(self).__name__, "sha256": self._sha256}

    def tokenize(self, text: str | bytes) -> np.ndarray:
        """Encode to int32 ids [N], no special tokens; bytes are decoded as UTF-8 (invalid
        sequences replaced)."""
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
        strings = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
        return [np.asarray(e.ids, dtype=np.int32) for e in self._fast.encode_batch(strings, add_special_tokens=False)]

    def token_index(self, text: bytes, at: int) -> int | None:
        """The index, in tokenize(text), of the token holding byte `at` (at a character's start),
        from the encoding's offsets: a pre-tokenizer may merge it with the text before it (" 4"),
        which tokenizing text[:at] alone would split. None if no token holds it."""
        string = text.decode("utf-8", errors="replace")
        char = len(text[:at].decode("utf-8", errors="replace"))
        return self._fast.encode(string, add_special_tokens=False).char_to_token(char)

    def detokenize(self, ids) -> str:
        return self._fast.decode([int(i) for i in np.asarray(ids).tolist()], skip_special_tokens=False)

    @property
    def vocab(self) -> dict[str, int]:
        return self._hf.tokenizer.get_vocab()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def bos(self) -> int | None:
        return self._bos

    @property
    def pad(self) -> int:
        # the Hugging Face pad token, if any, may be a real token of the text: the sentinel instead
        return PAD

    @property
    def identity(self) -> dict:
        return {"name": self.name, "sha256": self._sha256, "vocab_size": self.vocab_size, "eod": self.eod,
                "bos": self.bos}

    def save(self, out: str | Path) -> Path:
        """Copy this tokenizer's files into the directory `out` (created). Returns `out`."""
        return copy_tokenizer_files(self.path, out)

    def apply_chat_template(self, *args, **kwargs):
        return self._hf.apply_chat_template(*args, **kwargs)


def _recorded_name(directory: Path) -> str | None:
    try:
        return json.loads((directory / "identity.json").read_text())["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def tokenizer_files(directory: str | Path) -> list[Path]:
    """The tokenizer files (TOKENIZER_FILES) present in `directory`."""
    directory = Path(directory)
    return [directory / n for n in TOKENIZER_FILES if (directory / n).is_file()]


def copy_tokenizer_files(src: str | Path, out: str | Path) -> Path:
    """Copy the tokenizer files of directory `src` into `out` (created); returns `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for path in tokenizer_files(src):
        (out / path.name).write_bytes(path.read_bytes())
    return out


def check_tokenizer_dir(path: str | Path) -> str | None:
    """Why `path` cannot be a Hugging Face tokenizer directory (one line), or None. Cheap: looks
    at the files only."""
    path = Path(path)
    if not path.exists():
        return f"{path} does not exist (use `byte` or a local Hugging Face tokenizer directory)"
    if not path.is_dir():
        return f"{path} is not a directory (use `byte` or a local Hugging Face tokenizer directory)"
    if not any((path / n).is_file() for n in _LOADABLE):
        if _recorded_name(path) == ByteTokenizer.name:
            # a byte-tokenizer checkpoint's tokenizer folder (identity.json only)
            return f"{path} records the byte tokenizer, which has no files: use `byte`"
        return (f"{path} holds no tokenizer files (expected one of {', '.join(_LOADABLE)}, with "
                "tokenizer_config.json)")
    return None


def _broken_json(directory: Path) -> tuple[Path, str] | None:
    """The first .json file of a tokenizer directory that does not parse, and why."""
    for file in sorted(directory.glob("*.json")):
        try:
            json.loads(file.read_text(errors="replace"))
        except ValueError as e:
            return file, str(e)
    return None


def _load_hf(path: Path):
    from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer

    bad = check_tokenizer_dir(path)
    if bad is not None:
        raise TokenizerError(f"data.tokenizer: {bad}")
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        # include_special_tokens=False: no template tokens (documents get EOD/BOS from the pipeline)
        return HuggingFaceTokenizer(str(path), include_special_tokens=False)
    except Exception as e:  # noqa: BLE001  the tokenizers library raises a bare Exception on a broken file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        broken = _broken_json(path)
        where = f"{broken[0].name} is not valid JSON ({broken[1]})" if broken else first
        raise TokenizerError(f"data.tokenizer: {path} could not be loaded as a Hugging Face tokenizer: {where}") from e
    finally:
        transformers.logging.set_verbosity(verbosity)


@functools.lru_cache(maxsize=None)
def build_tokenizer(spec: str, eod_token: str | None = None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer `spec` names (`byte` or a Hugging Face tokenizer directory), built once per
    process (the trainer, the data pipeline and the eval all ask for it). Raises TokenizerError
    naming the problem."""
    if spec == BYTE:
        if eod_token is not None:
            raise TokenizerError("data.eod_token applies to Hugging Face tokenizers (the byte tokenizer's is 256)")
        return ByteTokenizer()
    return HFTokenizer(spec, eod_token=eod_token)


def identities_match(a: dict | None, b: dict | None) -> bool:
    """Whether two recorded tokenizer identities describe the same tokenizer (vocabulary size and
    hash; the name may differ)."""
    if a is None or b is None:
        return a is b
    return a.get("sha256") == b.get("sha256") and a.get("vocab_size") == b.get("vocab_size")


def describe_identity(identity: dict | None) -> str:
    if identity is None:
        return "none recorded"
    return f"{identity.get('name')} (vocabulary {identity.get('vocab_size')}, sha256 {str(identity.get('sha256'))[:12]})"
