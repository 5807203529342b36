"""The retrieval probe (trainer.probe_tasks): its rows score exactly the answer's tokens, its
numbers are the offline evaluation's (`msa_model.eval.runner.score_example`) on the same examples
and model, exact match counts an example only when every answer token is the argmax, and a run
logs it at every evaluation, also without a validation split."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from skeleton_helpers import run_python  # noqa: E402
from tokenizer_fixtures import make_bpe_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def one_rank():
    from msa_model.config import ParallelConfig
    from msa_model.training.distributed import init_distributed, shutdown

    init_distributed(ParallelConfig(), "cpu", 1234)
    yield
    shutdown()


def _stdlib_files():
    from data.corpus import list_corpus_files

    return list_corpus_files("stdlib", "**/*.py", 2_000_000)[1]


def _probe(tokenizer, tasks, samples, seq_length, micro=2):
    from msa_model.training.retrieval_probe import RetrievalProbe

    return RetrievalProbe(tasks, samples, _stdlib_files(), tokenizer, seq_length, micro)


def test_the_rows_score_the_answer_tokens_only(one_rank, tmp_path):
    from data.tokenizer import ByteTokenizer, build_tokenizer

    for tokenizer in (ByteTokenizer(), build_tokenizer(str(make_bpe_tokenizer(tmp_path / "tok")))):
        probe = _probe(tokenizer, ["passkey", "kvrecall"], 3, 256)
        for task in ("passkey", "kvrecall"):
            rows, examples = probe.rows(task), probe._examples(task)
            # 3 examples, padded to whole micro-batches of 2 by a row with nothing to score
            assert len(examples) == 3 and rows["tokens"].shape == (4, 256)
            assert (rows["loss_mask"][3] == 0).all() and (rows["tokens"][3] == tokenizer.eod).all()
            for i, ex in enumerate(examples):
                scored = rows["labels"][i][rows["loss_mask"][i] > 0]
                # the example as one text, as training tokenizes a document; the scored tokens
                # spell the answer (these tasks' answers follow a quote, which no BPE merge crosses)
                whole = tokenizer.tokenize(ex.prompt + ex.answer)
                assert scored.tolist() == whole[-len(scored):].tolist()
                assert scored.tolist() == tokenizer.tokenize(ex.answer).tolist()
                end = int((rows["loss_mask"][i] > 0).nonzero().max()) + 1
                assert rows["tokens"][i, :end].tolist() + [rows["labels"][i, end - 1].item()] == whole.tolist()
                assert (rows["tokens"][i, end:] == tokenizer.eod).all()
            # needle depths spread over the haystack, the same examples on every call
            assert len({ex.depth for ex in examples}) == 3
            assert [e.prompt for e in probe._examples(task)] == [e.prompt for e in examples]
    # the byte tokenizer's examples fill the sequence
    byte = _probe(ByteTokenizer(), ["passkey"], 2, 256)
    assert (byte.rows("passkey")["loss_mask"][:, -1] == 1).all()


def test_exact_needs_every_answer_token_to_be_the_argmax(one_rank):
    from msa_model.training.retrieval_probe import _probe_loss

    g = torch.Generator().manual_seed(0)
    B, S, V, vocab = 4, 6, 12, 10
    logits = torch.randn(B, S, V, generator=g)
    labels = torch.randint(0, vocab, (B, S), generator=g)
    mask = torch.zeros(B, S)
    mask[:3, 3:5] = 1  # two answer tokens an example; row 3 pads the micro-batch, no example
    # example 0: both answer tokens the argmax; example 1: one of two; example 2: none forced
    for t in (3, 4):
        logits[0, t, labels[0, t]] = 50.0
    logits[1, 3, labels[1, 3]] = 50.0
    logits[1, 4, labels[1, 4]] = -50.0
    # a padded vocabulary row (id >= vocab) above the target does not count against it
    logits[0, 3, vocab + 1] = 100.0
    _, n, payload = _probe_loss(labels, mask, vocab, logits)
    loss_sum, tokens, rank_sum, exact, examples = payload["probe"].tolist()
    want_lp = torch.log_softmax(logits[..., :vocab], -1).gather(-1, labels[..., None])[..., 0]
    want_rank = (logits[..., :vocab] > logits[..., :vocab].gather(-1, labels[..., None])).sum(-1).float()
    assert int(n) == tokens == 6 and examples == 3
    assert math.isclose(loss_sum, float(-(want_lp * mask).sum()), rel_tol=1e-6)
    assert rank_sum == float((want_rank * mask).sum())
    assert exact == 1 + float((want_rank[2, 3:5] == 0).all())


@pytest.fixture(scope="module")
def small_model(one_rank):
    """An untrained MSA-MoE model of a 256-token context over the byte tokenizer, eval mode."""
    return _small_model(257)


def _small_model(vocab_size: int):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from omegaconf import OmegaConf

    from msa_model.config import ModelConfig, ParallelConfig
    from msa_model.model.gpt import build_model

    cfg = OmegaConf.structured(ModelConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2, head_dim=16,
        seq_length=256, num_experts=4, moe_ffn_hidden_size=32, first_dense_layers=1, attention="msa"))
    cfg.msa.block_size, cfg.msa.topk = 32, 2
    torch.manual_seed(3)
    model_parallel_cuda_manual_seed(3)
    model = build_model(cfg, ParallelConfig(), vocab_size=vocab_size, on_cpu=True)
    model.eval()
    return model


def test_the_probe_equals_the_offline_evaluation(small_model):
    from data.tokenizer import ByteTokenizer
    from msa_model.eval.runner import score_example
    from msa_model.model.attention import msa_layers

    model = small_model
    # the sparse phase: the selection reads 2 of up to 8 blocks, so the probe's padding must not matter
    assert all(m.sparse for m in msa_layers(model))
    tokenizer = ByteTokenizer()
    probe = _probe(tokenizer, ["passkey", "kvrecall"], 4, 256)
    got = probe.run([model], torch.device("cpu"))
    for task in ("passkey", "kvrecall"):
        scores = [score_example(model, torch.device("cpu"), ex, tokenizer) for ex in probe._examples(task)]
        answer = 5  # digits, one byte token each
        want_loss = -sum(s["logprob"] for s in scores) / (answer * len(scores))
        want_rank = sum(s["rank"] for s in scores) / len(scores)
        want_exact = sum(s["correct"] for s in scores) / len(scores)
        assert got[f"valid/probe/{task}/answer_loss"] == pytest.approx(want_loss, rel=1e-4)
        assert got[f"valid/probe/{task}/answer_rank"] == pytest.approx(want_rank, abs=1e-4)
        assert got[f"valid/probe/{task}/exact"] == want_exact
        # an untrained model: near-uniform over 257 ids, far from an answer
        assert 4.0 < got[f"valid/probe/{task}/answer_loss"] < 7.0


def test_the_examples_do_not_depend_on_the_micro_batch(small_model):
    """probe_samples examples whatever the micro-batch (the same at every data-parallel size):
    the rows that fill the last micro-batch are padding, not examples of other depths."""
    from data.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    got = {}
    for micro in (1, 2, 4):
        probe = _probe(tokenizer, ["passkey"], 3, 256, micro=micro)
        assert [ex.depth for ex in probe._examples("passkey")] == pytest.approx([1 / 6, 1 / 2, 5 / 6])
        assert probe.rows("passkey")["tokens"].shape[0] % micro == 0
        got[micro] = probe.run([small_model], torch.device("cpu"))
    for micro in (2, 4):
        for key, value in got[1].items():
            assert got[micro][key] == pytest.approx(value, rel=1e-5), (micro, key)


def test_examples_start_as_the_runs_documents_did(one_rank, tmp_path):
    """data.add_bos=true starts every training document with the tokenizer's BOS: the probe's
    examples start with it too (they did not, so the model was scored on documents unlike any it
    trained on), within model.seq_length tokens, and score as the offline evaluation's do."""
    from omegaconf import OmegaConf

    from data.tokenizer import build_tokenizer
    from msa_model.config import TrainConfig
    from msa_model.eval.runner import score_example
    from msa_model.training.run import _retrieval_probe

    tokdir = make_bpe_tokenizer(tmp_path / "tok")
    tokenizer = build_tokenizer(str(tokdir))
    assert tokenizer.bos is not None
    cfg = OmegaConf.structured(TrainConfig)
    cfg.data.tokenizer, cfg.data.add_bos, cfg.data.max_bytes = str(tokdir), True, 2_000_000
    cfg.model.seq_length, cfg.parallel.micro_batch_size = 256, 2
    cfg.trainer.probe_tasks, cfg.trainer.probe_samples = ["passkey", "kvrecall"], 3
    probe = _retrieval_probe(cfg, tokenizer)
    model, cpu = _small_model(tokenizer.vocab_size), torch.device("cpu")
    got = probe.run([model], cpu)
    for task in ("passkey", "kvrecall"):
        rows, examples = probe.rows(task), probe._examples(task)
        for i, ex in enumerate(examples):
            whole = tokenizer.tokenize(ex.prompt + ex.answer)
            assert rows["tokens"][i, 0] == tokenizer.bos
            assert rows["tokens"][i, 1:1 + len(whole) - 1].tolist() == whole[:-1].tolist()
            assert 1 + len(whole) <= 256 + 1
        scores = [score_example(model, cpu, ex, tokenizer, bos=tokenizer.bos) for ex in examples]
        tokens = int(sum(rows["loss_mask"][i].sum() for i in range(len(examples))))
        assert got[f"valid/probe/{task}/answer_loss"] == pytest.approx(-sum(s["logprob"] for s in scores) / tokens,
                                                                       rel=1e-4)
        assert got[f"valid/probe/{task}/exact"] == sum(s["correct"] for s in scores) / len(scores)
    # a run without data.add_bos: no BOS (the byte tokenizer has none either)
    cfg.data.add_bos = False
    assert _retrieval_probe(cfg, tokenizer).rows("passkey")["tokens"][0, 0] != tokenizer.bos


def test_a_run_logs_the_probe_without_a_validation_split(tmp_path, data_cache):
    run = tmp_path / "run"
    cmd = [str(REPO / "train.py"), "model=tiny", "trainer.max_steps=2", "optim.warmup_steps=1",
           "logging.log_interval=1", "logging.wandb_mode=disabled", "logging.tensorboard=false",
           "logging.progress_bar=false", "checkpoint.interval=0", "data.split=[100,0,0]",
           f"data.cache_dir={data_cache}", "trainer.eval_interval=2", "trainer.probe_tasks=[passkey]",
           "trainer.probe_samples=2", "trainer.indexer_warmup_tokens=0", f"run_dir={run}"]
    # forked from a process that has imported the trainer, in this process's environment (all cores)
    out = run_python(cmd, dict(os.environ), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "valid/probe/passkey/exact" not in records[0]
    last = records[-1]
    assert last["step"] == 2 and "valid/lm_loss" not in last
    assert 0.0 <= last["valid/probe/passkey/exact"] <= 1.0 and last["valid/probe/passkey/answer_loss"] > 0
    assert "retrieval probe at step 2 | passkey exact" in out.stderr + out.stdout


def test_a_blend_run_probes_without_a_validation_split_from_a_corpus_that_exists(tmp_path):
    """A run on data.blend cuts its probe's haystacks from data.source: a directory that is not
    there is refused before the run (it was a traceback once the run directory existed), and a
    data.split without a validation share is fine there too (refused as leaving no validation
    document, which the probe alone does not read)."""
    from omegaconf import OmegaConf

    from data.tokenizer import ByteTokenizer
    from msa_model.config import TrainConfig
    from msa_model.training.data_setup import tokenizer_problems
    from msa_model.training.inputs import check_inputs
    from tokenizer_fixtures import stdlib_texts, write_prepared

    prefix = write_prepared(tmp_path / "set", stdlib_texts(40), ByteTokenizer())
    cfg = OmegaConf.structured(TrainConfig)
    cfg.run_dir = str(tmp_path / "run")
    cfg.data.blend, cfg.data.split, cfg.data.tokenizer = [str(prefix)], [100, 0, 0], "byte"
    cfg.model.seq_length, cfg.trainer.eval_interval, cfg.trainer.probe_tasks = 256, 10, ["passkey"]
    assert tokenizer_problems(cfg, None, None)[2] == []
    cfg.data.source = str(tmp_path / "missing")
    assert any(f"data.source={tmp_path / 'missing'}: no such directory" in p for p in check_inputs(cfg, []))
    # without the probe, a blend run never reads data.source
    cfg.trainer.probe_tasks = []
    assert not any("data.source" in p for p in check_inputs(cfg, []))


@pytest.mark.parametrize("overrides, message", [
    (["trainer.probe_tasks=[needle]", "trainer.eval_interval=2"], "trainer.probe_tasks: unknown ['needle']"),
    (["trainer.probe_tasks=[passkey]"], "trainer.probe_tasks runs at every evaluation"),
    (["trainer.probe_tasks=[passkey]", "trainer.eval_interval=2", "trainer.probe_samples=0"],
     "trainer.probe_samples must be positive"),
    (["trainer.probe_tasks=[passkey]", "trainer.eval_interval=2", "data.source=null", "data.blend=[/x/y]"],
     "trainer.probe_tasks cuts its haystacks from a file-directory corpus"),
    # a passkey example takes 68 bytes: a traceback at the first evaluation, after the run trained
    (["trainer.probe_tasks=[passkey]", "trainer.eval_interval=1", "logging.log_interval=1", "model.seq_length=64",
      "model.msa.block_size=16", "model.msa.topk=2", "trainer.max_steps=1", "optim.warmup_steps=0",
      "trainer.indexer_warmup_tokens=0", "data.split=[100,0,0]"],
     "trainer.probe_tasks needs model.seq_length >= 256 (the shortest retrieval example of every task"),
])
def test_bad_probe_settings_are_refused(overrides, message):
    from hydra import compose, initialize_config_dir

    from msa_model.config import ConfigError, config_problems, register_configs, validate

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose("train", overrides=["model=tiny", "logging.log_interval=2", *overrides])
    with pytest.raises(ConfigError) as refused:
        validate(cfg, 1)
    assert any(message in line for line in config_problems(refused.value)), config_problems(refused.value)


def test_a_bad_probe_setting_is_one_line_before_anything_is_written(tmp_path):
    cmd = [str(REPO / "train.py"), "model=tiny", "logging.log_interval=2", f"run_dir={tmp_path / 'r'}",
           "trainer.probe_tasks=[needle]", "trainer.eval_interval=2"]
    out = run_python(cmd, dict(os.environ), timeout=300)
    assert out.returncode != 0
    assert "trainer.probe_tasks: unknown ['needle']" in out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert not (tmp_path / "r").exists()


def test_an_answer_merged_with_the_prompt_is_scored_as_training_saw_it(tmp_path):
    """vartrack asks `assert VAR_x == ` and a BPE merges the space with the first digit (" 5"):
    the example is tokenized as one text, the merged token is the answer's first, and the prompt
    does not end in a lone space token (which training never shows before a number)."""
    import random

    from data.retrieval import Haystack
    from data.tokenizer import build_tokenizer
    from msa_model.eval.runner import example_ids, example_of_tokens

    tokenizer = build_tokenizer(str(make_bpe_tokenizer(tmp_path / "tok")))
    haystack = Haystack(_stdlib_files(), 2_000_000, seed=0)
    merged = 0
    for i in range(12):
        ex = example_of_tokens("vartrack", 256, (i + 0.5) / 12, haystack, tokenizer, lambda: random.Random(i))
        ids, n = example_ids(ex, tokenizer)
        whole = tokenizer.tokenize(ex.prompt + ex.answer)
        assert ids.tolist() == whole.tolist()
        answer_text = tokenizer.detokenize(ids[-n:])
        assert answer_text.strip() == ex.answer.decode()
        if answer_text.startswith(" "):
            merged += 1
            # the prompt's own tokens stop before the merged space
            assert not tokenizer.detokenize(ids[-n - 1:-n]).endswith(" ")
        with_bos, m = example_ids(ex, tokenizer, bos=7)
        assert with_bos[0] == 7 and with_bos[1:].tolist() == ids.tolist() and m == n
    # the case this test is about happens on this tokenizer
    assert merged > 0
