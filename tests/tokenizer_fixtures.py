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
