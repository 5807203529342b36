"""Hugging Face <-> MSA conversion, checked by numbers on tiny random models of every family.

The conversions and forward passes run in one worker process (this file run as a script):
megatron's parallel state and the CPU shim are process-wide, so they stay out of pytest's
process. The worker writes its measurements to JSON; the tests below assert on them and on the
files it wrote.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

# run as the worker script, import this checkout's msa_model (not whichever the virtualenv points at)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from convert_fixtures import TINY, save_tiny_hf, tiny_hf_model  # noqa: E402
from msa_model.convert.hf_io import HFCheckpoint, load_all  # noqa: E402
from skeleton_helpers import REPO, run_python  # noqa: E402

FAMILIES = sorted(TINY)
# the MSA geometry of the converted tiny models: 64-token batches hold 4 blocks, 2 selected
GEOMETRY = dict(seq_length=128, block_size=16, topk=2)
PARITY_MAX_ABS = 1e-4
PARITY_MEAN_KL = 1e-6


def _worker(root: Path) -> dict:
    """Every conversion of the tests; returns the measured numbers per family."""
    from msa_model.convert.commands import hf_to_msa, msa_to_hf
    from msa_model.convert.hf_io import ConversionError
    from msa_model.convert.verify import verify

    results = {}
    for fam in FAMILIES:
        hf, msa, back = root / fam / "hf", root / fam / "msa", root / fam / "hf_back"
        hf_to_msa(str(hf), str(msa), **GEOMETRY)
        r = {"msa": verify(str(hf), str(msa), batches=2, seq_length=64)}
        # the export is sharded for one family, so the writer's index is exercised too
        msa_to_hf(str(msa), str(back), max_shard_size=20_000 if fam == "mixtral" else 5 * 2**30)
        # the exported directory loads in transformers and gives the same logits
        r["exported"] = verify(str(back), str(msa), batches=1, seq_length=64, seed=1)
        results[fam] = r
    # the dense-attention baseline model (no index branch) converts exactly as well
    hf_to_msa(str(root / "qwen3" / "hf"), str(root / "qwen3" / "dense"), attention="dense", **GEOMETRY)
    results["qwen3-dense"] = {"msa": verify(str(root / "qwen3" / "hf"), str(root / "qwen3" / "dense"))}
    # a bf16 checkpoint stays bf16 (params_dtype bf16) and round-trips bit for bit
    hf_to_msa(str(root / "qwen2-bf16" / "hf"), str(root / "qwen2-bf16" / "msa"), **GEOMETRY)
    msa_to_hf(str(root / "qwen2-bf16" / "msa"), str(root / "qwen2-bf16" / "hf_back"))
    # MHA is GQA with one query head per group
    hf_to_msa(str(root / "llama-mha" / "hf"), str(root / "llama-mha" / "msa"), **GEOMETRY)
    results["llama-mha"] = {"msa": verify(str(root / "llama-mha" / "hf"), str(root / "llama-mha" / "msa"))}
    # an exported MSA model converts back with its index branch (no re-initialisation)
    hf_to_msa(str(root / "qwen3_moe" / "hf_back"), str(root / "qwen3_moe" / "msa_again"), **GEOMETRY)
    # with the defaults: the source's context (max_position_embeddings 256) and a geometry for it
    hf_to_msa(str(root / "llama" / "hf"), str(root / "llama" / "msa_defaults"))
    # a conversion replacing another (--overwrite) of a model of another name: only its own
    # model/*.yaml is left, so msa-to-hf finds its model
    replaced = root / "replaced"
    hf_to_msa(str(root / "llama" / "hf"), str(replaced / "msa"), **GEOMETRY)
    hf_to_msa(str(root / "qwen2" / "hf"), str(replaced / "msa"), **GEOMETRY)
    try:
        msa_to_hf(str(replaced / "msa"), str(replaced / "hf_back"))
    except ConversionError as e:
        (replaced / "export_error.txt").write_text(str(e))
    return results


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_hf")
    for fam in FAMILIES:
        # Mixtral is saved in shards to exercise model.safetensors.index.json
        save_tiny_hf(fam, root / fam / "hf", seed=len(fam), max_shard_size="40KB" if fam == "mixtral" else None)
    save_tiny_hf("llama", root / "llama-mha" / "hf", seed=1, num_key_value_heads=4)
    tiny_hf_model("qwen2", seed=2).to(torch.bfloat16).save_pretrained(str(root / "qwen2-bf16" / "hf"))
    out = root / "results.json"
    proc = subprocess.run([sys.executable, __file__, str(root), str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (root / "worker.log").write_text(proc.stdout + proc.stderr)
    return root, json.loads(out.read_text())


def test_sharded_fixture_is_sharded(converted):
    root, _ = converted
    assert (root / "mixtral" / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((root / "mixtral" / "hf").glob("model-*.safetensors"))) > 1


@pytest.mark.parametrize("family", FAMILIES + ["qwen3-dense", "llama-mha"])
def test_logits_parity(converted, family):
    """Our model in the indexer-warmup phase reproduces the transformers model's logits."""
    _, results = converted
    r = results[family]["msa"]
    print(f"{family}: max|diff| {r['max_abs_diff']:.2e} mean KL {r['mean_kl']:.2e} over {r['tokens']} tokens")
    assert r["max_abs_diff"] <= PARITY_MAX_ABS
    assert r["mean_kl"] <= PARITY_MEAN_KL


def test_bf16_round_trip_bit_identical(converted):
    root, _ = converted
    src, back = load_all(root / "qwen2-bf16" / "hf"), load_all(root / "qwen2-bf16" / "hf_back")
    assert all(t.dtype == torch.bfloat16 for t in src.values())
    for name, t in src.items():
        assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], t), name
    assert "params_dtype: bf16" in (root / "qwen2-bf16" / "msa" / "model" / "qwen2-converted.yaml").read_text()


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_bit_identical(converted, family):
    """hf -> msa -> hf gives every source tensor back bit for bit, plus the documented index tensors."""
    root, results = converted
    src, back = load_all(root / family / "hf"), load_all(root / family / "hf_back")
    assert set(src) <= set(back)
    for name, t in src.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    extra = set(back) - set(src)
    n_layers = json.loads((root / family / "hf" / "config.json").read_text())["num_hidden_layers"]
    qk_norm = family.startswith("qwen3")
    expected = {f"model.layers.{i}.self_attn.{n}.weight" for i in range(n_layers)
                for n in ("index_q_proj", "index_k_proj") + (("index_q_norm", "index_k_norm") if qk_norm else ())}
    assert extra == expected
    exported = results[family]["exported"]
    assert exported["max_abs_diff"] <= PARITY_MAX_ABS and exported["mean_kl"] <= PARITY_MEAN_KL
    config = json.loads((root / family / "hf_back" / "config.json").read_text())
    assert config["msa"] == {"block_size": 16, "topk": 2, "index_head_dim": config["head_dim"], "force_sink": False}


def test_an_untrained_index_branch_stays_untrained_through_export_and_back(converted):
    """hf-to-msa derives the index branch of a dense source (untrained); its export says so in
    config.json, and converting the export back records it untrained again, so recipe=cpt still
    warms it up (a branch read from a source is otherwise taken as trained, as MiniMax-M3's)."""
    root, _ = converted
    for fam in FAMILIES:
        assert json.loads((root / fam / "hf_back" / "config.json").read_text())["msa_index_trained"] is False, fam
    record = json.loads((root / "qwen3_moe" / "msa_again" / "conversion.json").read_text())
    assert record["index_init"] == "from checkpoint" and record["index_trained"] is False


def test_sharded_export(converted):
    root, _ = converted
    back = root / "mixtral" / "hf_back"
    assert (back / "model.safetensors.index.json").is_file()
    assert len(HFCheckpoint(back).names) == len(load_all(back))


def _checkpoint_tensors(step_dir: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(tmp))
    return {k: v for k, v in torch.load(tmp, weights_only=False).items() if torch.is_tensor(v)}


def test_reimport_keeps_index_branch(converted, tmp_path):
    """msa -> hf -> msa: the second checkpoint equals the first, index branch included."""
    root, _ = converted
    first = _checkpoint_tensors(root / "qwen3_moe" / "msa" / "step_00000000", tmp_path / "a.pt")
    again = _checkpoint_tensors(root / "qwen3_moe" / "msa_again" / "step_00000000", tmp_path / "b.pt")
    assert set(first) == set(again) and any(".index_q_proj." in k for k in first)
    for k in first:
        assert torch.equal(first[k], again[k]), k
    record = json.loads((root / "qwen3_moe" / "msa_again" / "conversion.json").read_text())
    assert record["index_init"] == "from checkpoint"


def test_cpt_from_a_converted_llama_keeps_the_warmup(converted):
    """A dense model's index branch is derived at conversion, never trained: recipe=cpt keeps its
    warmup (tests/test_convert_m3.py: from M3 it starts sparse)."""
    from hydra import compose, initialize_config_dir

    from msa_model.config import register_configs
    from msa_model.training.index_history import index_branch_trained, plan_indexer_warmup

    root, _ = converted
    msa, dense = root / "llama" / "msa", root / "qwen3" / "dense"
    assert json.loads((msa / "conversion.json").read_text())["index_trained"] is False
    assert index_branch_trained(msa) is False and index_branch_trained(dense) is False
    # an exported MSA model read back carries index weights, and its export's word that they are
    # untrained (index weights without it count as trained: tests/test_convert_m3.py)
    assert index_branch_trained(root / "qwen3_moe" / "msa_again") is False
    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "configs"), version_base=None):
        cfg = compose("train", overrides=["recipe=cpt", f"init_from={msa}"])
    recipe_tokens = cfg.trainer.indexer_warmup_tokens
    note = plan_indexer_warmup(cfg, warmup_given=False)
    assert cfg.trainer.indexer_warmup_tokens == recipe_tokens > 0
    assert note == f"indexer warmup: {recipe_tokens:,} tokens: init_from's index branch is untrained (derived " \
                   "from a dense model)"
    # a dense checkpoint has no index branch at all: it starts fresh, and the line says so
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "configs"), version_base=None):
        cfg = compose("train", overrides=["recipe=cpt", f"init_from={dense}"])
    assert plan_indexer_warmup(cfg, warmup_given=False).endswith("index branch is absent (a dense checkpoint: it "
                                                                 "starts fresh)")


def test_conversions_print_no_library_notices(converted):
    """megatron's TE/Apex warnings and its GPTModel banner, DeepSpeed's accelerator line: handled,
    so not shown (msa_model/platform/quiet.py)."""
    root, _ = converted
    out = (root / "worker.log").read_text()
    for noise in ("UserWarning", "FutureWarning", "GPTModel IS DEPRECATED", "Setting accelerator to CPU",
                  "Transformer Engine and Apex are not installed. Falling back"):
        assert noise not in out, (noise, out[-3000:])


def test_a_replaced_conversion_keeps_only_its_own_model_entry(converted):
    root, _ = converted
    replaced = root / "replaced"
    assert [p.name for p in (replaced / "msa" / "model").iterdir()] == ["qwen2-converted.yaml"]
    assert not (replaced / "export_error.txt").exists(), (replaced / "export_error.txt").read_text()
    assert json.loads((replaced / "hf_back" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def test_defaults_fit_the_source(converted):
    """No --seq-length: the source's max_position_embeddings; a geometry that is sparse there."""
    root, _ = converted
    out = root / "llama" / "msa_defaults"
    model = OmegaConf.load(out / "model" / "llama-converted.yaml")
    assert (model.seq_length, model.msa.block_size, model.msa.topk) == (256, 16, 4)
    header = (out / "model" / "llama-converted.yaml").read_text()
    assert f"use: python train.py recipe=cpt init_from={out.resolve()}" in header
    assert "context 256 tokens (the source's max_position_embeddings); MSA blocks of 16 tokens, top-4 = 64 keys " \
           "per query, 1/4 of the context" in (root / "worker.log").read_text()


def test_cpt_from_a_conversion_with_defaults(converted, tmp_path, data_cache):
    """`python train.py recipe=cpt init_from=DIR`: the model comes from the checkpoint; 2 steps (a
    stop after step 2 of the recipe's schedule) at the source's context."""
    root, _ = converted
    ckpt = root / "llama" / "msa_defaults"
    run_dir = tmp_path / "cpt"
    args = ["train.py", "recipe=cpt", f"init_from={ckpt}", "trainer.stop_at_step=2", f"run_dir={run_dir}",
            f"data.cache_dir={data_cache}", "logging.wandb_mode=disabled", "logging.tensorboard=false"]
    # saved without tokenizer files, the conversion records none: bytes are not assumed, nothing is written
    proc = run_python(args)
    assert proc.returncode == 2 and "records no tokenizer" in proc.stderr, proc.stderr[-3000:]
    assert "data.tokenizer=<its directory>" in proc.stderr and not run_dir.exists()
    proc = run_python([*args, "data.tokenizer=byte"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"model llama-converted as recorded by init_from={ckpt}" in out
    assert f"initialised model weights from {ckpt / 'step_00000000'}" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and rows[-1]["phase"] == "warmup"
    trained = OmegaConf.load(run_dir / "config.yaml").model
    recorded = OmegaConf.load(ckpt / "model" / "llama-converted.yaml")
    assert trained == recorded and trained.seq_length == 256


def _compose_on_checkpoint(ckpt: Path, *overrides: str):
    """The config train.py runs for these overrides (the model taken from the checkpoint)."""
    from hydra import compose, initialize_config_dir

    from msa_model.config import register_configs
    from msa_model.training.model_source import take_model_from_checkpoint

    register_configs()
    overrides = ("recipe=cpt", f"init_from={ckpt}", *overrides)
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg, _ = take_model_from_checkpoint(compose("train", overrides=list(overrides)), list(overrides))
    OmegaConf.resolve(cfg)
    return cfg, list(overrides)


def test_a_shorter_context_names_the_overrides_that_fit(converted):
    from msa_model.config import ConfigError, validate

    cfg, _ = _compose_on_checkpoint(converted[0] / "llama" / "msa_defaults", "model.seq_length=64",
                                    "trainer.indexer_warmup_tokens=1024")
    with pytest.raises(ConfigError, match=r"must be < model.seq_length \(64\).*overrides that fit: "
                                          r"model.seq_length=256"):
        validate(cfg, world_size=1)
    cfg, _ = _compose_on_checkpoint(converted[0] / "llama" / "msa_defaults", "model.seq_length=128",
                                    "trainer.indexer_warmup_tokens=1024")
    validate(cfg, world_size=1)  # 64 of 128 keys: still selects


def test_model_overrides_are_checked_against_the_checkpoint(converted):
    from msa_model.training.inputs import check_inputs

    ckpt = converted[0] / "llama" / "msa_defaults"
    cfg, overrides = _compose_on_checkpoint(ckpt, "model.num_layers=3", "model.num_experts=4")
    (line,) = check_inputs(cfg, overrides)
    assert line.startswith(f"init_from={ckpt}: the checkpoint holds another model (model.num_layers: 2 in the "
                           "checkpoint, 3 now; model.num_experts: 0 (no MoE) in the checkpoint, 4 now"), line
    assert f"drop model.num_layers=3 model.num_experts=4 to train the checkpoint's model: `python train.py " \
           f"recipe=cpt init_from={ckpt}`" in line and "init_from_partial=true" in line
    # a setting that keeps the tensors' shapes may change
    cfg, overrides = _compose_on_checkpoint(ckpt, "model.recompute=full", "model.rotary_base=20000")
    assert check_inputs(cfg, overrides) == []


if __name__ == "__main__":
    import logging

    # the converter's own lines, as `python -m msa_model.convert` prints them
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root_dir, out_file = Path(sys.argv[1]), Path(sys.argv[2])
    out_file.write_text(json.dumps(_worker(root_dir), indent=2))
