"""`python -m data.train_tokenizer INPUT... --vocab-size N --output DIR`: a byte-level BPE tokenizer
trained on your own corpus, saved as a Hugging Face tokenizer directory (tokenizer.json +
tokenizer_config.json) that `data.tokenizer=DIR` and `python -m data.prepare --tokenizer DIR` read.

For pretraining from scratch when no existing tokenizer fits the corpus. The inputs are what
`data.prepare` reads (text directories with --glob, jsonl(.gz), parquet, datasets directories);
`--max-bytes` caps how much of them the trainer sees (BPE statistics settle long before a large
corpus is through). Training runs in the `tokenizers` library on every core. The tokenizer gets
an end-of-text token (`<|endoftext|>`, the end of every document) and a beginning-of-text token
(`<|begin_of_text|>`, used with `--add-bos`); every byte is in its alphabet, so any text encodes.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

EOS, BOS = "<|endoftext|>", "<|begin_of_text|>"


def documents(inputs: list[str], glob: str, field: str, column: str, max_bytes: int):
    """The text of the inputs' documents, in data.prepare's order, until `max_bytes` of text."""
    from data.prepare_inputs import iter_chunks, list_sources, read_records

    total = 0
    for chunk in iter_chunks(list_sources(inputs, glob, column), column):
        for text in read_records(chunk, field, column).texts:
            yield text
            total += len(text)
            if total >= max_bytes:
                return


def train(inputs: list[str], out: str, vocab_size: int, glob: str = "**/*", field: str = "text",
          column: str = "text", max_bytes: int = 1 << 30) -> Path:
    """Train the tokenizer on the inputs and save it in `out`. Returns `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, BOS], show_progress=sys.stderr.isatty(),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    seen = [0, 0]

    def counted():
        for text in documents(inputs, glob, field, column, max_bytes):
            seen[0] += 1
            seen[1] += len(text)
            yield text

    t0 = time.perf_counter()
    tok.train_from_iterator(counted(), trainer)
    out = Path(out)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=BOS).save_pretrained(str(out))
    log.info("trained a %d-entry BPE on %d documents (%.1f MB) in %.0f s: %s", tok.get_vocab_size(), seen[0],
             seen[1] / 1e6, time.perf_counter() - t0, out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.train_tokenizer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT")
    p.add_argument("--output", required=True, help="the tokenizer directory to write")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--glob", default="**/*", help="files of a text directory (default: every file)")
    p.add_argument("--field", default="text", help="jsonl: the document's key")
    p.add_argument("--column", default="text", help="parquet / datasets: the document's column")
    p.add_argument("--max-bytes", type=float, default=1e9, help="text to train on, at most (default 1e9)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from data.prepare_inputs import InputError

    if args.vocab_size < 259:
        print(f"error: --vocab-size {args.vocab_size}: at least 259 (256 bytes and 2 special tokens)", file=sys.stderr)
        return 2
    if Path(args.output).exists() and any(Path(args.output).iterdir()):
        print(f"error: --output {args.output} exists and is not empty", file=sys.stderr)
        return 2
    try:
        train(args.inputs, args.output, args.vocab_size, args.glob, args.field, args.column, int(args.max_bytes))
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
