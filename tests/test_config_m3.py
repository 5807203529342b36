"""The MiniMax-M3 options of ModelConfig: the m3_tiny preset composes with every recipe and its
built size is the analytic one; bad values fail naming the fields, all at once."""

from __future__ import annotations

import re

import pytest
from hydra import compose, initialize_config_dir

from msa_model.config import ConfigError, moe_layers, msa_layers_of, register_configs, validate
from skeleton_helpers import REPO, _env, run_python

register_configs()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize("recipe", ["pt", "cpt", "dense"])
def test_m3_tiny_composes_with_every_recipe(recipe):
    cfg = _compose("model=m3_tiny", f"recipe={recipe}", *(["init_from=/ckpt"] if recipe == "cpt" else []))
    validate(cfg, world_size=1)
    assert moe_layers(cfg.model) == [False, True, True, True]
    # the dense baseline makes every layer full attention
    assert msa_layers_of(cfg.model) == ([False] * 4 if recipe == "dense" else [False, True, True, True])


def test_m3_tiny_built_size_is_the_analytic_one():
    from msa_model.model.gpt import count_parameters

    proc = run_python(["train.py", "dry_run=true", "model=m3_tiny"], _env(2))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    built = {k: int(re.search(rf"^{k}_params=(\d+)", proc.stdout, re.M).group(1)) for k in ("total", "active")}
    counts = count_parameters(_compose("model=m3_tiny").model, 257)
    assert built == {"total": counts["total"], "active": counts["active"]}
    # one full-attention layer: 3 index branches; one dense MLP and 3 MoE layers with shared experts
    assert counts["index_branch"] == 3 * (256 * 2 * 32 + 256 * 32 + 2 * 32)


@pytest.mark.parametrize("overrides, message", [
    (["model.rotary_dim=15"], r"model.rotary_dim \(15\) must be even and in \(0, model.head_dim=32\]"),
    (["model.rotary_dim=64"], r"model.rotary_dim \(64\) must be even"),
    (["model.rotary_dim=32", "model.msa.index_head_dim=16"], r"model.rotary_dim \(32\) must be <= model.msa.index_head_dim"),
    (["model.activation=gelu"], r"model.activation must be swiglu or quick_geglu"),
    (["model.activation_clamp=-1"], r"model.activation_clamp must be positive"),
    (["model.activation=swiglu"], r"model.glu_alpha \(1.6\) is used by activation=quick_geglu only"),
    (["model.moe_router_score_function=softmax"], r"model.moe_router_expert_bias needs model.moe_router_score_function=sigmoid"),
    (["model.moe_router_score_function=tanh"], r"model.moe_router_score_function must be softmax or sigmoid"),
    (["model.moe_router_topk_scaling_factor=0"], r"model.moe_router_topk_scaling_factor must be positive"),
    (["model.attention_types=[full,msa]"], r"model.attention_types lists 2 layers, model.num_layers is 4"),
    (["model.attention_types=[full,msa,sparse,msa]"], r"model.attention_types: unknown value\(s\) \['sparse'\]"),
    (["model.num_experts=0"], r"model.mlp_types names moe layers but model.num_experts is 0"),
    (["model.msa.local_blocks=5"], r"model.msa.local_blocks \(5\) must be in \[1, model.msa.topk=4\]"),
    (["model.msa.index_precision=fp16"], r"model.msa.index_precision must be input or fp8, got 'fp16'"),
    (["model.msa.kl_teacher=later"], r"model.msa.kl_teacher must be forward or backward, got 'later'"),
])
def test_bad_values_name_the_field(overrides, message):
    cfg = _compose("model=m3_tiny", "model.glu_alpha=1.6", *overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world_size=1)


def test_every_problem_listed_at_once():
    cfg = _compose("model=m3_tiny", "model.rotary_dim=7", "model.activation=relu", "model.mlp_types=[moe]")
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=1)
    text = str(err.value)
    assert all(f in text for f in ("model.rotary_dim", "model.activation", "model.mlp_types"))
