"""The converter refuses what it cannot convert, and says which file or tensor is at fault.

Every check here fails before any model is built, so these run in pytest's process.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from msa_model.convert.commands import hf_to_msa
from msa_model.convert.families import FAMILIES, model_config_from_hf
from msa_model.convert.hf_io import ConversionError

from convert_fixtures import save_tiny_hf
from skeleton_helpers import run_python


@pytest.fixture
def llama(tmp_path):
    return save_tiny_hf("llama", tmp_path / "llama")


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_unsupported_architecture(llama, tmp_path):
    _edit_config(llama, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ConversionError, match=r"config.json: unsupported architecture \['GPT2LMHeadModel'\]"):
        hf_to_msa(str(llama), str(tmp_path / "out"))


def test_not_gqa(llama, tmp_path):
    _edit_config(llama, num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ConversionError, match=r"not a GQA model: num_attention_heads \(6\) is not a multiple of "
                                              r"num_key_value_heads \(4\)"):
        hf_to_msa(str(llama), str(tmp_path / "out"))


def test_mha_is_gqa_with_one_head_per_group():
    cfg = json.loads(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                                 "num_key_value_heads": 4, "intermediate_size": 96, "vocab_size": 300,
                                 "num_hidden_layers": 2}))
    _, model = model_config_from_hf(cfg)
    assert model.num_attention_heads == model.num_query_groups == 4


def test_missing_shard(tmp_path):
    src = save_tiny_hf("mixtral", tmp_path / "mixtral", max_shard_size="40KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["model.layers.1.self_attn.k_proj.weight"]
    (src / shard).unlink()
    with pytest.raises(ConversionError, match=rf"missing shard file\(s\) \['{shard}'\]"):
        hf_to_msa(str(src), str(tmp_path / "out"))


def test_no_weights(llama, tmp_path):
    (llama / "model.safetensors").rename(llama / "weights.safetensors")
    with pytest.raises(ConversionError, match=r"no model.safetensors or model.safetensors.index.json; "
                                              r"found \['weights.safetensors'\]"):
        hf_to_msa(str(llama), str(tmp_path / "out"))


def test_shape_mismatch(llama, tmp_path):
    def shrink(t):
        t["model.layers.1.self_attn.k_proj.weight"] = t["model.layers.1.self_attn.k_proj.weight"][:16].clone()

    _edit_tensors(llama, shrink)
    with pytest.raises(ConversionError, match=r"tensor 'model.layers.1.self_attn.k_proj.weight' has shape \[16, 64\], "
                                              r"expected \[32, 64\]"):
        hf_to_msa(str(llama), str(tmp_path / "out"))


def test_missing_tensor(llama, tmp_path):
    _edit_tensors(llama, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(ConversionError, match=r"tensor 'model.layers.0.mlp.up_proj.weight' is missing"):
        hf_to_msa(str(llama), str(tmp_path / "out"))


def test_unknown_tensor(llama, tmp_path):
    _edit_tensors(llama, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}))
    with pytest.raises(ConversionError, match=r"tensors the llama mapping does not know: "
                                              r"\['model.layers.0.self_attn.o_proj.bias'\]"):
        hf_to_msa(str(llama), str(tmp_path / "out"))


def test_unsupported_rope_scaling(llama, tmp_path):
    _edit_config(llama, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(ConversionError, match="RoPE scaling type 'yarn' is not supported"):
        hf_to_msa(str(llama), str(tmp_path / "out"))


def test_layout_checked(tmp_path):
    src = save_tiny_hf("mixtral", tmp_path / "mixtral")
    with pytest.raises(ConversionError, match=r"(?s)cannot run at tp=1 pp=1 ep=3.*num_experts \(4\) must be a multiple "
                                              r"of parallel.ep \(3\)"):
        hf_to_msa(str(src), str(tmp_path / "out"), ep=3)


def test_export_family_must_match():
    cfg = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 96, "vocab_size": 300, "num_hidden_layers": 2}
    _, model = model_config_from_hf(cfg)
    with pytest.raises(ConversionError, match="cannot export as llama: qkv_bias=True"):
        FAMILIES["llama"].check_exportable(model)
    with pytest.raises(ConversionError, match="cannot export as mixtral:.*is an MoE family"):
        FAMILIES["mixtral"].check_exportable(model)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_deep_moe_model_maps_every_layer(family):
    """48 layers, as Qwen3-30B-A3B: more than the characters of a layer's tensor name, which a
    name once overwriting the per-layer MoE flags could index past."""
    cfg = {"architectures": [FAMILIES[family].architecture], "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 96, "moe_intermediate_size": 32, "vocab_size": 300,
           "num_hidden_layers": 48, "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
           "mlp_only_layers": [0]}
    fam, model = model_config_from_hf(cfg)
    rules = fam.rules(model, with_index=True)
    routers = [r.mcore for r in rules if r.mcore.endswith(".mlp.router.weight")]
    dense = 1 if family == "qwen3_moe" else 0
    assert routers == [f"decoder.layers.{i}.mlp.router.weight" for i in range(dense, 48)]
    assert sum(".local_experts." in r.mcore for r in rules) == 2 * 4 * (48 - dense)
    assert set(fam.hf_shapes(model, with_index=True)) == {n for r in rules for n in r.hf}


def test_cli_reports_error_and_exit_code(llama, tmp_path):
    _edit_config(llama, architectures=["GPT2LMHeadModel"])
    proc = run_python(["-m", "msa_model.convert", "hf-to-msa", str(llama), str(tmp_path / "out")], timeout=120)
    assert proc.returncode == 2
    assert "error: " in proc.stderr and "unsupported architecture ['GPT2LMHeadModel']" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_derived_init_needs_index_head_dim_equal_head_dim(tmp_path):
    src = save_tiny_hf("qwen3", tmp_path / "qwen3")
    with pytest.raises(ConversionError, match=r"--index-init derived needs index_head_dim == head_dim \(8 != 24\)"):
        hf_to_msa(str(src), str(tmp_path / "out"), index_head_dim=8, index_init="derived")


def test_mistral_with_sliding_window_refused(tmp_path):
    src = save_tiny_hf("mistral", tmp_path / "mistral", sliding_window=32)
    with pytest.raises(ConversionError, match="sliding-window attention is not supported"):
        hf_to_msa(str(src), str(tmp_path / "out"))


def _truncate(path, keep: float = 0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _damage(kind: str, tmp_path):
    """A checkpoint damaged the way it happens (an interrupted copy, a stale index); returns
    (checkpoint dir, the file the error must name, what it must say)."""
    if kind == "truncated-file":
        src = save_tiny_hf("llama", tmp_path / "hf")
        _truncate(src / "model.safetensors")
        return src, src / "model.safetensors", "not a readable safetensors file, truncated or damaged"
    src = save_tiny_hf("mixtral", tmp_path / "hf", max_shard_size="40KB")
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    if kind == "truncated-shard":
        _truncate(src / shards[1], keep=0.9)
        return src, src / shards[1], "not a readable safetensors file, truncated or damaged"
    # the index sends a tensor to a shard that does not hold it
    name = next(n for n, f in index["weight_map"].items() if f == shards[0])
    index["weight_map"][name] = shards[-1]
    index_path.write_text(json.dumps(index))
    return src, src / shards[-1], f"does not hold \\['{re.escape(name)}'\\], which model.safetensors.index.json assigns to it"


@pytest.mark.parametrize("kind", ["truncated-file", "truncated-shard", "index-points-to-wrong-shard"])
def test_damaged_checkpoint_cli(kind, tmp_path):
    """`error: <file>: <what is wrong>`, exit code 2, no traceback, nothing written."""
    src, bad_file, what = _damage(kind, tmp_path)
    out = tmp_path / "out"
    proc = run_python(["-m", "msa_model.convert", "hf-to-msa", str(src), str(out)], timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.match(rf"error: {re.escape(str(bad_file))}: {what}", last), last
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.parametrize("command", ["dense-to-msa", "msa-to-hf"])
def test_a_missing_checkpoint_is_named_as_missing(command, tmp_path):
    """A mistyped source path says so, rather than asking for --model-config."""
    from msa_model.convert.commands import dense_to_msa, msa_to_hf

    convert = {"dense-to-msa": dense_to_msa, "msa-to-hf": msa_to_hf}[command]
    with pytest.raises(ConversionError, match=r"nothing/checkpoints: no such checkpoint directory"):
        convert(str(tmp_path / "nothing" / "checkpoints"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["verify_missing_checkpoint", "verify_missing_hf", "msa_to_hf_of_a_hf_model",
                                  "msa_to_hf_of_a_run_dir", "hf_to_msa_of_our_checkpoint", "hf_config_is_a_file"])
def test_a_source_of_the_wrong_kind_is_named_as_what_it_is(case, llama, tmp_path):
    """A mistyped path or a directory of another kind (a Hugging Face model where one of ours goes,
    a run directory, the arguments of verify swapped, a config.json where its directory goes) says
    what it is and what to give, where it said "pass --model-config", "pass --family", only "no
    config.json" or "no such directory"."""
    from msa_model.convert.commands import msa_to_hf
    from msa_model.convert.deepspeed_io import deepspeed_to_msa
    from msa_model.convert.verify import verify

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000004\n")
    (run / "checkpoints" / "step_00000004").mkdir()
    nothing, out = tmp_path / "nothing", tmp_path / "out"
    call, message = {
        "verify_missing_checkpoint": (lambda: verify(str(llama), str(nothing)), f"{nothing}: no such checkpoint directory"),
        "verify_missing_hf": (lambda: verify(str(nothing), str(run / "checkpoints")), f"{nothing}: no such directory"),
        "msa_to_hf_of_a_hf_model": (lambda: msa_to_hf(str(llama), str(out)),
                                    f"a Hugging Face model (config.json): convert it first, `python -m msa_model.convert "
                                    f"hf-to-msa {llama} OUT`"),
        "msa_to_hf_of_a_run_dir": (lambda: msa_to_hf(str(run), str(out)),
                                   f"a run directory: its checkpoints are {run / 'checkpoints'}"),
        "hf_to_msa_of_our_checkpoint": (lambda: hf_to_msa(str(run / "checkpoints"), str(out)),
                                        "expected a Hugging Face checkpoint directory (it is a checkpoint of this "
                                        "repository; `msa-to-hf` exports one)"),
        # deepspeed-to-msa --hf-config given the config.json itself (it said "no such directory")
        "hf_config_is_a_file": (lambda: deepspeed_to_msa(str(nothing), str(out), hf_config=str(llama / "config.json")),
                                f"{llama / 'config.json'}: a file; expected a directory holding config.json (a Hugging "
                                f"Face checkpoint directory): give {llama}"),
    }[case]
    with pytest.raises(ConversionError, match=re.escape(message)):
        call()
    assert not out.exists()


@pytest.mark.parametrize("command, earlier", [("dense-to-msa", "step_00000000"), ("hf-to-msa", "latest"),
                                              ("deepspeed-to-msa", "step_00000000"), ("msa-to-hf", "config.json")])
def test_an_earlier_conversion_is_replaced_only_with_overwrite(command, earlier, tmp_path, capsys):
    """OUT holding what a conversion wrote is refused before any work (exit 2, untouched); with
    --overwrite the command goes on (here to its missing source); an unfinished save's temporary
    directory alone is no earlier conversion."""
    from msa_model.convert.__main__ import main

    out, src = tmp_path / "out", str(tmp_path / "missing")
    out.mkdir()
    (out / earlier).mkdir() if earlier.startswith("step_") else (out / earlier).write_text("{}")
    extra = ["--hf-config", src] if command == "deepspeed-to-msa" else []
    assert main([command, src, str(out), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"error: {out} already holds a conversion ({earlier}): pass --overwrite to replace it, or give another OUT"
    assert sorted(p.name for p in out.iterdir()) == [earlier]
    assert main([command, src, str(out), *extra, "--overwrite"]) == 2
    assert "already holds" not in capsys.readouterr().err
    (out / earlier).rename(out / f".tmp-{earlier}")
    assert main([command, src, str(out), *extra]) == 2
    assert "already holds" not in capsys.readouterr().err


@pytest.mark.parametrize("first, second", [(5 * 2**30, 64), (64, 5 * 2**30), (64, 128)],
                         ids=["single-then-shards", "shards-then-single", "fewer-shards"])
def test_a_save_over_an_earlier_one_leaves_only_its_own_weight_files(first, second, tmp_path):
    """msa-to-hf --overwrite: the earlier export's model.safetensors, shards and index go, so that
    transformers (which prefers model.safetensors to an index) reads the new weights only."""
    from msa_model.convert.hf_io import HFCheckpoint, save_safetensors

    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text("{}")
    tensors = {f"w{i}": torch.full((4, 4), float(i)) for i in range(3)}
    save_safetensors({k: v + 100 for k, v in tensors.items()}, out, max_shard_bytes=first)
    files = save_safetensors(tensors, out, max_shard_bytes=second)
    weights = sorted(p.name for p in out.iterdir() if p.name != "config.json")
    assert weights == sorted(files + ([] if len(files) == 1 else ["model.safetensors.index.json"]))
    ckpt = HFCheckpoint(out)
    assert all(torch.equal(ckpt.get(k), v) for k, v in tensors.items())


@pytest.mark.parametrize("command", ["hf-to-msa", "dense-to-msa", "msa-to-hf"])
def test_an_out_that_is_a_file_is_refused_in_one_line(command, tmp_path, capsys):
    from msa_model.convert.__main__ import main

    out = tmp_path / "notes.txt"
    out.write_text("mine\n")
    assert main([command, str(tmp_path / "missing"), str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {out}: exists and is not a directory; give another OUT"
    assert out.read_text() == "mine\n"


def _drop_index_tensors(tensors, keep):
    for name in [n for n in tensors if ".indexer." in n][keep:]:
        tensors.pop(name)


@pytest.mark.parametrize("keep, message", [
    (7, r"7 of its 8 tensors are here, missing \['model.layers.2.self_attn.indexer.q_proj.weight'\]"),
    (0, r"0 of its 8 tensors are here, missing \['model.layers.0.self_attn.indexer.k_norm.weight', .* \.\.\.")])
def test_an_incomplete_index_branch_is_refused_not_reinitialised(keep, message, tmp_path):
    """An M3 checkpoint (index head dim = head dim, so a derived init would fit) missing one or all
    of its index tensors: refused naming them, not converted with the branch re-derived (dropping
    the trained tensors that are there; an M3 checkpoint always has its index branch)."""
    from convert_fixtures import save_tiny_m3

    src = save_tiny_m3(tmp_path / "m3", index_head_dim=16)
    _edit_tensors(src, lambda t: _drop_index_tensors(t, keep))
    with pytest.raises(ConversionError, match="the index branch is incomplete: " + message):
        hf_to_msa(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mean_kl, code", [(2e-7, 0), (0.08, 1), (float("nan"), 1)])
def test_verify_exits_1_when_the_models_differ(monkeypatch, capsys, mean_kl, code):
    """verify measures and judges: a mean KL above --max-mean-kl (or NaN) is exit 1 with one line
    naming both numbers, after the JSON, so a conversion script stops on a wrong model."""
    import msa_model.convert.verify as verify_module
    from msa_model.convert.__main__ import main

    measured = {"tp": 1, "ep": 1, "phase": "dense (indexer warmup)", "max_abs_diff": 1.18, "mean_kl": mean_kl,
                "tokens": 128}
    monkeypatch.setattr(verify_module, "verify", lambda *a, **k: measured)
    assert main(["verify", "hf", "src"]) == code
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["max_abs_diff"] == 1.18
    if code:
        assert err.strip().splitlines()[-1].startswith("error: the models differ: mean KL "), err
    assert main(["verify", "hf", "src", "--max-mean-kl", "1"]) == (1 if mean_kl != mean_kl else 0)
