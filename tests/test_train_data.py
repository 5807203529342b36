"""The training data's position: a run resumed at `consumed_samples` reads on exactly where the
interrupted one stopped, on every data-parallel rank, and the dataset is built only when read; a
corpus shorter than one sample is refused."""

from __future__ import annotations

import torch

from data.datasets import TrainData


class _Numbered(torch.utils.data.Dataset):
    """Sample i is the single token i."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"tokens": torch.tensor([i])}


def _samples(batch) -> list[int]:
    return batch["tokens"][:, 0].tolist()


def test_dataset_is_built_at_the_first_read_and_once():
    built = []

    def build():
        built.append(1)
        return _Numbered()

    data = TrainData(build, micro_batch_size=2, dp_rank=0, dp_size=1)
    assert built == []
    next(data.iterator(0))
    next(data.iterator(6))
    assert built == [1]


def test_a_resumed_iterator_continues_where_the_first_stopped():
    micro, dp, global_batch = 2, 2, 8
    ranks = [TrainData(_Numbered, micro, rank, dp) for rank in range(dp)]
    steps = 3
    per_step = global_batch // (micro * dp)
    # one uninterrupted run, and one stopped after `steps` steps and resumed at their samples
    whole = [[_samples(b) for b, _ in zip(r.iterator(0), range(2 * steps * per_step))] for r in ranks]
    resumed = [[_samples(b) for b, _ in zip(r.iterator(steps * global_batch), range(steps * per_step))]
               for r in ranks]
    for rank in range(dp):
        assert resumed[rank] == whole[rank][steps * per_step:]
    # together the ranks read each sample once, in order
    read = sorted(s for rank in range(dp) for batch in whole[rank] for s in batch)
    assert read == list(range(2 * steps * global_batch))
    assert resumed[0][0] == [steps * global_batch, steps * global_batch + 1]


def test_a_corpus_shorter_than_one_sample_is_refused(tmp_path):
    """A file-directory corpus of 13 bytes for 65-token samples: megatron would fill every sample
    with the same 13 tokens over and over; the build says so instead, naming the count."""
    import pytest
    from omegaconf import OmegaConf

    from data.cache_check import DataCacheError
    from data.datasets import build_datasets
    from data.tokenizer import build_tokenizer
    from msa_model.config import DataConfig

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.py").write_text("print('hi')\n")
    cfg = OmegaConf.structured(DataConfig)
    cfg.source, cfg.cache_dir, cfg.split = str(tmp_path / "corpus"), str(tmp_path / "cache"), [100.0, 0.0, 0.0]
    with pytest.raises(DataCacheError, match=r"the training documents of .* \(1 of 1\) hold 13 tokens, fewer than one "
                                             r"sample \(model.seq_length \+ 1 = 65\)"):
        build_datasets(cfg, build_tokenizer("byte"), 64, train_samples=8)
    # 13 tokens make samples of 12
    train, _ = build_datasets(cfg, build_tokenizer("byte"), 12, train_samples=8)
    assert len(train) >= 8


def test_the_validation_stream_holds_what_a_relaunch_with_more_steps_reads():
    """The README's relaunch `launch.sh trainer.max_steps=120` of a run of 80 steps evaluating every
    100: the first launch evaluated at its end (step 80), the relaunch at 100 and 120; sized for an
    uninterrupted 120-step run (two evaluations), the stream ran out at step 120 (StopIteration)
    after the 40 steps were trained and before they were saved."""
    from types import SimpleNamespace

    from msa_model.training.data_setup import validation_samples

    def evaluating(max_steps, eval_interval=100, eval_iters=4):
        return SimpleNamespace(max_steps=max_steps, eval_interval=eval_interval, eval_iters=eval_iters)

    per = 4 * 8  # one evaluation: eval_iters global batches of 8
    assert validation_samples(evaluating(80), 8) == per  # its end
    assert validation_samples(evaluating(120), 8, step=80, consumed=per) == 3 * per
    # a resume of the same schedule builds the uninterrupted run's dataset (same samples, same order)
    assert validation_samples(evaluating(400), 8, step=200, consumed=2 * per) == validation_samples(evaluating(400), 8)
    assert validation_samples(evaluating(120, eval_interval=0), 8, step=80, consumed=per) == 0


def test_a_token_outside_the_vocabulary_is_named_before_the_model_sees_it(tmp_path):
    """A prepared dataset with one token overwritten in place past the tokenizer's ids (the check
    before the run samples the file's bytes and may miss it): the micro-batch that holds it is
    refused, naming the id, its document and its token, instead of an index error in the
    embedding; every micro-batch before it is read as it is."""
    import numpy as np
    import pytest
    from omegaconf import OmegaConf

    from data.cache_check import DataCacheError
    from data.datasets import build_datasets, build_train_iterator
    from data.prepared import check_prefix
    from data.tokenizer import build_tokenizer
    from msa_model.config import DataConfig
    from tokenizer_fixtures import write_prepared

    tokenizer = build_tokenizer("byte")
    rng = np.random.default_rng(0)
    texts = ["".join(chr(c) for c in rng.integers(97, 123, size=int(rng.integers(20, 90)))) for _ in range(12)]
    # the cheap check hashes a file of 64 blocks of 4 KiB or fewer whole, and samples the first and
    # last block: long documents around the short ones, one of which is damaged between the
    # blocks it samples (as a disk or a copy may)
    texts = ["x" * 300_000, *texts, "y" * 300_000]
    prefix = write_prepared(tmp_path / "web", texts, tokenizer)
    bad_doc, bad_token = 7, 11
    tokens = np.fromfile(f"{prefix}.bin", dtype=np.int32)
    at = sum(len(t) + 1 for t in texts[:bad_doc]) + bad_token
    tokens[at] = 60000
    tokens.tofile(f"{prefix}.bin")
    assert check_prefix(prefix) is None

    cfg = OmegaConf.structured(DataConfig)
    cfg.blend, cfg.cache_dir, cfg.split = [[1.0, str(prefix)]], str(tmp_path / "cache"), [100.0, 0.0, 0.0]
    # one pass over the tokens, in megatron's shuffled order
    train, _ = build_datasets(cfg, tokenizer, 512, train_samples=tokens.size // 513)
    read = 0
    with pytest.raises(DataCacheError) as refused:
        for batch in build_train_iterator(train, 0, 2, 0, 1):
            assert int(batch["tokens"].max()) < tokenizer.vocab_size
            read += 1
    message = str(refused.value)
    assert (f"token id 60,000 at token {bad_token} of document {bad_doc} of {prefix} " in message
            and "not an id of the tokenizer (257 ids)" in message), message
    # the refused micro-batch is the first that holds the id
    sample = int(message.split("(sample ")[1].split(" ")[0])
    assert sample // 2 == read
