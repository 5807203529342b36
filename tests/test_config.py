"""Config composition: every recipe x model composes and validates; typos and bad geometry fail."""

from __future__ import annotations

import re

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from msa_model.config import ConfigError, TrainConfig, register_configs, validate
from skeleton_helpers import REPO

register_configs()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize("recipe", ["pt", "cpt", "dense"])
@pytest.mark.parametrize("model", ["tiny", "small"])
def test_every_recipe_and_model_composes_and_validates(recipe, model):
    init = ["init_from=/ckpt"] if recipe == "cpt" else []
    cfg = _compose(f"recipe={recipe}", f"model={model}", *init)
    OmegaConf.resolve(cfg)
    validate(cfg, world_size=1)
    assert cfg.model.name == model and cfg.name == recipe
    assert cfg.run_dir == f"runs/{model}-{recipe}"
    assert cfg.model.attention == ("dense" if recipe == "dense" else "msa")


def test_defaults_are_the_tiny_msa_pretraining_run():
    cfg = _compose()
    m = cfg.model
    assert (cfg.name, m.name, m.attention) == ("pt", "tiny", "msa")
    assert m.num_experts >= 4 and m.num_attention_heads // m.num_query_groups >= 2 and m.num_query_groups >= 2
    assert m.msa.topk * m.msa.block_size < m.seq_length
    assert 0 < cfg.trainer.indexer_warmup_tokens < cfg.trainer.max_steps * cfg.parallel.global_batch_size * m.seq_length


@pytest.mark.parametrize("recipe", ["pt", "dense"])
def test_the_document_mask_line_says_what_the_recipes_model_masks(recipe):
    """The run's first line and the dry run: the dense baseline has no block selection or KL to mask."""
    from msa_model.training.data_setup import document_mask_line

    line = document_mask_line(_compose(f"recipe={recipe}"))
    assert line.startswith("documents: masked")
    assert ("selects blocks and trains the indexer KL" in line) == (recipe == "pt")
    assert "not masked" in document_mask_line(_compose(f"recipe={recipe}", "data.document_mask=false"))


def test_reset_position_ids_is_accepted_and_said_to_have_no_effect():
    """Megatron's flag is accepted under the document mask, and the first line says it changes nothing."""
    from msa_model.training.data_setup import document_mask_line

    cfg = _compose("data.reset_position_ids=true")
    validate(cfg, world_size=1)
    assert "data.reset_position_ids=true has no effect" in document_mask_line(cfg)
    assert "reset_position_ids" not in document_mask_line(_compose())
    with pytest.raises(ConfigError, match="data.reset_position_ids needs data.document_mask=true"):
        validate(_compose("data.reset_position_ids=true", "data.document_mask=false"), world_size=1)


def test_readme_override_example_composes():
    cfg = _compose("recipe=cpt", "model=small", "trainer.max_steps=50", "init_from=/ckpt")
    validate(cfg, world_size=1)
    assert cfg.trainer.max_steps == 50 and cfg.model.seq_length == 8192


@pytest.mark.parametrize("override", ["model.hiden_size=64", "trainer.max_step=3", "optimm.lr=1", "model.msa.top_k=2"])
def test_misspelled_key_on_the_command_line_is_an_error(override):
    with pytest.raises(ConfigCompositionException):
        _compose(override)


def test_misspelled_key_in_yaml_is_an_error():
    schema = OmegaConf.structured(TrainConfig)
    with pytest.raises(ConfigKeyError):
        OmegaConf.merge(schema, OmegaConf.create({"model": {"num_layer": 3}}))


def test_wrong_type_is_an_error():
    with pytest.raises(ConfigCompositionException):
        _compose("model.num_layers=four")


@pytest.mark.parametrize("overrides, field", [
    (["model.num_attention_heads=6", "model.num_query_groups=4"], "model.num_query_groups"),
    (["model.msa.topk=16"], "model.msa.topk * model.msa.block_size"),
    (["model.seq_length=500"], "model.msa.block_size"),
    (["parallel.global_batch_size=7"], "parallel.global_batch_size"),
    (["model.moe_router_topk=8"], "model.moe_router_topk"),
    (["model.attention=sparse"], "model.attention"),
    (["resume=sometimes"], "resume"),
    (["parallel.micro_batch_size=0"], "parallel.micro_batch_size must be positive"),
    (["model.msa.block_size=0"], "model.msa.block_size must be positive"),
    (["logging.log_interval=0"], "logging.log_interval must be positive"),
    (["trainer.stop_at_step=500"], "trainer.stop_at_step"),
    (["trainer.stop_signals=[SIGUSR1,USR2]"], "trainer.stop_signals: unknown signal"),
    (["launch.requeue_signals=[SIGHUP,sigterm]"], "launch.requeue_signals: unknown signal"),
    (["launch.mode=mpirun"], "launch.mode must be torchrun or srun"),
    (["launch.nodes=0"], "launch.nodes must be positive"),
    (["launch.time_min=5"], "launch.signal_seconds"),
    (["optim.lr=-1"], r"optim.lr must be positive, got -1.0"),
    (["optim.min_lr=0.01"], r"optim.min_lr \(0.01\) must be <= optim.lr"),
    (["model.num_experts=-4"], "model.num_experts must be >= 0, got -4"),
    (["trainer.indexer_warmup_tokens=-8"], "trainer.indexer_warmup_tokens must be >= 0, got -8"),
    (["trainer.indexer_dense_interval=1"], r"trainer.indexer_dense_interval must be 0 \(off\) or >= 2"),
    (["data.max_bytes=0"], "data.max_bytes must be positive, got 0"),
    (["checkpoint.keep=-1"], "checkpoint.keep must be >= 0"),
    (["optim.beta2=1.0"], r"optim.beta2 must be in \[0, 1\)"),
    (["model.msa.kl_temperature=0"], "model.msa.kl_temperature must be a finite positive number"),
    (["data.retrieval_tasks=[passkey,kvrecal]"],
     r"data.retrieval_tasks: unknown \['kvrecal'\] \(known: passkey, multikey, vartrack, kvrecall\)"),
    (["data.retrieval_tasks=[]", "data.retrieval_share=0.5"], "data.retrieval_tasks is empty"),
    (["data.retrieval_min_length=4096"], r"data.retrieval_min_length must be 0 \(the default lengths\) or at most "
                                        r"model.seq_length \(512\), got 4096"),
    # 4 layers, the first dense: one layer a stage leaves stage 0 without experts
    (["parallel.pp=4", "parallel.ep=2"], "holds no MoE layer"),
])
def test_bad_values_fail_early_naming_the_field(overrides, field):
    cfg = _compose(*overrides)
    with pytest.raises(ConfigError, match=field.replace("*", r"\*").replace(".", r"\.")):
        validate(cfg, world_size=1)


def test_an_interval_or_a_warmup_that_does_not_fit_is_told_a_value_that_does():
    with pytest.raises(ConfigError, match=r"trainer.eval_interval \(5\) must be a multiple of logging.log_interval "
                                          r"\(10\): e.g. trainer.eval_interval=10, or logging.log_interval=5"):
        validate(_compose("trainer.eval_interval=5", "logging.log_interval=10", "trainer.max_steps=100"), world_size=1)
    validate(_compose("trainer.eval_interval=5", "logging.log_interval=5", "trainer.max_steps=100"), world_size=1)
    with pytest.raises(ConfigError, match=r"optim.warmup_steps \(10\) must be < optim.decay_steps or "
                                          r"trainer.max_steps \(10\): e.g. optim.warmup_steps=1"):
        validate(_compose("optim.warmup_steps=10", "trainer.max_steps=10", "trainer.indexer_warmup_tokens=20480"),
                 world_size=1)
    validate(_compose("optim.warmup_steps=1", "trainer.max_steps=10", "trainer.indexer_warmup_tokens=20480"),
             world_size=1)


def test_a_short_run_is_told_the_indexer_warmup_that_fits():
    # tiny: 8 x 512 tokens a step; the default warmup (40 steps) outlasts a 10-step run
    with pytest.raises(ConfigError, match=r"trainer.indexer_warmup_tokens=20480 warms up for half the run"):
        validate(_compose("trainer.max_steps=10"), world_size=1)
    validate(_compose("trainer.max_steps=10", "trainer.indexer_warmup_tokens=20480"), world_size=1)
    # one step has no half: the way out is top-k from the start
    with pytest.raises(ConfigError, match=r"trainer.indexer_warmup_tokens=0 runs top-k from the first step"):
        validate(_compose("trainer.max_steps=1"), world_size=1)


def test_expert_and_pipeline_parallelism_need_experts_on_every_stage():
    # stage 0 holds layers 0 (dense) and 1 (MoE): every stage has experts
    validate(_compose("parallel.pp=2", "parallel.ep=2", "parallel.global_batch_size=8"), world_size=4)
    with pytest.raises(ConfigError, match=r"stage 0 \(layers 0-1\) holds no MoE layer"):
        validate(_compose("parallel.pp=2", "parallel.ep=2", "model.first_dense_layers=2"), world_size=4)
    # without EP the experts share the one optimizer
    validate(_compose("parallel.pp=2", "model.first_dense_layers=2"), world_size=2)


def test_world_size_checks_name_the_batch_fields():
    cfg = _compose("parallel.global_batch_size=6", "parallel.micro_batch_size=2")
    validate(cfg, world_size=1)
    with pytest.raises(ConfigError, match=r"micro_batch_size \* dp"):
        validate(cfg, world_size=2)


def test_sparse_geometry_reads_at_most_a_quarter_of_the_context():
    from msa_model.config import fitting_geometry_hint, sparse_geometry

    # the production 128 x 16 from 8K on; fewer blocks, then smaller ones, below
    assert [sparse_geometry(n) for n in (131072, 8192, 4096, 2048, 1024, 512, 256, 128)] == \
        [(128, 16), (128, 16), (128, 8), (64, 8), (32, 8), (16, 8), (16, 4), (16, 2)]
    assert sparse_geometry(64) is None and sparse_geometry(1000) is None  # too short; no block divides it
    assert sparse_geometry(1024, block_size=64) == (64, 4) and sparse_geometry(1024, topk=4) == (64, 4)
    # more than the forced local blocks
    assert sparse_geometry(256, local_blocks=4) is None and sparse_geometry(512, local_blocks=4) == (16, 8)
    for n in (131072, 4096, 1536, 256):
        b, k = sparse_geometry(n)
        assert n % b == 0 and 4 * b * k <= n
    hint = fitting_geometry_hint(1024, 128, 16)
    assert hint == ("overrides that fit: model.msa.topk=2; model.msa.block_size=32 model.msa.topk=8; "
                    "model.seq_length=8192 (anything above 2048 that is a multiple of 128 runs)")
    # each suggestion validates
    for fix in (["model.msa.topk=2"], ["model.msa.block_size=32", "model.msa.topk=8"]):
        validate(_compose("model.seq_length=1024", "model.msa.block_size=128", "model.msa.topk=16", *fix,
                          "trainer.indexer_warmup_tokens=0"), world_size=1)


def test_a_short_context_error_names_the_overrides_that_fit():
    cfg = _compose("model.seq_length=128", "trainer.indexer_warmup_tokens=0")
    with pytest.raises(ConfigError, match=r"must be < model.seq_length \(128\) for the sparse phase to select "
                                          r"anything; overrides that fit: model.msa.block_size=16 model.msa.topk=2"):
        validate(cfg, world_size=1)


def test_kernel_tuning_overrides_reach_the_kernels_launch(monkeypatch):
    """model.msa.tuning.<op>.<field> on the command line (no `+`): the layer's settings carry the
    op's Tuning with that field over its defaults, and msa_attention hands it to the op's call."""
    import dataclasses
    import importlib

    import torch

    from msa_model.model.attention import msa_settings
    from msa_model.model.gpt import msa_options
    ops_msa = importlib.import_module("msa_model.ops.msa_attention")  # the module (the package exports the function)
    from msa_model.ops.sparse_attention.tuning import DEFAULT_TUNING as SA_DEFAULT

    cfg = _compose("model.msa.tuning.sparse_attention.fwd_rows=32",
                   "model.msa.tuning.sparse_attention.dense_dkdv=[64,64,4,1]", "model.msa.tuning.select_blocks.rows=64")
    validate(cfg)
    settings = msa_settings(msa_options(cfg.model), None)
    want_sa = dataclasses.replace(SA_DEFAULT, fwd_rows=32, dense_dkdv=(64, 64, 4, 1))
    assert settings.tuning.sparse_attention == want_sa and settings.tuning.select_blocks.rows == 64
    assert settings.tuning.indexer_kl is None  # unset: the op's defaults
    seen = {}

    def spy(name, op):
        def call(*args, **kw):
            seen[name] = kw["tuning"]
            return op(*args, **kw)
        return call

    for name in ("select_blocks", "sparse_attention", "indexer_kl_loss"):
        monkeypatch.setattr(ops_msa, name, spy(name, getattr(ops_msa, name)))
    msa = cfg.model.msa
    B, T, Hq, G, D, Di = 1, 4 * msa.block_size, 4, 2, 16, msa.index_head_dim
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, h, D, generator=gen) for h in (Hq, G, G))
    ops_msa.msa_attention(q, k, v, torch.randn(B, T, G, Di, generator=gen), torch.randn(B, T, Di, generator=gen),
                          settings)
    assert seen == {"select_blocks": settings.tuning.select_blocks, "sparse_attention": want_sa,
                    "indexer_kl_loss": None}


def test_an_unknown_kernel_setting_is_refused_in_one_line():
    """A config not built by Hydra's typed schema (a plain mapping) is checked by validate: one line
    per unknown op or field, naming it and what there is."""
    raw = OmegaConf.to_container(_compose())
    raw["model"]["msa"]["tuning"] = {"sparse_attention": {"fwd_rows": 32, "foo": 1}, "attention": {}}
    with pytest.raises(ConfigError) as e:
        validate(OmegaConf.create(raw))
    lines = [line for line in str(e.value).splitlines() if "model.msa.tuning" in line]
    assert lines[0].startswith("  - model.msa.tuning.sparse_attention.foo: unknown field; fields: fwd_rows, ")
    assert lines[1] == "  - model.msa.tuning.attention: unknown op; ops: sparse_attention, select_blocks, indexer_kl"
    assert len(lines) == 2


def test_cuda_graph_names_each_setting_it_cannot_replay():
    """model.msa.cuda_graph is refused, naming the setting, wherever a captured core would not
    replay the same work on the same buffers; the settings it needs validate (on a GPU)."""
    for documents in ("true", "false"):  # packed documents: a graph per table size
        ok = _compose("recipe=pt", "model=small", "model.msa.cuda_graph=true", f"data.document_mask={documents}")
        validate(ok, world_size=1, gpu=True)
    for overrides, needs in [(("model.recompute=selective",), "model.recompute=none"),
                             (("parallel.pp=2",), "parallel.pp=1"),
                             (("parallel.cp=2",), "parallel.cp=1"),
                             (("recipe=dense",), "model.attention=msa")]:
        cfg = _compose("recipe=pt", "model=small", "model.msa.cuda_graph=true", *overrides)
        with pytest.raises(ConfigError, match=f"model.msa.cuda_graph=true needs {needs}"):
            validate(cfg, world_size=8, gpu=True)
    cpu = _compose("recipe=pt", "model=tiny", "model.msa.cuda_graph=true")
    with pytest.raises(ConfigError, match="model.msa.cuda_graph=true needs a GPU"):
        validate(cpu, world_size=1, gpu=False)
    # the whole block in a graph: its projections must not communicate
    block = ("recipe=pt", "model=small", "model.msa.cuda_graph=true")  # the default scope: the whole block
    validate(_compose(*block, "parallel.tp=1"), world_size=2, gpu=True)
    with pytest.raises(ConfigError, match="model.msa.cuda_graph=true needs parallel.tp=1 with "
                                          "model.msa.cuda_graph_scope=attention"):
        validate(_compose(*block, "parallel.tp=2", "parallel.sequence_parallel=true"), world_size=2, gpu=True)
    validate(_compose("recipe=pt", "model=small", "model.msa.cuda_graph=true", "model.msa.cuda_graph_scope=core",
                      "parallel.tp=2", "parallel.sequence_parallel=true"), world_size=2, gpu=True)
    with pytest.raises(ConfigError, match="model.msa.cuda_graph_scope must be one of attention, core"):
        validate(_compose("recipe=pt", "model=small", "model.msa.cuda_graph_scope=layer"), world_size=1, gpu=True)


@pytest.mark.parametrize("override, message", [
    ("data.blend=[[inf,/d/a]]", "data.blend[0]: weight inf of /d/a must be finite"),
    ("data.valid_blend=[[1e308,/d/a],[1e308,/d/b]]", "data.valid_blend: the weights [1e+308, 1e+308] sum past"),
    ("data.split=[inf,2,0]", "data.split must be three finite non-negative numbers"),
    ("data.split=[98,nan,0]", "data.split must be three finite non-negative numbers"),
])
def test_non_finite_blend_weights_and_splits_are_refused(override, message, monkeypatch):
    """megatron normalises both by their sum: inf or nan would reach its assertion (or a NaN split)
    after the run directory exists."""
    from data import prepared

    monkeypatch.setattr(prepared, "read_metadata", lambda prefix: {"documents": 100})
    cfg = _compose("data.blend=[/d/a]", override)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(cfg, world_size=1)
    # the datasets' check leaves a split that is none to the configuration's
    assert prepared.split_problems(cfg.data, evaluating=True) == []


def test_validation_datasets_without_evaluation_are_refused():
    """data.valid_blend with trainer.eval_interval at its default 0 trained to the end without a
    validation loss and without a word."""
    cfg = _compose("data.blend=[/d/a]", "data.valid_blend=[/d/b]")
    with pytest.raises(ConfigError, match=re.escape("data.valid_blend names validation datasets but "
                                                    "trainer.eval_interval is 0 (off)")):
        validate(cfg, world_size=1)
    validate(_compose("data.blend=[/d/a]", "data.valid_blend=[/d/b]", "trainer.eval_interval=10"), world_size=1)


def test_a_job_of_no_nodes_is_refused_naming_the_key():
    cfg = _compose("launch.nodes=0")
    with pytest.raises(ConfigError, match="launch.nodes must be positive, got 0"):
        validate(cfg, world_size=0)


def test_diagnostics_of_a_model_without_msa_layers_are_a_warning():
    """logging.msa_diagnostics_interval on a dense model measured nothing without a word; it is
    said (a warning: a quality study's --override reaches its dense arm too)."""
    from msa_model.config_checks import setting_warnings

    dense = _compose("recipe=dense", "model=tiny", "logging.msa_diagnostics_interval=20")
    validate(dense, world_size=1)
    assert setting_warnings(dense) == ["logging.msa_diagnostics_interval=20 logs nothing: the model has no MSA "
                                       "layer (model.attention / model.attention_types)"]
    assert setting_warnings(_compose("recipe=pt", "model=tiny", "logging.msa_diagnostics_interval=20")) == []
    assert setting_warnings(_compose("recipe=dense", "model=tiny")) == []


def test_graphs_past_the_measured_length_are_a_warning_naming_their_memory():
    """model.msa.cuda_graph keeps a memory pool per layer: msa_109b_proxy's graphs ran out of
    memory at 32K on an 80 GB GPU. Past the length where the graphs were measured to pay, the run
    says so before it starts (a warning: a larger GPU may hold them); at that length, nothing."""
    from msa_model.config_checks import GRAPH_MEASURED_LENGTH, setting_warnings

    graphs = ("recipe=pt", "model=tiny", "model.msa.cuda_graph=true")
    assert setting_warnings(_compose(*graphs, f"model.seq_length={GRAPH_MEASURED_LENGTH}")) == []
    (line,) = setting_warnings(_compose(*graphs, "model.seq_length=32768"))
    assert line.startswith("model.msa.cuda_graph=true at model.seq_length=32768: each MSA layer's graph keeps")
    assert "model.msa.tuning.sparse_attention.partial_bytes" in line
    assert setting_warnings(_compose("recipe=pt", "model=tiny", "model.seq_length=32768")) == []
    assert setting_warnings(_compose("recipe=dense", "model=tiny", "model.msa.cuda_graph=true",
                                     "model.seq_length=32768")) == []
