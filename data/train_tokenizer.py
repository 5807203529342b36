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
from collections import Counter
from pathlib import Path

log = logging.getLogger(__name__)

EOS, BOS = "<|endoftext|>", "<|begin_of_text|>"


# without a terminal (no progress bar), a line this often while the text is read
PLAIN_PROGRESS_SECONDS = 30.0


def documents(inputs: list[str], glob: str, field: str, column: str, max_bytes: int, skipped: Counter | None = None):
    """The text of the inputs' documents, in data.prepare's order, until `max_bytes` characters of
    text (the document that crosses it included). `skipped` counts the records left out, by reason."""
    from data.prepare_inputs import iter_chunks, list_sources, read_records

    total = 0
    for chunk in iter_chunks(list_sources(inputs, glob, column), column):
        records = read_records(chunk, field, column)
        if skipped is not None:
            skipped.update(records.skipped)
        for text in records.texts:
            yield text
            total += len(text)
            if total >= max_bytes:
                return


class _Reading:
    """Counts the documents and characters the trainer takes and, without a terminal, says every
    PLAIN_PROGRESS_SECONDS how far it is (tokenizers' own bar draws only on one)."""

    def __init__(self, texts, max_bytes: int):
        self.texts, self.max_bytes = texts, max_bytes
        self.documents = self.chars = 0
        self.start = self.last = time.perf_counter()
        self.plain = not sys.stderr.isatty()

    def __iter__(self):
        for text in self.texts:
            self.documents += 1
            self.chars += len(text)
            now = time.perf_counter()
            if self.plain and now - self.last >= PLAIN_PROGRESS_SECONDS:
                self.last = now
                log.info("train_tokenizer: read %s documents, %.1f MB of text (at most %.1f MB) in %.0f s",
                         f"{self.documents:,}", self.chars / 1e6, self.max_bytes / 1e6, now - self.start)
            yield text
        if self.plain and self.documents:
            log.info("train_tokenizer: read %s documents (%.1f MB of text) in %.0f s; computing the merges",
                     f"{self.documents:,}", self.chars / 1e6, time.perf_counter() - self.start)


def train(inputs: list[str], out: str, vocab_size: int, glob: str = "**/*", field: str = "text",
          column: str = "text", max_bytes: int = 10**9) -> Path:
    """Train the tokenizer on the inputs and save it in `out`. Returns `out`. Inputs without a
    document (every record skipped: a --field or --column they do not have) raise InputError
    before anything is written."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from data.prepare_inputs import InputError

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, BOS], show_progress=sys.stderr.isatty(),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    skipped = Counter()
    reading = _Reading(documents(inputs, glob, field, column, max_bytes, skipped), max_bytes)
    t0 = time.perf_counter()
    tok.train_from_iterator(reading, trainer)
    if reading.documents == 0:
        reasons = ", ".join(f"{n:,} {reason}" for reason, n in skipped.most_common())
        raise InputError(f"{' '.join(inputs)}: no documents to train on"
                         + (f" ({reasons} skipped; --field is {field!r}, --column {column!r})" if skipped else ""))
    out = Path(out)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=BOS).save_pretrained(str(out))
    log.info("trained a %d-entry BPE on %d documents (%.1f MB) in %.0f s: %s", tok.get_vocab_size(), reading.documents,
             reading.chars / 1e6, time.perf_counter() - t0, out)
    if tok.get_vocab_size() < vocab_size:
        log.warning("warning: --vocab-size %d not reached: the text holds only %d entries' worth of merges "
                    "(train on more text for a larger vocabulary)", vocab_size, tok.get_vocab_size())
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
    p.add_argument("--max-bytes", type=float, default=1e9,
                   help="characters of text to train on; the document that crosses it is the last (default 1e9)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from data.prepare_inputs import InputError

    if args.vocab_size < 259:
        print(f"error: --vocab-size {args.vocab_size}: at least 259 (256 bytes and 2 special tokens)", file=sys.stderr)
        return 2
    out = Path(args.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"error: --output {args.output} exists and is not an empty directory", file=sys.stderr)
        return 2
    try:
        train(args.inputs, args.output, args.vocab_size, args.glob, args.field, args.column, int(args.max_bytes))
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
