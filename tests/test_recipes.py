"""Model presets and recipes: every recipe x model composes, the 109B preset has the report's
size (counted on the model built on the meta device), the 109B recipes validate on the 512 GPUs
they launch on and submit through launch.slurm, bad combinations fail naming the fields, and
MSA-CPT continues a converted dense run from exactly the dense model's loss."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings

import pytest
from hydra import compose, initialize_config_dir

from msa_model.config import ConfigError, register_configs, validate
from skeleton_helpers import REPO, _env, metrics, run_python, run_train

register_configs()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return compose("train", overrides=list(overrides))


def _dry_run(*overrides: str) -> str:
    proc = run_python(["train.py", "dry_run=true", *overrides], _env(2))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _field(text: str, name: str) -> float:
    match = re.search(rf"^{name}=([0-9.]+)", text, re.M)
    assert match, f"{name}= missing from the dry run output"
    return float(match.group(1))


@pytest.mark.parametrize("recipe", ["pt", "cpt", "dense"])
@pytest.mark.parametrize("model", ["tiny", "small", "msa_109b"])
def test_every_recipe_and_model_composes(recipe, model):
    init = ["init_from=/some/ckpt"] if recipe == "cpt" else []
    cfg = _compose(f"recipe={recipe}", f"model={model}", *init)
    validate(cfg, world_size=1)
    assert (cfg.name, cfg.model.name) == (recipe, model)


@pytest.mark.parametrize("recipe", ["pt", "cpt", "dense", "msa_109b_pt", "msa_109b_cpt", "msa_109b_dense"])
def test_every_recipe_masks_packed_documents_unless_told_not_to(recipe):
    assert _compose(f"recipe={recipe}").data.document_mask is True
    assert _compose(f"recipe={recipe}", "data.document_mask=false").data.document_mask is False


@pytest.mark.parametrize("recipe, clip", [("cpt", 1.0), ("msa_109b_cpt", 1.0), ("pt", None), ("msa_109b_pt", None),
                                           ("dense", None)])
def test_cpt_recipes_clip_the_index_branch_on_its_own(recipe, clip):
    assert _compose(f"recipe={recipe}").optim.index_clip_grad == clip
    assert _compose(f"recipe={recipe}", "optim.index_clip_grad=null").optim.index_clip_grad is None


@pytest.fixture(scope="module")
def pt_109b_dry_run() -> str:
    """The dry run of the full-scale MSA-PT recipe (about a minute of CPU: the 109B model on the
    meta device)."""
    return _dry_run("recipe=msa_109b_pt")


def test_109b_preset_counts_on_the_meta_device(pt_109b_dry_run):
    from msa_model.model.gpt import count_parameters

    out = pt_109b_dry_run
    total, active = int(_field(out, "total_params")), int(_field(out, "active_params"))
    assert abs(total - 109e9) <= 0.03 * 109e9, total
    assert abs(active - 6e9) <= 0.10 * 6e9, active
    # the documented arithmetic (configs/model/msa_109b.yaml) is the built model's
    counts = count_parameters(_compose("model=msa_109b").model, 257)
    assert (total, active) == (counts["total"], counts["active"]) == (109_034_246_144, 6_055_694_336)


# the report's runs: tokens, indexer warmup tokens and peak learning rate
RUNS_109B = {"dense": (3e12, 0, 3e-4), "pt": (3e12, 40e9, 3e-4), "cpt": (400e9, 40e9, 1.5e-4)}


BLEND_109B = "data.blend=[[0.7,/data/web],[0.3,/data/code]]"  # the recipes name no corpus: the user's blend


def _compose_109b(recipe: str, *overrides: str):
    init = ["init_from=/ckpt-msa"] if recipe == "cpt" else []
    return _compose(f"recipe=msa_109b_{recipe}", *init, BLEND_109B, *overrides)


@pytest.mark.parametrize("recipe", sorted(RUNS_109B))
def test_109b_recipes_validate_on_the_gpus_they_launch_on(recipe):
    cfg = _compose_109b(recipe)
    world = cfg.launch.nodes * cfg.launch.ranks_per_node
    assert world == 512 and cfg.launch.gpus_per_node == 8
    validate(cfg, world_size=world, gpu=True)
    tokens, warmup_tokens, lr = RUNS_109B[recipe]
    tokens_per_step = cfg.parallel.global_batch_size * cfg.model.seq_length
    assert tokens_per_step == 4 * 2**20
    # as many whole steps as the tokens fill
    assert 0 <= tokens - cfg.trainer.max_steps * tokens_per_step < tokens_per_step
    assert (cfg.name, cfg.model.name, cfg.trainer.indexer_warmup_tokens, cfg.optim.lr) == \
        (recipe, "msa_109b", warmup_tokens, lr)
    assert cfg.optim.min_lr == pytest.approx(cfg.optim.lr / 10)
    # a 1.5 TB save every 1000 steps, not the tiny model's every 40 (a step takes seconds at 512 GPUs)
    assert cfg.checkpoint.interval == 1000


@pytest.mark.parametrize("recipe", sorted(RUNS_109B))
def test_109b_recipes_keep_their_tokens_on_the_128k_layout(recipe):
    """The 128K layout's steps hold 8M tokens, twice the 8K layout's: the run takes half the steps,
    not twice the tokens. A step count given on the command line still wins."""
    cfg = _compose_109b(recipe, "parallel=msa_109b_128k")
    validate(cfg, world_size=512, gpu=True)
    tokens_per_step = cfg.parallel.global_batch_size * cfg.model.seq_length
    assert tokens_per_step == 8 * 2**20
    assert 0 <= RUNS_109B[recipe][0] - cfg.trainer.max_steps * tokens_per_step < tokens_per_step
    assert _compose_109b(recipe, "parallel=msa_109b_128k", "trainer.max_steps=1234").trainer.max_steps == 1234


def test_109b_recipe_names_the_cpt_checkpoint():
    with pytest.raises(ConfigError, match="init_from=PATH"):
        validate(_compose("recipe=msa_109b_cpt"), world_size=512)


def test_109b_recipe_dry_run_prints_its_run(pt_109b_dry_run):
    out = pt_109b_dry_run
    assert _field(out, "world_size") == 512 and (_field(out, "tp"), _field(out, "pp"), _field(out, "ep")) == (2, 4, 32)
    assert "x 715255 steps = 2,999,996,907,520 tokens" in out
    assert 0 < _field(out, "memory_per_gpu_gib") < 68
    assert "\ndocuments: masked (data.document_mask=true)" in out


@pytest.mark.parametrize("recipe", sorted(RUNS_109B))
def test_109b_script_submits_the_recipe(recipe, tmp_path):
    """recipes/msa_109b.sh with DRY_RUN=1: the job script launch.slurm renders from the recipe's
    launch settings (CPT: an already converted checkpoint is not converted again)."""
    args = []
    if recipe == "cpt":
        (tmp_path / "dense").mkdir()
        (tmp_path / "dense-msa").mkdir()
        args = [str(tmp_path / "dense")]
    env = {**_env(), "PYTHON": sys.executable, "DRY_RUN": "1", "PARTITION": "gpu", "TIME": "12:00:00"}
    proc = subprocess.run(["bash", "recipes/msa_109b.sh", recipe, *args, BLEND_109B, f"run_dir={tmp_path / 'run'}"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in (f"#SBATCH --job-name=msa109b-{recipe}", "#SBATCH --nodes=64", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --time=12:00:00", "#SBATCH --partition=gpu", "--nproc-per-node=8"):
        assert line in proc.stdout, line
    train_args = re.search(r"^TRAIN_ARGS=\((.*)\)$", proc.stdout, re.M).group(1)
    init = f" init_from={tmp_path / 'dense-msa'}" if recipe == "cpt" else ""
    assert train_args == f"recipe=msa_109b_{recipe}{init} '{BLEND_109B}' launch.partition=gpu " \
                         f"launch.time_min=720 run_dir={tmp_path / 'run'}"
    assert not (tmp_path / "run").exists()


def test_109b_script_dry_run_converts_nothing(tmp_path):
    """DRY_RUN=1 prints the job script only: for CPT it names the conversion of the dense checkpoint
    instead of running it (at 109B, hundreds of GB written by a dry run)."""
    (tmp_path / "dense").mkdir()
    env = {**_env(), "PYTHON": sys.executable, "DRY_RUN": "1"}
    proc = subprocess.run(["bash", "recipes/msa_109b.sh", "cpt", str(tmp_path / "dense"), BLEND_109B,
                           f"run_dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"the submission would first run: {sys.executable} -m msa_model.convert dense-to-msa {tmp_path / 'dense'} " \
           f"{tmp_path / 'dense-msa'}" in proc.stderr, proc.stderr
    assert f"init_from={tmp_path / 'dense-msa'}" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense"]


@pytest.mark.parametrize("layout, seq", [("msa_109b_8k", 8192), ("msa_109b_128k", 131072)])
def test_109b_layouts_fit_on_80gb(layout, seq):
    from msa_model.training.estimate import memory_estimate

    cfg = _compose("model=msa_109b", f"parallel={layout}", "recipe=cpt", "init_from=/ckpt")
    world = cfg.launch.nodes * cfg.launch.ranks_per_node
    validate(cfg, world_size=world)
    assert world == 512 and cfg.model.seq_length == seq
    est = memory_estimate(cfg, 257)
    assert est["dp"] * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp == 512
    # 80 GB cards with ~15% headroom for what the estimate leaves out
    assert 5 < est["total"] < 0.85 * 80e9 / 2**30, est


def test_dry_run_of_a_layout_that_cannot_run_says_which_one_can():
    """The 109B model on the one rank of the default layout: the estimate, a warning that it exceeds
    an 80 GB GPU and the smallest shipped layout that fits (the recipes' 8K layout)."""
    out = _dry_run("model=msa_109b", "data.document_mask=false")
    assert _field(out, "world_size") == 1 and _field(out, "memory_per_gpu_gib") > 1000
    assert "\ndocuments: not masked (data.document_mask=false)" in out
    (warning,) = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert warning.startswith("warning: memory_per_gpu_gib=1974.9 exceeds the 80 GiB of the target GPU (an H100 "
                              "80GB by default; launch.gpu_memory_gib=141 for an H200)"), warning
    assert "it fits with parallel=msa_109b_8k (512 GPUs: tp 2, pp 4, ep 32, cp 1, dp 64; 45.7 GiB per GPU), as " \
           "recipe=msa_109b_cpt|msa_109b_dense|msa_109b_pt run it" in warning, warning


def test_memory_advice_follows_the_target_gpu():
    from msa_model.training.dry_run import memory_advice, smallest_fitting_layout
    from msa_model.training.estimate import memory_estimate

    def advice(*overrides):
        cfg = _compose(*overrides)
        return memory_advice(cfg, 257, memory_estimate(cfg, 257, 1)["total"])

    assert advice("model=small") is None  # 17.6 GiB on one GPU
    assert "exceeds the 10 GiB of the target GPU (launch.gpu_memory_gib)" in advice("model=small",
                                                                                     "launch.gpu_memory_gib=10")
    # a layout that also changes the model (the 128K one sets the context) is not offered for 8K
    cfg = _compose("model=msa_109b")
    name, layout, est = smallest_fitting_layout(cfg, 257, 80.0)
    assert name == "msa_109b_8k" and layout.model == cfg.model and est["total"] < 80
    assert smallest_fitting_layout(cfg, 257, 20.0) is None
    text = advice("model=msa_109b", "launch.gpu_memory_gib=20")
    assert "no layout in configs/parallel/ fits this model" in text
    # only the levers left: micro-batches of one cannot be lowered, full recompute is not set again
    assert text.endswith("(with launch.nodes x launch.ranks_per_node GPUs), set model.recompute=full or lower "
                         "parallel.micro_batch_size")
    text = advice("model=msa_109b", "launch.gpu_memory_gib=2", "parallel.micro_batch_size=1", "model.recompute=full")
    assert text.endswith("fits this model: raise parallel.tp/pp/ep/cp (with launch.nodes x launch.ranks_per_node GPUs)")
    # the 128K layout carries its context: at 128K it is the one that fits
    assert smallest_fitting_layout(_compose("model=msa_109b", "model.seq_length=131072"), 257, 80.0)[0] == \
        "msa_109b_128k"


@pytest.mark.parametrize("overrides, message", [
    (["model.num_attention_heads=6", "model.num_query_groups=4"], "model.num_query_groups"),
    (["parallel.ep=3"], r"model.num_experts \(4\) must be a multiple of parallel.ep \(3\)"),
    (["recipe=dense", "parallel.tp=8", "parallel.sequence_parallel=true"],
     r"model.num_attention_heads \(4\) must be a multiple of parallel.tp \(8\)"),
    (["model.msa.topk=16"], r"model.msa.topk \* model.msa.block_size"),
    (["trainer.indexer_warmup_tokens=100000000"], "trainer.indexer_warmup_tokens"),
    (["recipe=cpt"], "init_from=PATH"),
    (["recipe=cpt", "trainer.max_steps=2"], "trainer.indexer_warmup_tokens"),
    (["recipe=dense", "init_from_data_position=true"], "init_from_data_position=true needs init_from=PATH"),
    (["optim.schedule_start_step=-1"], r"optim.schedule_start_step must be >= 0"),
])
def test_bad_combinations_fail_before_any_work(overrides, message):
    cfg = _compose(*overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world_size=1)


def test_the_entry_point_refuses_cpt_without_a_checkpoint(tmp_path):
    proc = run_python(["train.py", "recipe=cpt", f"run_dir={tmp_path}"], timeout=120)
    assert proc.returncode != 0 and "init_from=PATH" in proc.stderr
    assert not (tmp_path / "checkpoints").exists()
    # the dry run shows the recipe, and says what the run would stop at
    out = _dry_run("recipe=cpt", f"run_dir={tmp_path}")
    assert "\nwarning: recipe cpt continues a dense checkpoint: set init_from=PATH" in out, out[-2000:]


# the loss of each checkpoint named on the command line on one fixed batch; a training run's
# config leaves model.vocab_size to the tokenizer (257 bytes + EOD), which the model loader needs
# spelled out
LOSS_SCRIPT = """
import sys, tempfile, torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from msa_model.convert import megatron_io as mio
from msa_model.convert.verify import our_logits
for checkpoint in sys.argv[1:]:
    model = mio.load_model_config(mio.find_model_config(checkpoint))
    model.vocab_size = model.vocab_size or 257
    path = tempfile.mktemp(suffix=".yaml")
    OmegaConf.save(OmegaConf.structured(model), path)
    tokens = torch.randint(0, 256, (2, 257), generator=torch.Generator().manual_seed(0))
    logits = our_logits(checkpoint, tokens[:, :-1], model_config=path)
    print("LOSS", F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item())
"""


def _losses_of(*checkpoints) -> list[float]:
    """One process (one start-up, forked from one that has imported the trainer) for all of them."""
    proc = run_python(["-c", LOSS_SCRIPT, *map(str, checkpoints)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("LOSS ")]
    assert len(losses) == len(checkpoints), proc.stdout[-3000:]
    return losses


def _batches(path) -> list:
    return [json.loads(line)["tokens"] for line in path.read_text().splitlines()]


def test_cpt_continues_a_converted_dense_run(tmp_path, data_cache, monkeypatch):
    """The fair CPT branch of a dense run: converted at step 3 of 6, it reads the dense run's
    batches 4-6 (init_from_data_position) under the dense run's lr at steps 4-6
    (optim.schedule_start_step), from exactly the dense model's loss."""
    dense = tmp_path / "dense"
    monkeypatch.setenv("BATCH_LOG", str(tmp_path / "dense-batches.jsonl"))
    run_train(dense, "recipe=dense", "trainer.max_steps=6", "checkpoint.interval=3", "checkpoint.keep=0",
              data_cache=data_cache, script="tests/batch_record_main.py")
    branch = dense / "checkpoints" / "step_00000003"
    converted = tmp_path / "converted"
    proc = run_python(["-m", "msa_model.convert", "dense-to-msa", str(branch), str(converted)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((converted / "conversion.json").read_text())["data_position"] == \
        {"consumed_samples": 12, "seq_length": 256, "step": 3}
    # dense attention is the warmup phase of MSA: the converted model is the dense model
    dense_loss, msa_warmup_loss = _losses_of(branch, converted)
    assert abs(dense_loss - msa_warmup_loss) < 1e-5, (dense_loss, msa_warmup_loss)

    cpt = tmp_path / "cpt"
    monkeypatch.setenv("BATCH_LOG", str(tmp_path / "cpt-batches.jsonl"))
    # the dense run's schedule (the optim defaults with TINY_TEST's warmup), from its step 3
    cpt_args = ["recipe=cpt", f"init_from={converted}", "trainer.indexer_warmup_tokens=2048",
                "init_from_data_position=true", "optim.schedule_start_step=3", "optim.decay_steps=6", "optim.lr=3e-3",
                "optim.min_lr=3e-4", "optim.index_clip_grad=1.0"]
    proc = run_train(cpt, *cpt_args, "trainer.max_steps=3", data_cache=data_cache, script="tests/batch_record_main.py")
    rows, dense_rows = metrics(cpt), metrics(dense)
    assert sorted(rows) == [1, 2, 3]
    assert [rows[s]["phase"] for s in (1, 2, 3)] == ["warmup", "warmup", "sparse"]
    assert rows[1]["lm_loss"] < dense_rows[1]["lm_loss"] - 0.3
    # 2 micro-batches a step: CPT's 6 are the dense run's 7th to 12th, token for token
    dense_batches, cpt_batches = _batches(tmp_path / "dense-batches.jsonl"), _batches(tmp_path / "cpt-batches.jsonl")
    assert len(dense_batches) == 12 and len(cpt_batches) == 6
    assert cpt_batches == dense_batches[6:]
    assert cpt_batches[0] != dense_batches[0]
    for s in (1, 2, 3):
        assert rows[s]["lr"] == pytest.approx(dense_rows[3 + s]["lr"], rel=1e-9), (s, rows[s]["lr"])
    assert rows[1]["lr"] > 2 * dense_rows[6]["lr"]
    # the position is saved: CPT's checkpoint is at the dense run's sample 24, having started at 12
    from megatron.core import dist_checkpointing

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a one-process read of a distributed checkpoint, said by torch
        trainer = dist_checkpointing.load_common_state_dict(str(cpt / "checkpoints" / "step_00000003"))["trainer"]
    assert (trainer["step"], trainer["consumed_samples"], trainer["start_samples"]) == (3, 24, 12)
    assert "indexer warmup: 2,048 tokens: init_from's index branch is untrained" in proc.stdout + proc.stderr
    # resumed past the warmup, the run's first lines say where it ended, not init_from's history
    proc = run_train(cpt, *cpt_args, "trainer.max_steps=4", data_cache=data_cache)
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "indexer warmup" in line]
    assert said[0].endswith("indexer warmup: 2,048 tokens, done after step 2: the run resumes past it at step 3 "
                            "(3,072 tokens)"), said
    assert not any("untrained" in line for line in said), said
    assert metrics(cpt)[4]["phase"] == "sparse"

    # the CPT run trained its index branch (its checkpoint says so): a CPT from it starts sparse,
    # the recipe's warmup skipped, without a word on the command line
    from msa_model.training.index_history import index_branch_trained

    assert index_branch_trained(converted) is False and index_branch_trained(cpt / "checkpoints") is True
    again = tmp_path / "again"
    proc = run_train(again, "recipe=cpt", f"init_from={cpt / 'checkpoints'}", "trainer.max_steps=2",
                     data_cache=data_cache)
    assert [metrics(again)[s]["phase"] for s in (1, 2)] == ["sparse", "sparse"]
    assert "indexer warmup: none, sparse attention from the first step" in proc.stdout + proc.stderr
    assert "indexer_warmup_tokens: 0" in (again / "config.yaml").read_text()


def test_init_from_survives_the_first_bf16_step(tmp_path, data_cache):
    """bf16 weights have fp32 main copies in the optimizer; loading must refresh them."""
    dense = tmp_path / "dense"
    run_train(dense, "recipe=dense", "model.params_dtype=bf16", "trainer.max_steps=3", data_cache=data_cache)
    cpt = tmp_path / "cpt"
    run_train(cpt, "recipe=cpt", "model.params_dtype=bf16", f"init_from={dense / 'checkpoints'}", "trainer.max_steps=3",
              "trainer.indexer_warmup_tokens=1024", data_cache=data_cache)
    fresh, rows = metrics(dense)[1]["lm_loss"], metrics(cpt)
    assert all(rows[s]["lm_loss"] < fresh - 0.3 for s in (1, 2, 3)), (fresh, rows)


def test_init_from_another_model_names_the_fields_and_the_command_that_works(tmp_path, data_cache):
    """The model comes from the init_from checkpoint; a model.* override that changes its shapes (a
    1-layer checkpoint under 2 layers) is refused before anything is written, naming the field and
    the command without the override."""
    small = tmp_path / "small"
    run_train(small, "recipe=dense", "model.num_layers=1", "trainer.max_steps=2", data_cache=data_cache)
    cpt = tmp_path / "cpt"
    proc = run_train(cpt, "recipe=cpt", f"init_from={small / 'checkpoints'}", "trainer.max_steps=2",
                     "trainer.indexer_warmup_tokens=1024", data_cache=data_cache, check=False)
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "model.num_layers: 1 in the checkpoint, 2 now" in line and "drop model.num_layers=2 to train the " \
           "checkpoint's model: `python train.py " in line and "init_from_partial=true" in line, line
    assert not cpt.exists()
