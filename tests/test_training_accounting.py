"""What the trainer reports about a step: model FLOPs per token (TFLOP/s), and out-of-memory
failures turned into a message that names the stage, the peak and the remedies."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from msa_model.config import ModelConfig
from msa_model.training.flops import flops_per_token
from msa_model.model.gpt import count_parameters, padded_vocab_size
from msa_model.training.trainer import is_out_of_memory, out_of_memory_message
from skeleton_helpers import REPO, _env

VOCAB = 257


def _model(**kw) -> ModelConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), kw))


def test_linear_flops_are_six_times_the_active_weights():
    """With a context of one token no attention work remains: 6 x every weight a token meets,
    minus the input embedding lookup and the norms (which are not matrix products)."""
    for attention in ("msa", "dense"):
        m = _model(attention=attention, seq_length=1, moe_shared_expert_size=64)
        counts = count_parameters(m, VOCAB)
        h, di = m.hidden_size, m.msa.index_head_dim
        norms = m.num_layers * (2 * h + 2 * m.head_dim) + h
        if attention == "msa":
            norms += m.num_layers * 2 * di
        linear = counts["active"] - padded_vocab_size(VOCAB, m) * h - norms
        # one causal key: dense attention 12 Hq D; MSA adds the index score and the KL on it
        attn = 12 * m.num_attention_heads * m.head_dim
        if attention == "msa":
            attn += 2 * m.num_query_groups * di + 2 * m.num_attention_heads * m.head_dim + 6 * m.num_query_groups * di
        assert flops_per_token(m, VOCAB, keys_per_query=1.0) == pytest.approx(6 * linear + m.num_layers * attn)


def test_sparse_flops_grow_with_the_selected_keys_not_the_context():
    m = _model(attention="msa", seq_length=4096)
    n = m.msa.topk * m.msa.block_size
    dense = _model(attention="dense", seq_length=4096)
    sparse_4k = flops_per_token(m, VOCAB, keys_per_query=n)
    m.seq_length = 8192
    sparse_8k = flops_per_token(m, VOCAB, keys_per_query=n)
    # doubling the context adds only the index scores of the selection (2 G Di per extra causal key)
    extra = m.num_layers * 2 * m.num_query_groups * m.msa.index_head_dim * (8193 - 4097) / 2
    assert sparse_8k - sparse_4k == pytest.approx(extra)
    assert flops_per_token(dense, VOCAB) > sparse_4k
    # the warmup runs attention and the KL over every causal key: more than the dense model
    assert flops_per_token(m, VOCAB, sparse=False) > flops_per_token(_model(attention="dense", seq_length=8192), VOCAB)


def test_out_of_memory_is_recognised_through_nccl_and_named():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    # what a failed allocation inside the gradient reduction looked like at 128K
    nccl = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:3690, unhandled cuda error, NCCL version 2.27.7\n"
                        "Last error:\nFailed to CUDA calloc async 24 bytes")
    assert is_out_of_memory(nccl)
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))
    text = out_of_memory_message(torch.device("cpu"), "forward and backward", 7, 131072, 1)
    for needed in ("forward and backward", "step 7", "131,072", "model.recompute=selective", "model.recompute=full",
                   "parallel.cp", "model.seq_length"):
        assert needed in text, (needed, text)
    assert "cuda_graph" not in text
    # with the graphs on, their pools come first, and the recompute and CP remedies need them off
    graphed = out_of_memory_message(torch.device("cpu"), "forward and backward", 7, 32768, 1, cuda_graph=True)
    assert graphed.index("model.msa.cuda_graph=false") < graphed.index("model.recompute=selective")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real out-of-memory needs a GPU")
def test_out_of_memory_run_ends_with_the_message(tmp_path):
    """A context far beyond one GPU: the run exits 1 with the message, not a traceback."""
    args = ["model=small", "recipe=dense", "model.seq_length=4194304", "parallel.micro_batch_size=1",
            "parallel.global_batch_size=1", "trainer.max_steps=2", "optim.warmup_steps=1",
            "logging.wandb_mode=disabled", "logging.tensorboard=false", "logging.progress_bar=false",
            f"run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "out of memory on cuda" in out and "Remedies" in out and "model.recompute" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
