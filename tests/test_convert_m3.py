"""MiniMax-M3 <-> MSA, checked against transformers' M3 implementation running sparse attention.

The tiny M3 (tests/convert_fixtures.py, M3_TINY) uses every option the mapping covers: MSA and
full-attention layers mixed, MoE and dense MLPs out of leading order, 2 forced local blocks in a
top-3 of 16-token blocks, a wider index head, partial RoPE, the clamped quick-GELU GLU with a
clamp that bites, a sigmoid router with a non-zero expert bias, routed scaling, a shared expert,
(1 + w) norms. Sequences of 128 tokens hold 8 blocks, so the selection matters.

Conversions and our forward passes run in one worker process (this file as a script), as in
tests/test_convert_hf.py; the tests assert on its JSON and on the files it wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# run as the worker script, import this checkout's msa_model (not whichever the virtualenv points at)
sys.path.insert(0, str(REPO))

from convert_fixtures import M3_TINY, save_tiny_m3  # noqa: E402
from msa_model.convert.hf_io import load_all  # noqa: E402
from skeleton_helpers import run_python  # noqa: E402

PARITY_MAX_ABS = 1e-4
SEQ = 128
# the vision-language checkpoint (release layout): layer 0 full with a dense MLP, one local block
VL = dict(layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
          mlp_layer_types=["dense", "sparse", "sparse"], index_local_blocks=1, swiglu_alpha=1.702)


def _selections(hf_dir: str, msa_dir: str, tokens: torch.Tensor) -> dict:
    """Logits of both models (ours in the top-k phase) and every MSA layer's selected blocks."""
    import transformers

    import msa_model.model.attention as attention
    from msa_model.convert.verify import compare, our_logits

    ours_idx, theirs_idx = [], []
    real = attention.msa_attention

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        ours_idx.append(out[2])
        return out

    attention.msa_attention = spy
    try:
        ours = our_logits(msa_dir, tokens, sparse=True)
    finally:
        attention.msa_attention = real
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    model = getattr(transformers, cfg["architectures"][0]).from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    for module in model.modules():
        if type(module).__name__ == "MiniMaxM3VLIndexer":
            module.register_forward_hook(lambda m, args, out: theirs_idx.append(out))
    with torch.no_grad():
        theirs = model(tokens).logits.float()
    same = [torch.equal(o.long().sort(-1).values, t.permute(0, 2, 1, 3).long().sort(-1).values)
            for o, t in zip(ours_idx, theirs_idx)]
    return {**compare(theirs, ours), "layers_compared": len(same), "same_blocks": all(same) and len(ours_idx) == len(theirs_idx)}


def _worker(root: Path) -> dict:
    from msa_model.convert.commands import hf_to_msa, msa_to_hf
    from msa_model.convert.verify import random_tokens, verify

    results = {}
    tokens = random_tokens(M3_TINY["vocab_size"], 2, SEQ, seed=0)
    for name in ("text", "vl"):
        hf, msa, back = root / name / "hf", root / name / "msa", root / name / "hf_back"
        hf_to_msa(str(hf), str(msa), seq_length=256)
        r = {"parity": _selections(str(hf), str(msa), tokens)}
        msa_to_hf(str(msa), str(back), max_shard_size=40_000 if name == "vl" else 5 * 2**30)
        r["exported"] = verify(str(back), str(msa), batches=1, seq_length=SEQ, seed=1)
        results[name] = r
    # an exported M3 converts back with its index branch and every tensor as it was (an
    # --index-init given is not used, and said so)
    hf_to_msa(str(root / "text" / "hf_back"), str(root / "text" / "msa_again"), seq_length=256, index_init="derived")
    # a trained branch whose conversion record holds an earlier export's "untrained" word (as one
    # converted from an untrained export and trained since would): the checkpoint's history decides
    stale = root / "text" / "msa_stale"
    shutil.copytree(root / "text" / "msa", stale)
    record = json.loads((stale / "conversion.json").read_text())
    record["hf_config"]["msa_index_trained"] = False
    (stale / "conversion.json").write_text(json.dumps(record))
    msa_to_hf(str(stale), str(root / "text" / "hf_stale"))
    return results


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_m3")
    save_tiny_m3(root / "text" / "hf", seed=3)
    save_tiny_m3(root / "vl" / "hf", seed=4, vision=True, **VL)
    out = root / "results.json"
    proc = run_python([__file__, str(root), str(out)], timeout=900)  # forked (tests/train_server.py)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return root, json.loads(out.read_text()), proc.stderr


@pytest.mark.parametrize("layout", ["text", "vl"])
def test_sparse_parity_with_transformers(converted, layout):
    """Our model in the top-k phase = transformers' M3: logits within 1e-4, the same blocks in every MSA layer."""
    _, results, _ = converted
    r = results[layout]["parity"]
    print(f"M3 {layout}: max|diff| {r['max_abs_diff']:.2e} mean KL {r['mean_kl']:.2e}, {r['layers_compared']} MSA layers")
    assert r["layers_compared"] == 2 and r["same_blocks"]
    assert r["max_abs_diff"] <= PARITY_MAX_ABS and r["mean_kl"] <= 1e-6


def test_round_trip_bit_identical(converted):
    """M3 -> ours -> M3 (`msa-to-hf`, the family found in conversion.json): every tensor and the config back."""
    root, results, _ = converted
    src, back = load_all(root / "text" / "hf"), load_all(root / "text" / "hf_back")
    assert set(src) == set(back) and any(".indexer." in n for n in src)
    for name, t in src.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert json.loads((root / "text" / "hf" / "config.json").read_text()) == \
        json.loads((root / "text" / "hf_back" / "config.json").read_text())
    exported = results["text"]["exported"]
    assert exported["phase"] == "sparse (top-k)" and exported["max_abs_diff"] <= PARITY_MAX_ABS


def test_release_layout_reads_like_transformers(converted):
    """The release layout (vision-language checkpoint) maps to the same tensors transformers builds from it;
    the vision tower, projector and patch merger are named and skipped."""
    import transformers

    root, results, _ = converted
    vl = transformers.MiniMaxM3SparseForConditionalGeneration.from_pretrained(str(root / "vl" / "hf"), dtype=torch.float32)
    expected = {}
    for name, t in vl.state_dict().items():
        if name.startswith("model.language_model."):
            expected["model." + name[len("model.language_model."):]] = t
        elif name == "lm_head.weight":
            expected[name] = t
    back = load_all(root / "vl" / "hf_back")
    assert (root / "vl" / "hf_back" / "model.safetensors.index.json").is_file()  # written in shards
    assert set(back) == set(expected)
    for name, t in expected.items():
        assert torch.equal(back[name], t), name
    record = json.loads((root / "vl" / "msa" / "conversion.json").read_text())
    assert record["family"] == "minimax_m3" and record["index_init"] == "from checkpoint"
    names = load_all(root / "vl" / "hf").keys()
    parts = ("vision_tower", "multi_modal_projector", "patch_merge_mlp")
    assert record["skipped"] == {p: sum(n.startswith(p + ".") for n in names) for p in parts}
    assert record["skipped"]["vision_tower"] > 0
    assert results["vl"]["exported"]["max_abs_diff"] <= PARITY_MAX_ABS


def _tensors(step_dir: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(tmp))
    return {k: v for k, v in torch.load(tmp, weights_only=False).items() if torch.is_tensor(v)}


def test_an_export_of_a_trained_branch_says_nothing_of_untrained(converted):
    """msa_index_trained (msa-to-hf's word for an untrained index branch) is not written for M3's
    trained one, nor carried over from the conversion record's config."""
    root, _, _ = converted
    for name in ("hf_back", "hf_stale"):
        assert "msa_index_trained" not in json.loads((root / "text" / name / "config.json").read_text()), name


def test_reimport_is_the_same_checkpoint(converted, tmp_path):
    root, _, log = converted
    assert "carries its index branch, which is read as it is: --index-init derived is not used" in log
    first = _tensors(root / "text" / "msa" / "step_00000000", tmp_path / "a.pt")
    again = _tensors(root / "text" / "msa_again" / "step_00000000", tmp_path / "b.pt")
    assert set(first) == set(again) and any(k.endswith("router.expert_bias") for k in first)
    for k in first:
        assert torch.equal(first[k], again[k]), k
    # full-attention layer 1 has no index branch; MSA layers 0 and 2 do
    assert {k.split(".")[2] for k in first if ".index_q_proj." in k} == {"0", "2"}


def _cpt_config(init_from: Path):
    from hydra import compose, initialize_config_dir

    from msa_model.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return compose("train", overrides=["recipe=cpt", f"init_from={init_from}"])


def test_cpt_from_a_converted_m3_starts_sparse_unless_told(converted):
    """MiniMax trained M3's index branch: the conversion records it, and recipe=cpt from it needs
    no dense warmup, unless the command line asks for one (tests/test_convert_hf.py: a Llama's)."""
    from msa_model.training.index_history import index_branch_trained, plan_indexer_warmup

    root, _, _ = converted
    msa = root / "text" / "msa"
    assert json.loads((msa / "conversion.json").read_text())["index_trained"] is True
    assert index_branch_trained(msa) is True and index_branch_trained(msa / "step_00000000") is True
    cfg = _cpt_config(msa)
    recipe_tokens = cfg.trainer.indexer_warmup_tokens
    assert recipe_tokens > 0 and cfg.trainer.indexer_warmup_from_init
    note = plan_indexer_warmup(cfg, warmup_given=False)
    assert cfg.trainer.indexer_warmup_tokens == 0
    assert note.startswith("indexer warmup: none, sparse attention from the first step") and "trained" in note
    cfg = _cpt_config(msa)
    note = plan_indexer_warmup(cfg, warmup_given=True)
    assert cfg.trainer.indexer_warmup_tokens == recipe_tokens and "on the command line" in note


def test_m3_tiny_trains_and_exports(tmp_path, data_cache):
    """The m3_tiny preset trains on CPU (a dense-warmup step, then a top-k step); its checkpoint exports
    with `msa-to-hf --format minimax_m3` and transformers runs it with our logits (top-k, 8 blocks)."""
    run, out = tmp_path / "run", tmp_path / "m3"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train = [sys.executable, "train.py", "model=m3_tiny", f"run_dir={run}", f"data.cache_dir={data_cache}",
             "data.max_bytes=100000", "parallel.micro_batch_size=1", "parallel.global_batch_size=2",
             "trainer.max_steps=2", "trainer.indexer_warmup_tokens=1024", "optim.warmup_steps=1",
             "checkpoint.interval=0", "logging.log_interval=1", "logging.wandb_mode=disabled",
             "logging.tensorboard=false", "logging.progress_bar=false", "trainer.stop_signals=[]",
             "data.document_mask=false"]
    convert = [sys.executable, "-m", "msa_model.convert"]
    for cmd in (train, [*convert, "msa-to-hf", str(run / "checkpoints"), str(out), "--format", "minimax_m3"],
                [*convert, "verify", str(out), str(run / "checkpoints"), "--seq-length", "256", "--batches", "1"]):
        proc = run_python(cmd[1:], env, 600)  # forked from a process that has imported the trainer
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["warmup", "sparse"]
    assert all(torch.isfinite(torch.tensor([r["lm_loss"], r["kl_loss"]])).all() for r in rows)
    # keys/q averages the 3 MSA layers: all causal keys (documents not masked), then at most top-4 x 32
    assert rows[0]["keys_per_query"] == 256.5 and rows[1]["keys_per_query"] <= 128
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    print(f"m3_tiny exported vs transformers: {result}")
    assert result["phase"] == "sparse (top-k)" and result["max_abs_diff"] <= PARITY_MAX_ABS
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["full_attention"] + ["minimax_m3_sparse"] * 3
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5 and config["index_local_blocks"] == 2
    # the byte tokenizer's ids, not M3's defaults (200034 / 200020) past the 320 rows
    assert (config["bos_token_id"], config["eos_token_id"]) == (None, 256), config
    assert "must be `None` or an integer within the vocabulary" not in proc.stdout + proc.stderr
    # the aux-loss-free balancing bias moved after each step (megatron's expert-bias update)
    tensors = load_all(out)
    assert any(tensors[f"model.layers.{i}.mlp.gate.e_score_correction_bias"].abs().sum() > 0 for i in (1, 2, 3))


def _indexer_inputs(cfg, hidden, position_ids, zero_keys=False):
    """transformers' M3 indexer and what it computes before selecting: iq [B, S, G, Di], ik [B, S, Di]."""
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m3

    torch.manual_seed(0)
    indexer = m3.MiniMaxM3VLIndexer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in indexer.parameters():
            p.normal_(0, 0.2)
        if zero_keys:
            indexer.k_proj.weight.zero_()
        cos, sin = m3.MiniMaxM3VLRotaryEmbedding(cfg)(hidden, position_ids)
        B, S, _ = hidden.shape
        iq = indexer.q_norm(indexer.q_proj(hidden).view(B, S, -1, cfg.index_head_dim)).transpose(1, 2)
        ik = indexer.k_norm(indexer.k_proj(hidden).view(B, S, 1, cfg.index_head_dim)).transpose(1, 2)
        iq, ik = m3.apply_rotary_pos_emb(iq, ik, cos[..., :cfg.index_head_dim], sin[..., :cfg.index_head_dim])
        theirs = indexer(hidden, (cos, sin), None, position_ids)
    return iq.transpose(1, 2).contiguous(), ik[:, 0].contiguous(), theirs.permute(0, 2, 1, 3)


def _as_sets(idx):
    return idx.long().sort(-1).values


def test_block_anchoring_differs_with_shifted_positions():
    """Documented difference: our blocks (and causality) count from the first token of the sequence;
    transformers takes a query's block and causal limit from position_ids, its keys' blocks from
    their cache slots. They agree for position_ids 0..S-1 and differ for shifted ones."""
    from transformers import MiniMaxM3VLTextConfig

    from msa_model.ops import select_blocks

    cfg = MiniMaxM3VLTextConfig(**M3_TINY)
    bs, k, local = cfg.index_block_size, cfg.index_topk_blocks, cfg.index_local_blocks
    # 100 tokens: the shifted last query (position 107) still has a key block of its number (block 6),
    # which transformers' indexer needs
    hidden = torch.randn(1, 100, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    t = torch.arange(100)
    for offset in (0, 8):
        iq, ik, theirs = _indexer_inputs(cfg, hidden, (t + offset)[None])
        ours = select_blocks(iq, ik, bs, k, local_blocks=local, backend="reference")
        if offset == 0:
            assert torch.equal(_as_sets(ours), _as_sets(theirs))
            continue
        # ours: the local blocks of query t are t // bs and the one before; never a block after t // bs
        assert bool((ours.long() <= (t // bs)[None, :, None, None]).all())
        # transformers: (t + offset) // bs, which for t = 8..15 is block 1, keys 16..31 after the query
        theirs_local = ((t + offset) // bs)[None, :, None, None]
        assert bool((theirs.long() == theirs_local).any(-1).all())
        assert bool((theirs[:, 8:16].long() == 1).any(-1).all())


def test_tied_block_scores():
    """Documented difference: among equal block scores transformers keeps whichever torch.topk
    returns; our reference and Triton kernel keep the lowest block ids. Forced blocks are kept by all."""
    from transformers import MiniMaxM3VLTextConfig

    from msa_model.ops import select_blocks

    cfg = MiniMaxM3VLTextConfig(**M3_TINY)
    bs, k, local = cfg.index_block_size, cfg.index_topk_blocks, cfg.index_local_blocks
    hidden = torch.randn(1, 100, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    # a zero index key: every visible block scores exactly 0
    iq, ik, theirs = _indexer_inputs(cfg, hidden, torch.arange(100)[None], zero_keys=True)
    assert not bool(ik.any())
    kw = dict(block_size=bs, topk=k, local_blocks=local)
    triton, reference = select_blocks(iq, ik, backend="triton", **kw), select_blocks(iq, ik, backend="reference", **kw)
    nloc = torch.arange(100) // bs
    for t in range(100):
        forced = {n for n in (nloc[t].item(), nloc[t].item() - 1) if n >= 0}
        free = sorted(set(range(nloc[t].item() + 1)) - forced)[: k - len(forced)]
        for ours in (triton, reference):
            assert set(ours[0, t, 0].tolist()) - {-1} == forced | set(free), t  # lowest ids win the ties
        chosen = set(theirs[0, t, 0].tolist()) - {-1}
        assert forced <= chosen <= set(range(nloc[t].item() + 1)) and len(chosen) == min(k, nloc[t].item() + 1)


def test_config_refusals():
    """What M3 allows but our MSA (or megatron's router) cannot run the same way is refused by name."""
    from msa_model.convert.families import model_config_from_hf
    from msa_model.convert.hf_io import ConversionError

    base = {**M3_TINY, "architectures": ["MiniMaxM3VLForCausalLM"], "model_type": "minimax_m3_vl_text"}
    for change, message in (
        (dict(index_n_heads=4), r"index_n_heads \(4\) != num_key_value_heads \(2\)"),
        (dict(index_local_blocks=4), r"index_local_blocks \(4\) must be in \[1, index_topk_blocks=3\]"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
         r"rotary_dim=8 but no partial_rotary_factor: transformers rotates all 16 channels"),
        (dict(num_experts_per_tok=1), r"num_experts_per_tok=1"),
        (dict(layer_types=["full_attention", "sliding_attention", "minimax_m3_sparse"]),
         r"layer_types has unsupported value\(s\) \['sliding_attention'\]"),
        (dict(quantization_config={"quant_method": "fp8"}), r"a quantized checkpoint \(quant_method='fp8'\)"),
    ):
        with pytest.raises(ConversionError, match=message):
            model_config_from_hf({**base, **change}, where="m3/config.json")
    # a vision-language config is read through its text_config
    fam, model = model_config_from_hf({"architectures": ["MiniMaxM3SparseForConditionalGeneration"],
                                       "text_config": dict(M3_TINY), "vision_config": {}})
    assert fam.name == "minimax_m3" and model.attention_types == ["msa", "full", "msa"]
    assert model.mlp_types == ["moe", "dense", "moe"] and model.rotary_dim == 8 and model.msa.local_blocks == 2


def test_config_reads_as_transformers_reads_it():
    """MiniMax's release config.json (index geometry in `sparse_attention_config`, layer types as 0/1
    `sparse_attention_freq` / `moe_layer_freq`) and keys a config leaves out read as transformers'
    MiniMaxM3VLTextConfig reads them: the model converted is the model transformers runs."""
    import transformers

    from msa_model.convert.families import model_config_from_hf

    left_out = ("layer_types", "mlp_layer_types", "index_n_heads", "index_head_dim", "index_block_size",
                "index_topk_blocks", "index_local_blocks", "routed_scaling_factor", "num_experts_per_tok",
                "shared_intermediate_size", "dense_intermediate_size", "num_local_experts", "rope_parameters")
    cfg = {k: v for k, v in M3_TINY.items() if k not in left_out}
    cfg.update(partial_rotary_factor=0.5, moe_layer_freq=[1, 0, 1], sparse_attention_config=dict(
        sparse_attention_freq=[0, 1, 1], sparse_num_index_heads=2, sparse_index_dim=24, sparse_block_size=32,
        sparse_topk_blocks=4, sparse_local_block=2))
    theirs = transformers.MiniMaxM3VLTextConfig(**cfg)
    _, ours = model_config_from_hf({"architectures": ["MiniMaxM3VLForCausalLM"], **cfg})
    assert ours.attention_types == [{"full_attention": "full", "minimax_m3_sparse": "msa"}[t] for t in theirs.layer_types]
    assert ours.mlp_types == [{"dense": "dense", "sparse": "moe"}[t] for t in theirs.mlp_layer_types]
    assert (ours.msa.index_head_dim, ours.msa.block_size, ours.msa.topk, ours.msa.local_blocks) == (
        theirs.index_head_dim, theirs.index_block_size, theirs.index_topk_blocks, theirs.index_local_blocks)
    assert (ours.moe_router_topk_scaling_factor, ours.moe_router_topk, ours.moe_shared_expert_size,
            ours.ffn_hidden_size, ours.num_experts) == (
        theirs.routed_scaling_factor, theirs.num_experts_per_tok, theirs.shared_intermediate_size,
        theirs.dense_intermediate_size, theirs.num_local_experts)
    assert ours.rotary_base == theirs.rope_parameters["rope_theta"] and ours.rotary_dim == 8


def test_export_refuses_what_m3_cannot_express():
    from msa_model.config import ModelConfig
    from msa_model.convert.families import FAMILIES
    from msa_model.convert.hf_io import ConversionError

    with pytest.raises(ConversionError, match=r"cannot export as minimax_m3: norm_zero_centered=false .*"
                                              r"activation=swiglu .*moe_router_score_function=softmax"):
        FAMILIES["minimax_m3"].check_exportable(ModelConfig())
    m3_like = ModelConfig(norm_zero_centered=True, activation="quick_geglu", glu_linear_offset=1.0,
                          activation_clamp=7.0, moe_router_score_function="sigmoid", moe_shared_expert_size=64)
    FAMILIES["minimax_m3"].check_exportable(m3_like)
    with pytest.raises(ConversionError, match=r"cannot export as llama: .*norm_zero_centered=true"):
        FAMILIES["llama"].check_exportable(m3_like)


if __name__ == "__main__":
    root_dir, out_file = Path(sys.argv[1]), Path(sys.argv[2])
    out_file.write_text(json.dumps(_worker(root_dir), indent=2))
