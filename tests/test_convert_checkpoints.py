"""Converted checkpoints in use: dense-to-msa on a trainer checkpoint, CPT from a converted
Hugging Face model, and loading at other parallel layouts (TP=2 dense and MoE, EP=2) over gloo.

Everything runs the real entry points (train.py, `python -m msa_model.convert`) in subprocesses,
on CPU: forked from a process that has imported the trainer (tests/train_server.py), the ranks of
a 2-process job too, except the verify at TP=2, which runs under torchrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from msa_model.convert.hf_io import load_all

from convert_fixtures import save_tiny_hf
import train_server
from skeleton_helpers import run_python, run_ranks

REPO = Path(__file__).resolve().parents[1]
GEOMETRY = ["--seq-length", "128", "--block-size", "16", "--topk", "2"]
# data.tokenizer=byte: the tiny Hugging Face models are saved without tokenizer files, so their
# conversions record none and a run from them names the tokenizer it reads
RUN = ["data.tokenizer=byte", "data.max_bytes=100000", "parallel.micro_batch_size=1", "parallel.global_batch_size=2",
       "logging.wandb_mode=disabled", "logging.tensorboard=false", "logging.log_interval=1",
       "logging.progress_bar=false", "checkpoint.interval=0", "trainer.stop_signals=[]", "optim.warmup_steps=1"]
# a small dense-attention baseline of our own (MoE, GQA 4q/2kv)
TINY_DENSE = ["model=tiny", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
              "model.num_attention_heads=4", "model.num_query_groups=2", "model.head_dim=16",
              "model.num_experts=2", "model.moe_ffn_hidden_size=64", "model.seq_length=64",
              "model.msa.block_size=16", "model.msa.topk=2", "model.msa.index_head_dim=16"]


def _run(args: list[str], timeout: int = 300, torchrun: int = 0,
         fork_ranks: bool = False) -> subprocess.CompletedProcess:
    """`python *args`, or `torchrun` with `torchrun` ranks (fork_ranks: the ranks forked instead,
    skeleton_helpers.run_ranks; the verify of a TP=1 conversion at TP=2 keeps the real torchrun)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}"] if torchrun else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if args[0] in ("train.py", "-m") and not torchrun:
        proc = run_python(args, env, timeout)  # forked from a process that has imported the trainer
    elif fork_ranks and train_server.enabled():
        proc = run_ranks(args, torchrun, env, timeout)
    else:
        proc = subprocess.run([*launcher, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _convert(*args: str, **kw) -> subprocess.CompletedProcess:
    return _run(["-m", "msa_model.convert", *args], **kw)


def _verify_json(proc: subprocess.CompletedProcess) -> dict:
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def _checkpoint_tensors(step_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Every tensor stored in a dist_checkpointing directory, by its checkpoint key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(tmp))
    return {k: v for k, v in torch.load(tmp, weights_only=False).items() if torch.is_tensor(v)}


def _step_dir(root: Path) -> Path:
    return root / (root / "latest").read_text().strip()


def test_dense_to_msa_keeps_every_tensor(tmp_path):
    run = tmp_path / "dense"
    _run(["train.py", "recipe=dense", *TINY_DENSE, *RUN, f"run_dir={run}", "trainer.max_steps=2"])
    out = tmp_path / "msa"
    _convert("dense-to-msa", str(run / "checkpoints"), str(out), "--index-init", "derived")

    dense = _checkpoint_tensors(_step_dir(run / "checkpoints"), tmp_path / "dense.pt")
    msa = _checkpoint_tensors(_step_dir(out), tmp_path / "msa.pt")
    model_keys = {k for k in dense if not k.startswith("optimizer")}
    assert any(".linear_qkv.weight" in k for k in model_keys)
    for k in model_keys:
        assert k in msa and msa[k].dtype == dense[k].dtype and torch.equal(msa[k], dense[k]), k
    added = set(msa) - model_keys
    assert added == {f"decoder.layers.{i}.self_attention.index_{n}.weight" for i in range(2)
                     for n in ("q_proj", "k_proj", "q_layernorm", "k_layernorm")}

    # derived init: index query of a group = mean of its query heads, index key = mean of the key heads
    g, heads, d = 2, 4, 16
    qkv = dense["decoder.layers.1.self_attention.linear_qkv.weight"].reshape(g, heads // g + 2, d, -1)
    expected_iq = qkv[:, : heads // g].mean(dim=1).reshape(g * d, -1)
    expected_ik = qkv[:, heads // g].mean(dim=0)
    torch.testing.assert_close(msa["decoder.layers.1.self_attention.index_q_proj.weight"], expected_iq)
    torch.testing.assert_close(msa["decoder.layers.1.self_attention.index_k_proj.weight"], expected_ik)
    assert torch.equal(msa["decoder.layers.1.self_attention.index_q_layernorm.weight"],
                       dense["decoder.layers.1.self_attention.q_layernorm.weight"])
    yaml = (out / "model" / "tiny-msa.yaml").read_text()
    assert "attention: msa" in yaml


def test_cpt_from_converted_hf_model(tmp_path):
    """recipe=cpt with init_from= a converted Qwen3-MoE trains on CPU through the warmup into top-k."""
    hf = save_tiny_hf("qwen3_moe", tmp_path / "hf")
    conv = tmp_path / "conv"
    _convert("hf-to-msa", str(hf), str(conv), *GEOMETRY, "--name", "qwen3moe-tiny")
    run = tmp_path / "cpt"
    _run(["train.py", "recipe=cpt", f"hydra.searchpath=[file://{conv}]", "model=qwen3moe-tiny", f"init_from={conv}",
          *RUN, f"run_dir={run}", "trainer.max_steps=4", "trainer.indexer_warmup_tokens=256"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor([r["lm_loss"], r["kl_loss"]])).all() for r in rows)
    assert rows[0]["keys_per_query"] > rows[-1]["keys_per_query"]  # dense warmup, then top-k blocks
    # a Hugging Face model records no data position to continue: refused in one line, before any step
    proc = run_python(["train.py", "recipe=cpt", f"hydra.searchpath=[file://{conv}]", "model=qwen3moe-tiny",
                       f"init_from={conv}", "init_from_data_position=true", *RUN, f"run_dir={tmp_path / 'continued'}",
                       "trainer.max_steps=4", "trainer.indexer_warmup_tokens=256"],
                      {**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and "init_from_data_position" in proc.stderr, proc.stderr[-3000:]
    assert "records no data position" in proc.stderr and not (tmp_path / "continued" / "checkpoints").exists()

    # the trained checkpoint exports as Qwen3-MoE (family found through the run's init_from)
    back = tmp_path / "back"
    _convert("msa-to-hf", str(run / "checkpoints"), str(back))
    src, trained = load_all(hf), load_all(back)
    assert set(src) < set(trained)
    # training started from the converted weights: a few small steps away, not a fresh init
    for name, t in src.items():
        delta = (trained[name] - t).abs().max().item()
        assert delta < 0.05, (name, delta)
    assert any((trained[n] != t).any() for n, t in src.items())
    # the index branch started from the derived init and was trained by the KL
    q = src["model.layers.1.self_attn.q_proj.weight"].reshape(2, 2, 16, 64)
    derived_iq = q.mean(dim=1).reshape(32, 64)
    trained_iq = trained["model.layers.1.self_attn.index_q_proj.weight"]
    assert 0 < (trained_iq - derived_iq).abs().max().item() < 0.05


@pytest.fixture(scope="module")
def qwen3_converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    hf = save_tiny_hf("qwen3", root / "hf")
    _convert("hf-to-msa", str(hf), str(root / "msa"), *GEOMETRY, "--tp", "2")
    return root


def test_tp1_checkpoint_loads_at_tp2(qwen3_converted):
    """Converted at TP=1, loaded at TP=2 by 2 gloo processes: the same logits in both attention phases."""
    root = qwen3_converted
    hf, msa = str(root / "hf"), str(root / "msa")
    one = _verify_json(_convert("verify", hf, msa, "--save-logits", str(root / "tp1.pt")))
    two = _verify_json(_convert("verify", hf, msa, "--tp", "2", "--save-logits", str(root / "tp2.pt"), torchrun=2))
    assert two["tp"] == 2 and two["max_abs_diff"] <= 1e-4 and two["mean_kl"] <= 1e-6, two
    a, b = torch.load(root / "tp1.pt"), torch.load(root / "tp2.pt")
    assert torch.equal(a["tokens"], b["tokens"])
    torch.testing.assert_close(b["logits"], a["logits"], rtol=0, atol=1e-5)
    # the sparse phase depends on the index branch (column-parallel at TP=2): it must load right too
    torch.testing.assert_close(b["sparse_logits"], a["sparse_logits"], rtol=0, atol=1e-5)
    assert (a["sparse_logits"] - a["logits"]).abs().max() > 1e-3  # top-k really drops keys here
    print(f"qwen3 TP=1 vs HF: {one}; TP=2 vs HF: {two}")


def test_moe_checkpoint_loads_at_ep2(tmp_path):
    hf = save_tiny_hf("mixtral", tmp_path / "hf")
    _convert("hf-to-msa", str(hf), str(tmp_path / "msa"), *GEOMETRY, "--ep", "2")
    r = _verify_json(_convert("verify", str(hf), str(tmp_path / "msa"), "--ep", "2", torchrun=2, fork_ranks=True))
    print(f"mixtral EP=2 vs HF: {r}")
    assert r["ep"] == 2 and r["max_abs_diff"] <= 1e-4 and r["mean_kl"] <= 1e-6


def test_moe_checkpoint_loads_at_tp2(tmp_path):
    """MoE at TP=2 runs with sequence parallelism: experts, router and SP norms load from a TP=1 save."""
    hf = save_tiny_hf("qwen3_moe", tmp_path / "hf")
    _convert("hf-to-msa", str(hf), str(tmp_path / "msa"), *GEOMETRY, "--tp", "2")
    r = _verify_json(_convert("verify", str(hf), str(tmp_path / "msa"), "--tp", "2", torchrun=2, fork_ranks=True))
    print(f"qwen3_moe TP=2 (SP) vs HF: {r}")
    assert r["tp"] == 2 and r["max_abs_diff"] <= 1e-4 and r["mean_kl"] <= 1e-6


def test_converted_checkpoint_loads_at_pp2(tmp_path):
    """A converted Llama at PP=2 (one layer per stage, 2 gloo processes): the first step's loss and KL
    (a function of the loaded weights alone, dense warmup) and the second's (top-k) equal those of
    the same run at PP=1."""
    hf = save_tiny_hf("llama", tmp_path / "hf")
    conv = tmp_path / "conv"
    _convert("hf-to-msa", str(hf), str(conv), *GEOMETRY, "--name", "llama-tiny")
    common = ["train.py", "recipe=cpt", f"hydra.searchpath=[file://{conv}]", "model=llama-tiny", f"init_from={conv}",
              *RUN, "trainer.max_steps=2", "trainer.indexer_warmup_tokens=256", "checkpoint.save_at_end=false"]
    _run([*common, f"run_dir={tmp_path / 'pp1'}"])
    _run([*common, f"run_dir={tmp_path / 'pp2'}", "parallel.pp=2"], torchrun=2, fork_ranks=True)
    one, two = ([json.loads(line) for line in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
                for r in ("pp1", "pp2"))
    assert [r["phase"] for r in one] == [r["phase"] for r in two] == ["warmup", "sparse"]
    for a, b in zip(one, two):
        for key in ("lm_loss", "kl_loss"):
            assert abs(b[key] - a[key]) <= 1e-5 * abs(a[key]), (a["step"], key, a[key], b[key])
