"""A real Hugging Face BPE tokenizer for tests, trained here (no download) on the standard
library's sources and saved as a tokenizer directory (tokenizer.json + tokenizer_config.json)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

EOS, BOS = "<|endoftext|>", "<s>"


def make_bpe_tokenizer(out: Path, vocab_size: int = 1000, files: int = 60) -> Path:
    """Train a byte-level BPE of `vocab_size` entries on the first `files` stdlib modules and save
    it in `out` as a Hugging Face tokenizer directory with EOS and BOS tokens. Returns `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, BOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    root = Path(sysconfig.get_paths()["stdlib"])
    tok.train(sorted(str(p) for p in root.glob("*.py"))[:files], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=BOS).save_pretrained(str(out))
    return out


def write_prepared(prefix: Path, texts: list[str], tokenizer) -> Path:
    """A prepared dataset PREFIX.bin/.idx/.json of `texts` (one document each + EOD), written the
    way `python -m data.prepare` writes one, without its command line. Returns the prefix."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from data.prepared import write_metadata

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    tokens = 0
    for ids in tokenizer.tokenize_batch(texts):
        doc = np.append(ids, tokenizer.eod).astype(np.int32)
        builder.add_document(doc, [doc.size])
        tokens += doc.size
    builder.finalize(f"{prefix}.idx")
    path = getattr(tokenizer, "path", None)
    identity = {**tokenizer.identity, "path": str(Path(path).resolve()) if path else "byte"}
    write_metadata(prefix, {"source": ["test"], "tokenizer": identity, "add_bos": False, "documents": len(texts),
                            "tokens": tokens, "skipped": {}})
    return prefix


def stdlib_texts(count: int, offset: int = 0) -> list[str]:
    """The text of `count` standard library modules (sorted by name, from `offset`)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(errors="replace") for p in sorted(root.glob("*.py"))[offset:offset + count]]
