"""Synthetic long-context retrieval documents, written as Python source so they read like the corpus.

Four tasks, each a haystack of corpus text with needles inserted and a question at the end whose
answer is a 5-digit number:

    passkey    one `PASSKEY = "48213"` line; the end asks `assert PASSKEY == "`
    multikey   several `KEY_<word> = "<digits>"` lines (the others are distractors); the end asks
               for one of them
    vartrack   a chain `VAR_x = 52817`, `VAR_y = VAR_x`, ... spread from the needle depth to the
               end, plus a distractor chain; the end asks for the last variable of the first chain
    kvrecall   one `KEY_<word><n> = "<digits>"` line per KV_SPACING bytes (KV_MIN_PAIRS to
               KV_MAX_PAIRS of them) at random depths; the example asks for one of them, and a
               training document asks for every one (`assert KEY_x == "<digits>"` lines in random
               order): 64 questions, 320 answer digits, in a document of 8K bytes, against 5 answer
               digits a document in the other tasks

`depth` in [0, 1] places the (first) needle at that fraction of the haystack; in kvrecall the
needle of the last question. `make_example` counts bytes, which the byte tokenizer reads as
tokens; for another tokenizer `fit_example` searches the byte length whose example has the
length asked in the model's tokens (the evaluation's examples and the training documents alike).
Everything is drawn from a `random.Random` the caller seeds, so a (seed, task, length, depth,
index) names one example on every machine. The same generator feeds the evaluation
(msa_model.eval) and, through `data.retrieval_share` and `data.retrieval_tasks`, the training
mixture.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

TASKS = ("passkey", "multikey", "vartrack", "kvrecall")
# the training mixture's tasks unless data.retrieval_tasks says otherwise (their documents, and so
# the caches made before kvrecall existed, stay as they were)
DEFAULT_TASKS = ("passkey", "multikey", "vartrack")
_WORDS = ("apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "pixel", "amber", "lemon", "cedar",
          "delta", "ember", "frost", "grape", "harbor", "ivory", "jade", "koala", "lotus", "mango", "nylon",
          "orbit", "pearl", "quartz", "raven", "sable", "topaz", "umber", "velvet", "willow", "zephyr")
NUM_KEYS = 6  # needles of the multi-key task (one asked, the rest distractors)
CHAIN_HOPS = 4  # assignments in a variable-tracking chain
KV_SPACING = 64  # bytes of document per key/value pair of the kvrecall task
KV_MIN_PAIRS, KV_MAX_PAIRS = 2, 64
KV_SUFFIXES = 10  # kvrecall keys are a word and one digit: 320 distinct names
# the shortest example every task fits, in tokens of any tokenizer that spends at most a token a
# byte (vartrack's eight needle lines and question take up to 217 bytes)
MIN_LENGTH = 256


@dataclass
class Example:
    """`prompt` + `answer` is exactly the requested length in bytes (= byte tokens)."""

    task: str
    length: int
    depth: float
    prompt: bytes
    answer: bytes


class Haystack:
    """Corpus text to cut haystacks from: up to `pool_bytes` of the files under the corpus, read
    in a seeded order (so a large corpus is not read whole). `read`: a file's text (default its
    bytes; the evaluation's reads the documents of .jsonl records, data.corpus.file_documents)."""

    def __init__(self, files: list[Path], pool_bytes: int, seed: int,
                 read: Callable[[Path], bytes] = Path.read_bytes):
        order = list(files)
        random.Random(seed).shuffle(order)
        parts, total = [], 0
        for path in order:
            if total >= pool_bytes:
                break
            data = read(path)
            parts.append(data)
            total += len(data)
        self.text = b"\n".join(parts)
        if not self.text:
            raise ValueError("haystack: the corpus files are empty")

    def cut(self, n: int, rng: random.Random) -> bytes:
        """n bytes of corpus text starting at a line start (repeated if the pool is shorter)."""
        text = self.text
        while len(text) < n + 1:
            text = text + b"\n" + text
        start = rng.randrange(0, len(text) - n)
        line = text.rfind(b"\n", 0, start)
        start = line + 1 if line >= 0 and len(text) - (line + 1) >= n else start
        return text[start:start + n]


def _digits(rng: random.Random) -> bytes:
    return str(rng.randrange(10_000, 100_000)).encode()


def _names(rng: random.Random, n: int) -> list[str]:
    return rng.sample(_WORDS, n)


def _needles(task: str, rng: random.Random) -> tuple[list[bytes], bytes, bytes, str]:
    """(needle lines in haystack order, question, answer, placement): placement "depth" puts every
    needle at the depth, "spread" spaces them from the depth to the end."""
    if task == "passkey":
        value = _digits(rng)
        return [b'PASSKEY = "' + value + b'"  # remember the passkey\n'], b'assert PASSKEY == "', value, "depth"
    if task == "multikey":
        names = _names(rng, NUM_KEYS)
        values = [_digits(rng) for _ in names]
        lines = [f'KEY_{n} = "'.encode() + v + b'"\n' for n, v in zip(names, values)]
        asked = rng.randrange(NUM_KEYS)
        return lines, f'assert KEY_{names[asked]} == "'.encode(), values[asked], "depth"
    if task == "vartrack":
        names = _names(rng, 2 * CHAIN_HOPS)
        value, other = _digits(rng), _digits(rng)
        chain, decoy = names[:CHAIN_HOPS], names[CHAIN_HOPS:]
        lines = []
        for i in range(CHAIN_HOPS):
            # the two chains interleave hop by hop, so order alone does not tell them apart
            for seq, v in ((chain, value), (decoy, other)):
                rhs = v if i == 0 else f"VAR_{seq[i - 1]}".encode()
                lines.append(f"VAR_{seq[i]} = ".encode() + rhs + b"\n")
        return lines, f"assert VAR_{chain[-1]} == ".encode(), value, "spread"
    raise ValueError(f"unknown retrieval task {task!r} (known: {', '.join(TASKS)})")


def _kv_pairs(length: int, depth: float, rng: random.Random, ask_all: bool):
    """kvrecall's (needle lines, their depths, (question, answer) pairs, the last one the example's).
    The first key is the one asked last, its needle at `depth`; the others lie at uniform depths.
    Keys are distinct, so no question is answered by an earlier one."""
    n = min(KV_MAX_PAIRS, max(KV_MIN_PAIRS, length // KV_SPACING))
    keys = [f"KEY_{_WORDS[i // KV_SUFFIXES]}{i % KV_SUFFIXES}" for i in rng.sample(range(KV_SUFFIXES * len(_WORDS)), n)]
    values = [_digits(rng) for _ in keys]
    depths = [depth] + [rng.random() for _ in keys[1:]]
    order = sorted(range(n), key=lambda i: depths[i])
    lines = [f'{keys[i]} = "'.encode() + values[i] + b'"\n' for i in order]
    asked = rng.sample(range(1, n), n - 1) + [0] if ask_all else [0]
    questions = [(f'assert {keys[i]} == "'.encode(), values[i]) for i in asked]
    return lines, [depths[i] for i in order], questions


def _plan(task: str, length: int, depth: float, rng: random.Random, ask_all: bool):
    """(needle lines in haystack order, a function of the filler's length to their byte offsets in
    it, (question, answer) pairs in document order)."""
    if task == "kvrecall":
        lines, depths, questions = _kv_pairs(length, depth, rng, ask_all)
        return lines, lambda filler: [round(d * filler) for d in depths], questions
    lines, question, answer, placement = _needles(task, rng)

    def offsets(filler: int) -> list[int]:
        start = round(depth * filler)
        if placement == "depth":
            return [start] * len(lines)
        return [start + round(i * (filler - start) / len(lines)) for i in range(len(lines))]

    return lines, offsets, [(question, answer)]


class ShortExample(ValueError):
    """An example length below what its needles and question take with the least filler (`needed`)."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed


def make_example(task: str, length: int, depth: float, haystack: Haystack, rng: random.Random,
                 ask_all: bool = False) -> Example:
    """One example of exactly `length` bytes: haystack with needles, then question, then answer.

    `ask_all` (kvrecall's training documents): a question for every needle, each but the last
    followed by its answer and closing quote; the last one's answer is the example's answer.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    lines, offsets, questions = _plan(task, length, depth, rng, ask_all)
    answered = b"".join(b"\n" + q + a + b'"' for q, a in questions[:-1])
    question, answer = b"\n" + questions[-1][0], questions[-1][1]
    fixed = sum(len(x) + 1 for x in lines) + len(answered) + len(question) + len(answer)
    filler = length - fixed
    if filler < 16:
        raise ShortExample(f"{task}: length {length} is too short for its needles ({fixed} bytes)", fixed + 16)
    text = haystack.cut(filler, rng)
    parts, prev = [], 0
    for cut, line in zip(offsets(filler), lines):
        parts += [text[prev:cut], b"\n", line]
        prev = cut
    parts += [text[prev:], answered, question]
    prompt = b"".join(parts)
    assert len(prompt) + len(answer) == length, (len(prompt), len(answer), length)
    return Example(task, length, depth, prompt, answer)


def fit_example(task: str, length: int, depth: float, haystack: Haystack, draw: Callable[[], random.Random],
                count: Callable[[Example], int], ask_all: bool = False, tries: int = 8,
                within: float = 0.02) -> Optional[tuple[Example, int]]:
    """(the longest example of at most `length` units of `count` (the model's tokens) found in
    `tries` byte lengths, stopping within `within` of it; its count), or None if none fits (its
    needles and question alone take more). Each try draws its example from `draw()`: a fresh generator of the
    same seed makes the result depend on the example's name alone, a shared one continues its stream."""
    best, n_bytes = None, 4 * length
    for _ in range(tries):
        try:
            ex = make_example(task, n_bytes, depth, haystack, draw(), ask_all=ask_all)
        except ValueError:  # too short for its needles: grow
            n_bytes *= 2
            continue
        n = count(ex)
        if n <= length and (best is None or n > best[0]):
            best = (n, ex)
        if length * (1.0 - within) <= n <= length:
            break
        n_bytes = max(1, int(n_bytes * length / n * (0.995 if n > length else 1.0)))
    return None if best is None else (best[1], best[0])


def training_documents(haystack: Haystack, target: int, max_length: int, seed: int,
                       tasks: tuple[str, ...] = DEFAULT_TASKS, count: Optional[Callable[[bytes], int]] = None,
                       min_length: int = 0):
    """Yield synthetic retrieval documents (bytes: prompt + answer) until `target` tokens are made:
    `tasks` uniform, depths uniform in [0, 1], lengths uniform in [min_length, max_length] tokens
    (min_length 0: max(256, max_length / 8)); kvrecall documents ask for every needle. Short
    documents put the needle a few dozen tokens before its question, where a small model learns
    to look it up before it can across a whole context (data.retrieval_min_length). A drawn length
    shorter than the document's needles and question take is raised to what they take (with
    `count`, doubled up to max_length until a document fits).

    `count` (a document's length in the model's tokens) sizes documents and target in those tokens,
    each document the longest that fits its drawn length (`fit_example`); None: bytes, the byte
    tokenizer's tokens, each document exactly its drawn length."""
    rng = random.Random(seed)
    made = 0
    # at most max_length: a context of 256 tokens leaves its documents a token or two less
    low = min(min_length or max(256, max_length // 8), max_length)
    hint = "data.retrieval_tasks needs a longer model.seq_length"
    while made < target:
        task = rng.choice(tasks)
        length, depth = rng.randint(low, max(low, max_length)), rng.random()
        ask_all = task == "kvrecall"
        if count is None:
            while True:
                try:
                    ex = make_example(task, length, depth, haystack, rng, ask_all=ask_all)
                    break
                except ShortExample as e:
                    # each try is longer than the last, so this ends by max_length
                    if e.needed > max_length:
                        raise ValueError(f"{e} ({hint})") from None
                    length = e.needed
            n = length
        else:
            found = None
            while found is None:
                found = fit_example(task, length, depth, haystack, lambda: rng,
                                    lambda e: count(e.prompt + e.answer), ask_all=ask_all)
                if found is None and length >= max_length:
                    raise ValueError(f"{task}: no training document of at most {length} tokens ({hint})")
                length = min(max_length, 2 * length)
            ex, n = found
        made += n
        yield ex.prompt + ex.answer
