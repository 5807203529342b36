"""Our side of a conversion: build the GPTModel, save and load checkpoints in the trainer's layout.

Conversions build the real model (msa_model.model.gpt.build_model) in one process and fill its
state dict, so the checkpoint is written by megatron's own `sharded_state_dict` exactly as the
trainer writes it, and loads at any TP/PP/EP (dist_checkpointing reshards on load). Layout of a
converted directory OUT:

    OUT/latest              names the step directory (as in a training run's checkpoints/)
    OUT/step_00000000/      dist_checkpointing directory: "model" (sharded) + common metadata
    OUT/model/<name>.yaml   the Hydra model config (also recorded in the checkpoint: init_from=OUT takes it)
    OUT/conversion.json     source, family, source config.json, index init
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from msa_model.config import ModelConfig, ParallelConfig
from msa_model.convert.hf_io import ConversionError

CONVERSION_FILE = "conversion.json"
MODEL_DIR = "model"


def init_megatron(tp: int = 1, pp: int = 1, ep: int = 1, sequence_parallel: bool = False, seed: int = 1234) -> ParallelConfig:
    """Process group (1 process, or torchrun's) and megatron's parallel state; idempotent."""
    from megatron.core import parallel_state

    from msa_model.training.distributed import init_distributed

    parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, sequence_parallel=sequence_parallel, backend="gloo")
    if not parallel_state.model_parallel_is_initialized():
        init_distributed(parallel, "cpu", seed)
    return parallel


def build(model_cfg: ModelConfig, parallel: ParallelConfig):
    """The model on CPU in fp32 or the config's dtype, eval mode. Needs `init_megatron` first."""
    from msa_model.model.gpt import build_model

    if model_cfg.vocab_size is None:
        raise ConversionError("model.vocab_size must be set for a conversion")
    model = build_model(model_cfg, parallel, model_cfg.vocab_size, on_cpu=True)
    return model.eval()


def assign(model, tensors: dict, where: str) -> None:
    """Copy unsharded tensors (megatron names) into a TP=1 model; every parameter must be given.

    Values are tensors or zero-argument functions returning one (called once, in turn, so a
    conversion holds one source tensor at a time). The embedding and output layer may be
    shorter than the padded vocabulary: padding rows are 0.
    """
    state = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    missing = sorted(set(state) - set(tensors))
    if missing:
        raise ConversionError(f"{where}: no value for model tensor(s) {missing[:6]}")
    unknown = sorted(set(tensors) - set(state))
    if unknown:
        raise ConversionError(f"{where}: the model has no tensor(s) {unknown[:6]}")
    with torch.no_grad():
        for name, target in state.items():
            src = tensors[name]
            src = src() if callable(src) else src
            padded_vocab = name in ("embedding.word_embeddings.weight", "output_layer.weight")
            if padded_vocab and src.shape[0] <= target.shape[0] and src.shape[1:] == target.shape[1:]:
                target.zero_()
                target[: src.shape[0]].copy_(src)
            elif src.shape != target.shape:
                raise ConversionError(f"{where}: tensor {name!r} has shape {list(src.shape)}, the model "
                                      f"expects {list(target.shape)}")
            else:
                target.copy_(src)


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Unsharded tensors of a TP=1 model, by megatron name (no `_extra_state`)."""
    return {k: v.detach() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def save(model, out: str | Path, metadata: dict, tokenizer=None, model_config: dict | None = None) -> Path:
    """Write `model` as OUT/step_00000000 with a `latest` pointer (the trainer's layout); with
    `tokenizer` (data/tokenizer.py), its step directory records it as a training checkpoint does,
    and `model_config` (the ModelConfig as a dict) as a training checkpoint records it:
    `init_from=OUT` trains this model without naming it."""
    from megatron.core import dist_checkpointing

    from msa_model.training.checkpoint import publish_save, step_dir_name
    from msa_model.training.manifest import write_manifest

    out = Path(out)
    name = step_dir_name(0)
    tmp, final = out / f".tmp-{name}", out / name
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = {"model": model.sharded_state_dict(), "world_size": dist.get_world_size(), "conversion": metadata}
    if model_config is not None:
        state["model_config"] = model_config
    dist_checkpointing.save(state, str(tmp))
    if tokenizer is not None and dist.get_rank() == 0:
        from msa_model.training.data_setup import write_checkpoint_tokenizer

        write_checkpoint_tokenizer(tmp, tokenizer)
    dist.barrier()
    write_manifest(tmp)
    if dist.get_rank() == 0:
        publish_save(out, tmp, name)
    dist.barrier()
    return final


def load(model, path: str | Path, allow_missing_index: bool = False) -> None:
    """Load model weights from a checkpoint root or step directory (the rule of `init_from=`).

    With `allow_missing_index`, index-branch tensors absent from the checkpoint keep their
    values; any other absent tensor is an error.
    """
    from msa_model.training.checkpoint import load_weights

    step = checkpoint_step_dir(path)
    load_weights(model, step, allow_missing_index, what="checkpoint", error=ConversionError)


def checkpoint_step_dir(path: str | Path) -> Path:
    """The step directory of a checkpoint root (via `latest`) or the directory itself."""
    from msa_model.training.checkpoint import LATEST, latest_checkpoint

    path = Path(path)
    if (path / LATEST).is_file():
        step = latest_checkpoint(path)
        if step is None:
            raise ConversionError(f"{path}: `latest` names a checkpoint that does not exist")
        return step
    if (path / "metadata.json").is_file() or (path / ".metadata").is_file():
        return path
    from msa_model.training.inputs import not_a_checkpoint_hint

    raise ConversionError(f"{path}: not a checkpoint (no `latest` pointer and no dist_checkpointing metadata)"
                          f"{not_a_checkpoint_hint(path, 'give OUT')}")


def write_model_yaml(model_cfg: ModelConfig, out: str | Path, header: str = "") -> Path:
    """OUT/model/<name>.yaml: the model group entry, every field spelled out. It is the only one:
    an earlier conversion's entry (--overwrite, another --name or family) goes, since readers of OUT
    (msa-to-hf, `model=<name>`) take the model from the one entry there."""
    path = Path(out) / MODEL_DIR / f"{model_cfg.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in path.parent.glob("*.yaml"):
        if old != path:
            old.unlink()
    body = OmegaConf.to_yaml(OmegaConf.structured(model_cfg))
    path.write_text("".join(f"# {line}\n" for line in header.splitlines()) + body)
    return path


def load_model_config(path: str | Path) -> ModelConfig:
    """A ModelConfig from a model YAML, or from the `model:` section of a run's config.yaml."""
    raw = OmegaConf.load(path)
    if "model" in raw and OmegaConf.is_dict(raw.model):
        raw = raw.model
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), raw)
    return OmegaConf.to_object(merged)


def find_model_config(src: str | Path) -> Path:
    """The model config of a checkpoint: OUT/model/*.yaml of a conversion, or the run's
    config.yaml above a training checkpoint (<run_dir>/checkpoints[/step_N])."""
    src = Path(src).resolve()
    for d in (src, src.parent, src.parent.parent):
        yamls = sorted((d / MODEL_DIR).glob("*.yaml")) if (d / MODEL_DIR).is_dir() else []
        if len(yamls) == 1 and (d / CONVERSION_FILE).is_file():
            return yamls[0]
        if (d / "config.yaml").is_file():
            return d / "config.yaml"
    raise ConversionError(f"{src}: cannot find its model config (a converted model/*.yaml or a run's "
                          "config.yaml); pass --model-config")


def find_conversion_record(src: str | Path) -> dict | None:
    """conversion.json of a converted checkpoint, also through a run's `init_from` (a relative one
    read from the directory the run was launched in, not this command's)."""
    from msa_model.training.run_dir import run_path

    src = Path(src).resolve()
    for d in (src, src.parent, src.parent.parent):
        if (d / CONVERSION_FILE).is_file():
            return json.loads((d / CONVERSION_FILE).read_text())
        if (d / "config.yaml").is_file():
            init_from = OmegaConf.load(d / "config.yaml").get("init_from")
            if init_from and run_path(d, init_from).resolve() != src:
                return find_conversion_record(run_path(d, init_from))
            return None
    return None
