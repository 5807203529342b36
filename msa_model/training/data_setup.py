"""The run's tokenizer and data: which tokenizer (given, or the checkpoint's), whether it matches
the checkpoint and the prepared datasets, and the train / validation micro-batch streams.

A checkpoint records its tokenizer in `<step dir>/tokenizer/`: `identity.json` (data/tokenizer.py)
and, for a Hugging Face tokenizer, a copy of its files, so a checkpoint (ours, or one a conversion
wrote) carries the tokenizer its embedding rows belong to. With data.tokenizer unset a run takes
the tokenizer of the checkpoint it starts from (resume, else init_from), else the one the blend's
datasets were prepared with, else `byte`. A tokenizer other than the checkpoint's or the datasets'
is refused, naming both, unless data.tokenizer_mismatch=allow.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path

from data.tokenizer import (BYTE, HFTokenizer, TokenizerError, build_tokenizer, describe_identity,
                            identities_match, tokenizer_files)

log = logging.getLogger(__name__)

TOKENIZER_DIR = "tokenizer"
IDENTITY_FILE = "identity.json"


def write_checkpoint_tokenizer(step_dir: str | Path, tokenizer) -> Path:
    """Record `tokenizer` in `step_dir`/tokenizer/: its identity and (Hugging Face) its files."""
    out = Path(step_dir) / TOKENIZER_DIR
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / IDENTITY_FILE).write_text(json.dumps(tokenizer.identity, indent=1) + "\n")
    return out


def checkpoint_tokenizer(step_dir: str | Path | None) -> tuple[dict | None, str | None]:
    """(identity, tokenizer spec) a checkpoint step directory records: the spec is `byte` or the
    directory of its copied files; (None, None) for a checkpoint that records no tokenizer."""
    if step_dir is None:
        return None, None
    folder = Path(step_dir) / TOKENIZER_DIR
    try:
        identity = json.loads((folder / IDENTITY_FILE).read_text())
    except (OSError, ValueError):
        return None, None
    if tokenizer_files(folder):
        return identity, str(folder)
    return identity, BYTE if identity.get("name") == "byte-v1" else None


def step_dir_of(path: str | Path | None) -> Path | None:
    """The step directory a checkpoint path means (a root with `latest`, or a step dir), or None."""
    if path is None:
        return None
    path = Path(path)
    latest = path / "latest"
    if latest.is_file():
        path = path / latest.read_text().strip()
    return path if path.is_dir() else None


RESUMED = "the checkpoint this run resumes"


def resolve_tokenizer(data_cfg, resume_dir: Path | None, init_dir: Path | None) -> tuple[str, str]:
    """(spec, where it came from) of the run's tokenizer (module docstring's order)."""
    if data_cfg.tokenizer is not None:
        return data_cfg.tokenizer, "data.tokenizer"
    for what, step_dir in ((RESUMED, resume_dir), ("init_from", init_dir)):
        _, spec = checkpoint_tokenizer(step_dir)
        if spec is not None:
            return spec, f"{what} ({step_dir})"
    if data_cfg.blend:
        from data.prepared import recorded_tokenizer

        recorded = recorded_tokenizer(data_cfg) or {}
        path = recorded.get("path")
        if path == BYTE or (path and Path(path).is_dir()):
            return path, "the tokenizer data.blend was prepared with"
    return BYTE, "default"


def _blend_tokenizer_gone(data_cfg) -> str | None:
    """The tokenizer directory data.blend's datasets record when it no longer exists, else None."""
    if not data_cfg.blend:
        return None
    from data.prepared import recorded_tokenizer

    path = (recorded_tokenizer(data_cfg) or {}).get("path")
    return path if path and path != BYTE and not Path(path).is_dir() else None


def checkpoint_run_tokenizer(cfg, step_dir: Path | None = None):
    """The tokenizer a tool (eval, dry run, tests) uses for the run config `cfg` (of the checkpoint
    `step_dir`, when given)."""
    spec, _ = resolve_tokenizer(cfg.data, step_dir, None)
    return build_tokenizer(spec, cfg.data.eod_token)


def tokenizer_problems(cfg, resume_dir: Path | None, init_dir: Path | None):
    """(tokenizer or None, where it came from, problem lines): the run's tokenizer built, and what
    is wrong with it against the model, the checkpoints and the prepared datasets."""
    from data.prepared import check_blends, split_problems, vocabulary_problems

    spec, source = resolve_tokenizer(cfg.data, resume_dir, init_dir)
    try:
        tokenizer = build_tokenizer(spec, cfg.data.eod_token)
    except TokenizerError as e:
        return None, source, [str(e)]
    problems = []
    mine = tokenizer.identity
    vocab = cfg.model.vocab_size
    if vocab is not None and vocab < tokenizer.vocab_size:
        problems.append(f"model.vocab_size ({vocab}) is smaller than the vocabulary of the tokenizer "
                        f"{describe_identity(mine)}: its ids would index past the embedding")
    if cfg.data.add_bos and tokenizer.bos is None and not cfg.data.blend:
        problems.append(f"data.add_bos: the tokenizer {describe_identity(mine)} has no beginning-of-sequence token")
    if cfg.data.tokenizer_mismatch != "allow":
        if source == "default" and init_dir is not None and checkpoint_tokenizer(init_dir) == (None, None):
            # a conversion of a model without its tokenizer files: bytes would index its embedding
            rows = f"its {vocab} embedding rows" if vocab is not None else "its embedding rows"
            problems.append(f"init_from {init_dir} records no tokenizer (converted without its tokenizer files?), so "
                            f"this run would read the default byte tokenizer into {rows}, which another tokenizer "
                            "may have trained: name theirs, data.tokenizer=<its directory> (data.tokenizer=byte for "
                            "the byte tokenizer), or data.tokenizer_mismatch=allow")
        for what, step_dir in (("resume", resume_dir), ("init_from", init_dir)):
            recorded, _ = checkpoint_tokenizer(step_dir)
            if recorded is not None and not identities_match(recorded, mine):
                problems.append(f"data.tokenizer: {describe_identity(mine)} ({source}) is not the tokenizer of the "
                                f"{what} checkpoint {step_dir} ({describe_identity(recorded)}): its embedding rows "
                                "belong to that one; use it (leave data.tokenizer unset), or "
                                "data.tokenizer_mismatch=allow")
    gone = _blend_tokenizer_gone(cfg.data) if source == "default" else None
    if gone is not None:
        # not "the byte tokenizer is not the datasets'": the user named none
        problems.append(f"data.blend: the tokenizer its datasets were prepared with, {gone}, no longer exists; "
                        "name it where it is now: data.tokenizer=DIR")
    if cfg.data.blend or cfg.data.valid_blend:
        # a tokenizer taken from the checkpoint this run resumes cannot change: the datasets need a new run
        remedy = "train on them in a new run (another run_dir=)" if source.startswith(RESUMED) else None
        problems += check_blends(cfg.data, None if gone is not None else mine,
                                 "" if source == "data.tokenizer" else source, remedy)
        if cfg.data.tokenizer_mismatch == "allow" and gone is None:
            # refused, a dataset of another tokenizer is named above already
            problems += vocabulary_problems(cfg.data, vocab if vocab is not None else tokenizer.vocab_size)
    if not problems:
        # evaluations of the retrieval probe alone (trainer.probe_tasks) read no validation split
        evaluating = cfg.trainer.eval_interval > 0 and has_validation_data(cfg.data)
        problems += (split_problems(cfg.data, evaluating=evaluating, seq_length=cfg.model.seq_length)
                     if cfg.data.blend else corpus_split_problems(cfg.data, evaluating))
    return tokenizer, source, problems


def corpus_split_problems(data_cfg, evaluating: bool) -> list[str]:
    """A share of data.split that holds no document of the file-directory corpus (data.source),
    before it is tokenized: a file is one document (a .jsonl file's records are counted once it is
    read: its tokenization checks them, data.datasets). Training always, validation when the run
    evaluates on the split."""
    from data.corpus import is_jsonl, list_corpus_files
    from data.prepared import split_shares

    if not data_cfg.source:
        return []  # (a run without a corpus: the configuration's check names what is missing)
    shares = split_shares(data_cfg.split)
    try:
        _, files = list_corpus_files(data_cfg.source, data_cfg.glob, data_cfg.max_bytes)
    except FileNotFoundError:
        return []  # the inputs' check names it
    if shares is None or any(is_jsonl(f) for f in files):
        return []
    n, bounds = len(files), [0.0, shares[0], shares[0] + shares[1]]
    spans = [("training", 0)] + ([("validation", 1)] if evaluating and not data_cfg.valid_blend else [])
    problems = []
    for name, i in spans:
        if int(round(bounds[i + 1] * n)) <= int(round(bounds[i] * n)):
            remedy = "a larger validation share, or data.valid_blend" if i else "a larger training share"
            problems.append(f"data.split {list(data_cfg.split)} leaves no {name} document of data.source="
                            f"{data_cfg.source} ({n:,} files matching data.glob={data_cfg.glob!r}, one document "
                            f"each): give it more files, {remedy}")
    return problems


def document_mask_line(cfg) -> str:
    """One line saying whether packed documents are masked (data.document_mask), for the dry run
    and the run's first log line."""
    from msa_model.config import msa_layers_of

    if cfg.data.document_mask:
        # a model without MSA layers (recipe=dense) selects no blocks and trains no KL
        within = "attends, selects blocks and trains the indexer KL" if any(msa_layers_of(cfg.model)) else "attends"
        line = ("documents: masked (data.document_mask=true): each packed document, ended by its "
                f"end-of-document token, {within} within itself")
        if cfg.data.reset_position_ids:
            line += ("; data.reset_position_ids=true has no effect (positions are not restarted: rotary "
                     "scores depend on distance only, the same within a masked document either way)")
        return line
    return ("documents: not masked (data.document_mask=false): tokens attend to the documents packed "
            "before theirs in a sequence")


def validation_samples(trainer_cfg, global_batch_size: int, step: int = 0, consumed: int = 0) -> int:
    """Samples of the validation stream a run reads, 0 without evaluation. Every evaluation reads
    eval_iters global batches further (megatron's count: one per interval and one at the end).
    A run resumed at `step` having read `consumed` of them needs those plus its remaining
    evaluations: more than an uninterrupted run's count when an earlier launch evaluated at its own
    end (a relaunch with a longer trainer.max_steps). The larger of the two, so that a resume of an
    unchanged schedule builds the uninterrupted run's dataset (the same samples in the same order)."""
    t = trainer_cfg
    if not t.eval_interval:
        return 0
    per_evaluation = t.eval_iters * global_batch_size
    remaining = t.max_steps // t.eval_interval - step // t.eval_interval + (1 if t.max_steps % t.eval_interval else 0)
    return max((t.max_steps // t.eval_interval + 1) * per_evaluation, consumed + remaining * per_evaluation)


def build_data(cfg, tokenizer, train_position=lambda: (0, 0, 0), valid_position=lambda: (0, 0)):
    """(train, valid or None): this data-parallel rank's micro-batch streams (data.datasets.TrainData),
    the datasets built at their first use. valid exists when trainer.eval_interval > 0 and the data
    has a validation stream (has_validation_data). `train_position()` is (the sample the stream
    starts at, the step, the samples read; read when the datasets are built, after a resumed
    checkpoint has set them): the train stream starts at its first (init_from_data_position), so
    its dataset holds that many samples more than the run's max_steps global batches, or more where
    a resume changed the batch (those read plus the steps left); `valid_position()` is (the step,
    the validation samples read), read then too: see validation_samples."""
    from data.datasets import TrainData, build_datasets
    from msa_model.training.distributed import data_parallel_info

    t, p = cfg.trainer, cfg.parallel
    datasets = {}
    # evaluations with the retrieval probe alone (trainer.probe_tasks) read no validation split
    validating = bool(t.eval_interval) and has_validation_data(cfg.data)

    def dataset(index: int):
        if not datasets:
            start, step, consumed = train_position()
            train_samples = max(start + t.max_steps * p.global_batch_size,
                                consumed + (t.max_steps - step) * p.global_batch_size)
            valid_samples = validation_samples(t, p.global_batch_size, *valid_position()) if validating else 0
            datasets["all"] = build_datasets(cfg.data, tokenizer, cfg.model.seq_length, train_samples, valid_samples)
        return datasets["all"][index]

    dp_rank, dp_size = data_parallel_info()
    make = partial(TrainData, micro_batch_size=p.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                   document_mask=cfg.data.document_mask)
    return make(partial(dataset, 0)), make(partial(dataset, 1)) if validating else None


def has_validation_data(data_cfg) -> bool:
    """Whether the data holds a validation stream: data.valid_blend, or a validation share in data.split."""
    from data.prepared import split_shares

    shares = split_shares(data_cfg.split)
    return bool(data_cfg.valid_blend) or shares is None or shares[1] > 0


def document_bos(data_cfg, tokenizer) -> int | None:
    """The id a training document of the file-directory corpus starts with (data.add_bos: the
    tokenizer's beginning-of-sequence token), or None. The retrieval probe and the offline
    evaluation start their examples and held-out documents with it too, as the model saw them."""
    return tokenizer.bos if data_cfg.add_bos and not data_cfg.blend else None
