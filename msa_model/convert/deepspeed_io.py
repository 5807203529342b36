"""DeepSpeed checkpoints (ZeRO stage 0, 1, 2 or 3) of a Hugging Face model -> our MSA checkpoint.

A ZeRO checkpoint directory (what `engine.save_checkpoint(dir)` and the Hugging Face Trainer's
`checkpoint-N/` hold: `latest` naming a `global_stepN/` of model and optimizer-state shards) is
read with DeepSpeed's own loader, `deepspeed.utils.zero_to_fp32`, which gathers the fp32 master
weights from every data-parallel rank's partition. Those tensors carry the module's parameter
names, i.e. the Hugging Face family's when the engine wrapped a transformers model, and go
through the same mapping as `hf-to-msa` with the model's config.json (`--hf-config`). A checkpoint
saved without ZeRO (stage 0) has no partitions for that loader: its one model-states file holds the
whole module, read as it is.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from msa_model.convert.hf_io import CONFIG_FILE, ConversionError, TensorDict, read_config

log = logging.getLogger(__name__)

# a wrapper module (torch DDP, a user's own `self.module = model`) prefixes every name with this
_WRAPPER_PREFIX = "module."
# the model states of a checkpoint at stage 0, 1 or 2 (stage 3 writes one per rank)
_MODEL_STATES = "mp_rank_00_model_states.pt"


def _stage0_module(step_dir: Path) -> dict | None:
    """The module's state dict of a checkpoint saved without ZeRO (stage 0), else None. Stage 0
    writes no optimizer partitions and no parameter shapes, which DeepSpeed's zero_to_fp32 needs
    (it fails on one with a TypeError); its model-states file holds every weight in the dtype the
    engine trained in."""
    file = step_dir / _MODEL_STATES
    if not file.is_file() or any(step_dir.glob("*_optim_states.pt")):
        return None
    try:
        states = torch.load(file, map_location="cpu", weights_only=False)
    except Exception as e:  # a damaged or foreign pickle: name the file
        raise ConversionError(f"{file}: not a readable DeepSpeed model-states file ({e})") from e
    if not isinstance(states, dict) or states.get("param_shapes") is not None or "module" not in states:
        return None
    log.info("%s: a DeepSpeed checkpoint without ZeRO (stage 0): the module's weights as saved", step_dir)
    return dict(states["module"])


def load_zero_checkpoint(ckpt_dir: str | Path, tag: str | None = None) -> dict:
    """State dict {name: tensor} of a DeepSpeed checkpoint directory (the newest tag, or `tag`): the
    fp32 master weights gathered from the ZeRO partitions, or at stage 0 the module's own."""
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as e:
        raise ConversionError(f"deepspeed-to-msa needs DeepSpeed (pip install 'msa-model[deepspeed]'): {e}") from e
    ckpt_dir = Path(ckpt_dir)
    if tag is None and not (ckpt_dir / "latest").is_file():
        steps = sorted(p.name for p in ckpt_dir.glob("global_step*") if p.is_dir())
        hint = f"; pass --tag (found {steps})" if steps else ""
        raise ConversionError(f"{ckpt_dir}: not a DeepSpeed checkpoint directory (no `latest` file){hint}")
    step_dir = ckpt_dir / (tag or (ckpt_dir / "latest").read_text().strip())
    state = _stage0_module(step_dir)
    try:
        if state is None:
            state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    except (FileNotFoundError, ValueError, KeyError, RuntimeError) as e:
        raise ConversionError(f"{ckpt_dir}: cannot read the ZeRO checkpoint{f' {tag}' if tag else ''}: {e}") from e
    if state and all(name.startswith(_WRAPPER_PREFIX) for name in state):
        state = {name[len(_WRAPPER_PREFIX):]: t for name, t in state.items()}
    return state


def deepspeed_to_msa(ckpt_dir: str, out: str, *, hf_config: str | None = None, tag: str | None = None,
                     **convert_kw) -> Path:
    """A ZeRO checkpoint of a Hugging Face model (config.json in `hf_config`, by default in
    `ckpt_dir` itself, where the Hugging Face Trainer's checkpoint-N/ has it) -> our checkpoint in
    `out`; keywords as for `hf_to_msa` (attention, index_init, geometry, layout checks)."""
    from msa_model.convert.commands import convert_hf_tensors

    if hf_config is None:
        if not (Path(ckpt_dir) / CONFIG_FILE).is_file():
            raise ConversionError(f"{ckpt_dir}: no {CONFIG_FILE} beside the ZeRO checkpoint; pass --hf-config DIR, "
                                  "the directory of the model's Hugging Face config.json")
        hf_config = ckpt_dir
    cfg = read_config(hf_config)
    state = load_zero_checkpoint(ckpt_dir, tag)
    if not state:
        raise ConversionError(f"{ckpt_dir}: the ZeRO checkpoint holds no parameters")
    # a tied output layer is restored as a second name for the embedding: one weight, not two
    if cfg.get("tie_word_embeddings") and "lm_head.weight" in state and "model.embed_tokens.weight" in state:
        state.pop("lm_head.weight")
    source = str(Path(ckpt_dir).resolve()) + (f" ({tag})" if tag else "")
    log.info("read %d tensors from the DeepSpeed checkpoint %s", len(state), source)
    if convert_kw.get("tokenizer") is None:
        convert_kw["tokenizer"] = hf_config
    return convert_hf_tensors(TensorDict(state, source), cfg, out, source=source,
                              where=str(Path(hf_config) / CONFIG_FILE), kind="deepspeed-to-msa", **convert_kw)
