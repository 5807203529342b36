"""Prepared datasets: megatron indexed datasets (`PREFIX.bin`, `PREFIX.idx`) with a description
(`PREFIX.json`), as `python -m data.prepare` writes them, and the blends that train on them.

PREFIX.json records what made the dataset and what it should be:

    {"format": "msa-prepared-v1", "source": [...], "tokenizer": {identity}, "add_bos": false,
     "documents": N, "tokens": N, "skipped": {...},
     "files": {"PREFIX.bin": {size, sampled_sha256, sha256}, "PREFIX.idx": {...}}}

(file names relative to the .json's directory). Before training, every prefix of `data.blend`
and `data.valid_blend` is checked against it: sizes and sampled blocks always (a few hundred KiB
read per file, whatever its size), the sha256 of every byte with data.verify_cache=true; the index
must describe exactly the bytes of the .bin; every dataset must share one tokenizer identity, the
run's. A dataset made elsewhere (Megatron-LM's preprocess_data.py) gets its .json from
`python -m data.prepare --describe PREFIX --tokenizer DIR`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from .cache_check import describe, files_problem
from .tokenizer import describe_identity, identities_match

FORMAT = "msa-prepared-v1"


def metadata_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.json")


def write_metadata(prefix: str | Path, record: dict) -> Path:
    """Write PREFIX.json: `record` (source, tokenizer, documents, tokens, ...) plus the sizes and
    hashes of PREFIX.bin and PREFIX.idx, atomically. Returns its path."""
    prefix = Path(prefix)
    files = {f"{prefix.name}{ext}": describe(Path(f"{prefix}{ext}")) for ext in (".bin", ".idx")}
    out = metadata_path(prefix)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"format": FORMAT, **record, "files": files}, indent=1) + "\n")
    os.replace(tmp, out)
    return out


def read_metadata(prefix: str | Path) -> dict:
    """PREFIX.json as written by write_metadata. Raises ValueError naming the file and the cause."""
    path = metadata_path(prefix)
    if not path.is_file():
        raise ValueError(f"{path} is missing: make the dataset with `python -m data.prepare`, or describe one made "
                         f"elsewhere with `python -m data.prepare --describe {prefix} --tokenizer DIR`")
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "files" not in meta or "tokenizer" not in meta:
        raise ValueError(f"{path} is not a prepared dataset's description (format {FORMAT})")
    return meta


def index_problem(prefix: str | Path) -> str | None:
    """Whether PREFIX.idx reads as a megatron index whose sequences fill PREFIX.bin exactly."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for path in (idx, bin_):
        if not path.is_file():
            return f"{path} is missing"
    try:
        index = IndexedDataset(str(prefix), mmap=True).index
        lengths, pointers = index.sequence_lengths, index.sequence_pointers
        itemsize = index.dtype_size
    except Exception as e:  # megatron reads the header with asserts and numpy: any failure means a bad file
        return f"{idx} is not a readable megatron index ({type(e).__name__}: {e}; truncated or not an .idx?)"
    end = int(pointers[-1]) + int(lengths[-1]) * itemsize if len(lengths) else 0
    size = bin_.stat().st_size
    if end != size:
        return (f"{bin_} is {size:,} bytes but {idx} describes {end:,} ({len(lengths):,} documents): "
                "the two files do not belong together, or one is truncated")
    return None


def check_prefix(prefix: str | Path, full: bool = False) -> str | None:
    """What is wrong with the prepared dataset PREFIX (one line naming the file), or None."""
    try:
        meta = read_metadata(prefix)
    except ValueError as e:
        return str(e)
    found = files_problem(Path(prefix).parent, meta["files"], full)
    if found is not None:
        # the message starts with the file's name: give its directory too
        return f"{Path(prefix).parent}/{found}"
    return index_problem(prefix)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _flat_blend_problem(entries, key: str) -> str | None:
    """One line for weights given outside [weight, prefix] pairs, else None: among the entries,
    Megatron-LM's flat --data-path order [weight, prefix, weight, prefix, ...] (or a weight too many
    or too few in it), or as a list of their own, [[weights...], [prefixes...]]."""
    entries = list(entries or [])
    if (len(entries) == 2 and all(isinstance(e, Sequence) and not isinstance(e, str) for e in entries)
            and all(map(_is_number, entries[0])) and all(isinstance(p, str) for p in entries[1])):
        # [[0.7,0.3],[a,b]]: the weights and the prefixes as two lists (never a blend of two pairs)
        weights, names = list(entries[0]), list(entries[1])
        if len(weights) != len(names):
            return (f"{key}: {len(weights)} weight(s) {weights} for {len(names)} prefix(es) {names}; give one "
                    f"[weight, prefix] pair per dataset: {key}=[[weight,prefix],...]")
        pairs = ",".join(f"[{w},{p}]" for w, p in zip(weights, names))
        return f"{key}: weights and prefixes in two lists; give one [weight, prefix] pair per dataset: {key}=[{pairs}]"
    numbers = [e for e in entries if _is_number(e)]
    if not numbers:
        return None
    names = [str(e) for e in entries if not _is_number(e)]
    if len(entries) % 2 == 0 and all(_is_number(w) and isinstance(p, str) for w, p in zip(entries[::2], entries[1::2])):
        pairs = ",".join(f"[{w},{p}]" for w, p in zip(entries[::2], entries[1::2]))
        return f"{key}: weights and prefixes in one list (Megatron-LM's --data-path order); give pairs: {key}=[{pairs}]"
    # numbers only: perhaps prefixes such as 2024, which Hydra reads as numbers unless quoted
    quote = "" if names else f"; quote a prefix that reads as a number: [{','.join(repr(str(e)) for e in entries)}]"
    return (f"{key}: {len(numbers)} weight(s) {numbers} among {len(names)} prefix(es) {names}: give one "
            f"[weight, prefix] pair per dataset, {key}=[[weight,prefix],...] (or prefixes alone, weight 1){quote}")


def parse_blend(entries, key: str) -> tuple[list[str], list[float], list[str]]:
    """(prefixes, weights, problems) of a blend given as [[weight, prefix], ...] or [prefix, ...]."""
    prefixes, weights, problems = [], [], []
    flat = _flat_blend_problem(entries, key)
    if flat is not None:
        return prefixes, weights, [flat]
    for i, entry in enumerate(entries or []):
        if isinstance(entry, str):
            weight, prefix = 1.0, entry
        elif isinstance(entry, Sequence) and len(entry) == 2:
            weight, prefix = entry
            if _is_number(prefix):
                # [[0.7,0.3],[a,b]]: weights and prefixes given as two lists; or a prefix such as
                # 2024, which Hydra reads as a number unless quoted
                problems.append(f"{key}[{i}]: {list(entry)!r} has no prefix ({prefix} is a number); "
                                f"give one [weight, prefix] pair per dataset: {key}=[[weight,prefix],...], "
                                f"and quote a prefix that reads as a number: [{weight},'{prefix}']")
                continue
        else:
            problems.append(f"{key}[{i}]: {entry!r} is not [weight, prefix] or a prefix "
                            f"(a blend is {key}=[[weight,prefix],...] or {key}=[prefix,...])")
            continue
        try:
            weight = float(weight)
        except (TypeError, ValueError):
            problems.append(f"{key}[{i}]: weight {weight!r} is not a number")
            continue
        if not weight > 0:
            problems.append(f"{key}[{i}]: weight {weight} of {prefix} must be > 0")
            continue
        # megatron normalises the weights by their sum: an infinite one would make them NaN
        if not math.isfinite(weight):
            problems.append(f"{key}[{i}]: weight {weight} of {prefix} must be finite")
            continue
        prefix = str(prefix)
        if prefix.endswith((".bin", ".idx", ".json")):
            problems.append(f"{key}[{i}]: {prefix} names a file; give the prefix without its extension")
            continue
        if prefix in prefixes:
            problems.append(f"{key}: {prefix} is listed twice (give it one weight)")
            continue
        prefixes.append(prefix)
        weights.append(weight)
    if entries is not None and not prefixes and not problems:
        problems.append(f"{key} is empty")
    if not math.isfinite(sum(weights)):
        problems.append(f"{key}: the weights {weights} sum past the largest float; scale them down")
    return prefixes, weights, problems


def check_blends(data_cfg, tokenizer_identity: dict | None = None, tokenizer_source: str = "",
                 remedy: str | None = None) -> list[str]:
    """Every problem of data.blend and data.valid_blend, one line each: the entries, each prefix's
    files, and one tokenizer identity shared by all of them and by `tokenizer_identity` (the run's,
    when known; data.tokenizer_mismatch=allow lets a different one through). A mismatch names
    where the run's tokenizer came from (`tokenizer_source`) and what to do (`remedy`)."""
    problems, seen, tokens = [], {}, {}
    for key in ("data.blend", "data.valid_blend"):
        entries = getattr(data_cfg, key.split(".")[1])
        prefixes, _, bad = parse_blend(entries, key)
        problems += bad
        for prefix in prefixes:
            found = check_prefix(prefix, full=data_cfg.verify_cache)
            if found is not None:
                problems.append(f"{key}: {found}")
                continue
            meta = read_metadata(prefix)
            seen[prefix] = meta["tokenizer"]
            tokens.setdefault(key, {})[prefix] = _tokens_hash(prefix, meta)
    problems += _validation_overlap(tokens.get("data.blend", {}), tokens.get("data.valid_blend", {}))
    if len({(t.get("sha256"), t.get("vocab_size")) for t in seen.values()}) > 1:
        listing = "; ".join(f"{p}: {describe_identity(t)}" for p, t in seen.items())
        problems.append(f"data.blend: the datasets were prepared with different tokenizers ({listing}); "
                        "prepare them all with one")
    elif seen and tokenizer_identity is not None and data_cfg.tokenizer_mismatch != "allow":
        prefix, recorded = next(iter(seen.items()))
        if not identities_match(recorded, tokenizer_identity):
            source = f" ({tokenizer_source})" if tokenizer_source else ""
            problems.append(f"data.tokenizer: {describe_identity(tokenizer_identity)}{source} is not the tokenizer "
                            f"{prefix} was prepared with ({describe_identity(recorded)}); "
                            f"{remedy or 'use that one, or data.tokenizer_mismatch=allow'}")
    return problems


def vocabulary_problems(data_cfg, rows: int) -> list[str]:
    """Datasets of data.blend and data.valid_blend prepared with a tokenizer of more ids than the
    model's `rows` embedding rows: their ids would index past the embedding. Refused whatever
    data.tokenizer_mismatch says, which lets another tokenizer of the same ids through, not ids the
    model does not have."""
    problems = []
    for key in ("data.blend", "data.valid_blend"):
        for prefix in parse_blend(getattr(data_cfg, key.split(".")[1]), key)[0]:
            try:
                recorded = read_metadata(prefix)["tokenizer"]
                size = int(recorded["vocab_size"])
            except (ValueError, KeyError, TypeError):
                continue  # reported by check_blends
            if size > rows:
                problems.append(f"{key}: {prefix} was prepared with {describe_identity(recorded)}, whose ids go "
                                f"past the model's {rows} embedding rows; prepare it with the model's tokenizer")
    return problems


def _tokens_hash(prefix: str, meta: dict) -> str:
    """What identifies a dataset's tokens: the sha256 of its .bin recorded in PREFIX.json, else
    (a description without it) the resolved prefix."""
    recorded = meta["files"].get(f"{Path(prefix).name}.bin", {})
    return recorded.get("sha256") or str(Path(prefix).resolve())


def _validation_overlap(train: dict[str, str], valid: dict[str, str]) -> list[str]:
    """A data.valid_blend dataset whose tokens are a data.blend dataset's: its validation loss would
    be a loss on training data (the split serves training only once valid_blend is given)."""
    by_hash = {h: prefix for prefix, h in train.items()}
    return [f"data.valid_blend: {prefix} holds the same tokens as data.blend's {by_hash[h]}, so validation "
            "would measure training data; leave data.valid_blend unset (data.split holds out a share of each "
            "dataset's documents), or prepare held-out documents as a dataset of their own"
            for prefix, h in valid.items() if h in by_hash]


def split_shares(split) -> list[float] | None:
    """data.split [train, validation, test] as three shares summing to 1, or None when it is not
    three finite non-negative numbers with a positive train share."""
    shares = [float(x) for x in split]
    if len(shares) != 3 or not all(math.isfinite(x) and x >= 0 for x in shares) or shares[0] <= 0 \
            or not math.isfinite(sum(shares)):
        return None
    return [x / sum(shares) for x in shares]


def split_problems(data_cfg, evaluating: bool, seq_length: int | None = None) -> list[str]:
    """Datasets of data.blend whose share of data.split holds no document (megatron cuts each
    dataset's documents by the split's fractions, rounded): training always, validation when the
    run evaluates on the split. With `seq_length`, also a share (or a data.valid_blend dataset)
    holding fewer tokens than one sample of seq_length + 1: megatron would fill every sample with
    those few tokens over and over, and the run would train (or validate) on that repetition.
    A split that is not one is the configuration check's to report."""
    shares = split_shares(data_cfg.split)
    if shares is None:
        return []
    problems = []
    bounds = [0.0]
    for x in shares:
        bounds.append(bounds[-1] + x)
    spans = [("training", bounds[0], bounds[1])]
    if evaluating and not data_cfg.valid_blend:
        spans.append(("validation", bounds[1], bounds[2]))
    for prefix in parse_blend(data_cfg.blend, "data.blend")[0]:
        try:
            meta = read_metadata(prefix)
            # megatron splits by sequences: one a document unless its sentences were split
            n = int(meta.get("sequences", meta["documents"]))
        except (ValueError, KeyError, TypeError):
            continue  # reported by check_blends
        for name, a, b in spans:
            lo, hi = int(round(a * n)), int(round(b * n))
            if hi <= lo:
                problems.append(f"data.split {list(data_cfg.split)} leaves no {name} document of {prefix} ({n:,} "
                                f"documents): give {name} a larger share"
                                + (", or its own datasets (data.valid_blend)" if name == "validation" else ""))
            elif seq_length is not None and (tokens := sequences_tokens(prefix, lo, hi)) <= seq_length:
                problems.append(f"data.split {list(data_cfg.split)}: the {name} documents of {prefix} ({hi - lo:,} of "
                                f"{n:,}) hold {tokens:,} tokens, fewer than one sample (model.seq_length + 1 = "
                                f"{seq_length + 1:,}), which would repeat them; give more text or a larger {name} share")
    if evaluating and seq_length is not None:
        for prefix in parse_blend(data_cfg.valid_blend, "data.valid_blend")[0]:
            tokens = sequences_tokens(prefix, 0, None)
            if tokens <= seq_length:
                problems.append(f"data.valid_blend: {prefix} holds {tokens:,} tokens, fewer than one sample "
                                f"(model.seq_length + 1 = {seq_length + 1:,}), which would repeat them; give more text")
    return problems


def sequences_tokens(prefix: str, lo: int, hi: int | None) -> int:
    """Tokens of sequences [lo, hi) of a prepared dataset (hi None: to the end), from its index.
    megatron's split cuts a dataset by sequences (a document prepared with its sentences split,
    as Megatron-LM's preprocess_data.py --split-sentences writes, holds several)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    # the lengths are a view of the index's memory map: the dataset must outlive the sum
    dataset = IndexedDataset(str(prefix), mmap=True)
    return int(dataset.sequence_lengths[lo:hi].sum())


def contents_key(prefixes: list[str]) -> str:
    """16 hex digits naming the contents of the prepared datasets `prefixes` (the sha256 of each
    one's .bin and .idx, as its PREFIX.json records them). megatron names its sample indices by
    the dataset's path, sizes and settings, not by its bytes: a dataset prepared again under the
    same prefix (--overwrite) would be read through the old one's indices."""
    import hashlib

    h = hashlib.sha256()
    for prefix in prefixes:
        files = read_metadata(prefix)["files"]
        h.update(json.dumps([[name, files[name].get("sha256"), files[name].get("size")] for name in sorted(files)])
                 .encode())
    return h.hexdigest()[:16]


def recorded_tokenizer(data_cfg) -> dict | None:
    """The tokenizer identity the blend's first dataset records (with its `path` when the prepare
    step knew one), or None without a readable blend."""
    prefixes, _, _ = parse_blend(data_cfg.blend, "data.blend")
    for prefix in prefixes:
        try:
            return read_metadata(prefix)["tokenizer"]
        except ValueError:
            continue
    return None
