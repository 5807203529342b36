"""The conversions: hf-to-msa, dense-to-msa and msa-to-hf (see `python -m msa_model.convert -h`).

Each builds the real model in one process (msa_model.convert.megatron_io), so what it writes is
what the trainer writes and loads, at any TP/PP/EP.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from data.tokenizer import HFTokenizer, build_tokenizer
from msa_model.config import (SPARSE_SHARE, ConfigError, ModelConfig, ParallelConfig, TrainConfig, msa_layers_of,
                              sparse_geometry, validate)
from msa_model.convert import DEFAULT_SEQ_LENGTH, MAX_SEQ_LENGTH
from msa_model.convert import megatron_io as mio
from msa_model.convert.config_keys import text_config
from msa_model.convert.families import FAMILIES, model_config_from_hf
from msa_model.convert.hf_io import CONFIG_FILE, ConversionError, HFCheckpoint, read_config, save_safetensors
from msa_model.convert.hf_mapping import Rule, check_hf_shapes, fuse, split
from msa_model.convert.index_init import DEFAULT, check_method, index_weight_names, index_weights
from msa_model.training.index_history import index_branch_trained

log = logging.getLogger(__name__)

# tensors some HF checkpoints carry that are recomputed, not learned
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def check_layout(model: ModelConfig, tp: int, pp: int, ep: int) -> None:
    """Raise ConversionError when the model cannot run at this TP/PP/EP."""
    parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1 and model.num_experts > 0,
                              micro_batch_size=1, global_batch_size=1)
    try:
        validate(TrainConfig(model=model, parallel=parallel, name="convert"))
    except ConfigError as e:
        raise ConversionError(f"the converted model cannot run at tp={tp} pp={pp} ep={ep} (or its config is "
                              f"invalid): {e}") from e


def _index_tensors(model: ModelConfig, method: str, tensors: dict, seed: int) -> dict:
    """Index-branch tensors (megatron names -> zero-argument functions computing them) of every
    MSA layer, from its QKV weight and QK norms in `tensors` (megatron names -> tensors, or
    zero-argument functions computing them). Each layer is computed once, when first asked for,
    from its own seeded generator (so the result does not depend on the order of the calls)."""
    cache: dict[int, dict[str, torch.Tensor]] = {}
    qkv = Rule("", ("q", "k", "v"), "qkv")

    def value(name: str) -> torch.Tensor:
        return tensors[name]() if callable(tensors[name]) else tensors[name]

    def layer_qk(i: int) -> tuple:
        """(q [Hq*D, H], k [Hkv*D, H], q_norm [D], k_norm [D]) of layer i; norms None without QK norm."""
        sa = f"decoder.layers.{i}.self_attention"
        q, k, _ = split(qkv, value(f"{sa}.linear_qkv.weight"), model)
        norms = ((value(f"{sa}.q_layernorm.weight"), value(f"{sa}.k_layernorm.weight"))
                 if model.qk_layernorm else (None, None))
        return q, k, *norms

    def layer(i: int) -> dict[str, torch.Tensor]:
        if i not in cache:
            gen = torch.Generator().manual_seed(seed * 100_003 + i)
            cache.clear()  # one layer at a time
            cache[i] = index_weights(model, method, *layer_qk(i), generator=gen)
        return cache[i]

    out = {}
    for i, is_msa in enumerate(msa_layers_of(model)):
        if not is_msa:
            continue
        for attr in index_weight_names(model):
            out[f"decoder.layers.{i}.self_attention.{attr}"] = lambda i=i, attr=attr: layer(i)[attr]
    return out


def _metadata(**kw) -> dict:
    return {k: v for k, v in kw.items() if v is not None}


def hf_to_msa(src: str, out: str, *, attention: str = "msa", index_init: str | None = None, tp: int = 1, pp: int = 1,
              ep: int = 1, seq_length: int | None = None, max_seq_length: int = MAX_SEQ_LENGTH,
              block_size: int | None = None, topk: int | None = None, index_head_dim: int | None = None,
              local_blocks: int | None = None, name: str | None = None, seed: int = 0,
              tokenizer: str | None = None) -> Path:
    """A Hugging Face checkpoint directory -> our checkpoint + model config in `out`. Returns `out`.

    The training context (`seq_length`) defaults to the source's max_position_embeddings, at most
    `max_seq_length`. The MSA geometry comes from the checkpoint when it has one (MiniMax-M3, an
    exported MSA model), else it is chosen for that context (msa_model.config.sparse_geometry: the
    production block size and top-k from 8K tokens on) with Di = D; the keyword arguments override
    it. The tokenizer files of `tokenizer` (default: `src`) are copied into the checkpoint, which
    training then takes as its tokenizer."""
    hf_cfg = read_config(src)
    return convert_hf_tensors(HFCheckpoint(src), hf_cfg, out, source=str(Path(src).resolve()), tokenizer=tokenizer or src,
                              where=str(Path(src) / CONFIG_FILE), kind="hf-to-msa", attention=attention,
                              index_init=index_init, tp=tp, pp=pp, ep=ep, seq_length=seq_length,
                              max_seq_length=max_seq_length, block_size=block_size, topk=topk,
                              index_head_dim=index_head_dim, local_blocks=local_blocks, name=name, seed=seed)


def _context(hf_cfg: dict, seq_length: int | None, max_seq_length: int) -> tuple[int, str]:
    """(training context, why that one) for a source config.json."""
    if seq_length is not None:
        return seq_length, "--seq-length"
    source = text_config(hf_cfg).get("max_position_embeddings")
    if source is None:
        return min(DEFAULT_SEQ_LENGTH, max_seq_length), "the source's config.json names no max_position_embeddings"
    if int(source) > max_seq_length:
        return max_seq_length, f"the source's max_position_embeddings {int(source)}, capped by --max-seq-length"
    return int(source), "the source's max_position_embeddings"


def _geometry(model: ModelConfig, hf_cfg: dict, fam, where: str, block_size: int | None, topk: int | None,
              local_blocks: int | None) -> tuple[int, int, str]:
    """(block size, top-k, where they come from) of the converted model."""
    s = model.msa
    local = local_blocks or s.local_blocks
    if fam.has_msa_geometry(hf_cfg):
        return block_size or s.block_size, topk or s.topk, "the checkpoint's own" + (
            " with --block-size/--topk" if block_size or topk else "")
    if block_size and topk:
        return block_size, topk, "--block-size and --topk"
    chosen = sparse_geometry(model.seq_length, block_size, topk, local)
    if chosen is None:
        raise ConversionError(
            f"{where}: no MSA geometry reads at most 1/{SPARSE_SHARE} of a {model.seq_length}-token context with "
            f"blocks that divide it{' (--block-size ' + str(block_size) + ')' if block_size else ''}"
            f"{' (--topk ' + str(topk) + ')' if topk else ''}; pass --block-size and --topk (top-k x block size "
            "below --seq-length), a longer --seq-length, or --attention dense")
    given = "--block-size" if block_size else "--topk" if topk else ""
    return chosen[0], chosen[1], f"chosen for this context{' with ' + given if given else ''}"


def convert_hf_tensors(ckpt, hf_cfg: dict, out: str, *, source: str, where: str, kind: str, attention: str = "msa",
                       index_init: str | None = None, tp: int = 1, pp: int = 1, ep: int = 1, seq_length: int | None = None,
                       max_seq_length: int = MAX_SEQ_LENGTH, block_size: int | None = None, topk: int | None = None,
                       index_head_dim: int | None = None, local_blocks: int | None = None, name: str | None = None,
                       seed: int = 0, tokenizer: str | None = None) -> Path:
    """Tensors in a Hugging Face family's names (an HFCheckpoint, or a TensorDict of a DeepSpeed
    checkpoint) + that model's config.json -> our checkpoint in `out`, with the Hugging Face
    tokenizer of the directory `tokenizer` when it holds one. Everything is checked (config,
    names, shapes, layout, tokenizer) before the model is built and anything is written."""
    context, why = _context(hf_cfg, seq_length, max_seq_length)
    fam, model = model_config_from_hf(hf_cfg, attention=attention, seq_length=context, name=name, where=where)
    hf_tokenizer = source_tokenizer(tokenizer, model.vocab_size)
    block, k, origin = _geometry(model, hf_cfg, fam, where, block_size, topk, local_blocks)
    s = model.msa
    model.msa = dataclasses.replace(s, block_size=block, topk=k, index_head_dim=index_head_dim or s.index_head_dim,
                                    local_blocks=local_blocks or s.local_blocks)
    check_layout(model, tp, pp, ep)
    log.info("context %d tokens (%s); MSA blocks of %d tokens, top-%d = %d keys per query, 1/%d of the context (%s; "
             "--seq-length, --block-size and --topk change them)", context, why, block, k, block * k,
             context // (block * k), origin)
    ckpt, skipped = fam.open(ckpt)
    for part, count in sorted(skipped.items()):
        log.info("%s: skipping %d tensor(s) of %s (not part of the text model)", source, count, part)

    msa = model.attention == "msa"
    index_names = set(fam.hf_shapes(model, with_index=True)) - set(fam.hf_shapes(model, with_index=False))
    # the model's own tensors first: weights of another model are named as such
    check_hf_shapes(ckpt, fam.hf_shapes(model, with_index=False), source)
    has_index = msa and _source_index_branch(ckpt, index_names, source, required=fam.runs_msa)
    expected = fam.hf_shapes(model, with_index=has_index)
    check_hf_shapes(ckpt, expected, source)
    unexpected = [n for n in ckpt.names if n not in expected and n not in index_names and not n.endswith(_IGNORED_HF_SUFFIXES)]
    if unexpected:
        raise ConversionError(f"{source}: tensors the {fam.name} mapping does not know: {unexpected[:6]}"
                              f"{' ...' if len(unexpected) > 6 else ''}")
    if msa and has_index and index_init is not None:
        log.warning("%s carries its index branch, which is read as it is: --index-init %s is not used", source,
                    index_init)
    index_init = index_init or DEFAULT
    if msa and not has_index:
        check_method(model, index_init)
    source_dtype = _SAFETENSORS_DTYPES.get(ckpt.dtype(ckpt.names[0]), "float32")

    # tensors are read and fused one at a time, as the model asks for them: memory stays at one model
    tensors = {rule.mcore: lambda rule=rule: fuse(rule, [ckpt.get(n) for n in rule.hf], model)
               for rule in fam.rules(model, with_index=has_index)}
    if msa and not has_index:
        tensors.update(_index_tensors(model, index_init, tensors, seed))

    parallel = mio.init_megatron()
    megatron_model = mio.build(model, parallel)
    mio.assign(megatron_model, tensors, source)
    init = ("from checkpoint" if has_index else index_init) if msa else None
    # an index branch read from the source was trained there (MiniMax-M3), unless our export says
    # it was not (UNTRAINED_KEY); a derived or drawn one was not (msa_model/training/index_history.py:
    # recipe=cpt skips the warmup for a trained one)
    trained = msa and has_index and hf_cfg.get(UNTRAINED_KEY) is not False
    if msa and has_index and not trained:
        log.info("%s: its index branch is read but recorded untrained (%s: false in config.json, written by "
                 "msa-to-hf): recipe=cpt warms it up", source, UNTRAINED_KEY)
    record = _metadata(kind=kind, source=source, family=fam.name, index_init=init, index_trained=trained,
                       source_dtype=source_dtype, skipped=skipped or None, hf_config=hf_cfg,
                       target_layout={"tp": tp, "pp": pp, "ep": ep})
    _write(megatron_model, model, out, record,
           header=f"{fam.architecture} converted from {source} ({model.attention} attention)", tokenizer=hf_tokenizer)
    return Path(out)


def _source_index_branch(ckpt, index_names: set[str], source: str, required: bool) -> bool:
    """Whether the source carries the index branch (read from it, not initialised). Some of its
    tensors without the others is refused naming the missing ones: initialising the whole branch
    instead would drop the trained tensors that are there, and mixing the two is neither model.
    `required` (a family whose format runs MSA, MiniMax-M3): none of them is refused too."""
    present = {n for n in index_names if n in ckpt}
    if (present or required) and present != index_names:
        missing = sorted(index_names - present)
        raise ConversionError(f"{source}: the index branch is incomplete: {len(present)} of its {len(index_names)} "
                              f"tensors are here, missing {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    return bool(present)


def source_tokenizer(directory: str | None, vocab_size: int | None):
    """The Hugging Face tokenizer of `directory` to carry into a converted checkpoint, or None (with
    a warning) when it holds no tokenizer files. Raises ConversionError for one that cannot be
    loaded or whose ids the model's embedding does not cover."""
    from data.tokenizer import TokenizerError, check_tokenizer_dir

    if directory is None or check_tokenizer_dir(directory) is not None:
        log.warning("%s holds no tokenizer files: the checkpoint records no tokenizer; pass --tokenizer DIR, or "
                    "give data.tokenizer=DIR when training on it", directory)
        return None
    try:
        tokenizer = build_tokenizer(str(Path(directory).resolve()))
    except TokenizerError as e:
        raise ConversionError(f"{directory}: {e}") from e
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise ConversionError(f"{directory}: the tokenizer has {tokenizer.vocab_size} ids, the model's embedding "
                              f"{vocab_size} rows: not this model's tokenizer")
    return tokenizer


def _write(megatron_model, model: ModelConfig, out: str, record: dict, header: str, tokenizer=None) -> None:
    out = Path(out)
    mio.save(megatron_model, out, {k: v for k, v in record.items() if k != "hf_config"}, tokenizer=tokenizer,
             model_config=dataclasses.asdict(model))
    use = f"use: python train.py recipe=cpt init_from={out.resolve()}"
    yaml = mio.write_model_yaml(model, out, header=f"{header}\n{use}\n(the checkpoint records this model: "
                                "model.* overrides apply on top of it)")
    (out / mio.CONVERSION_FILE).write_text(json.dumps(record, indent=2) + "\n")
    log.info("wrote %s and %s", mio.checkpoint_step_dir(out), yaml)


def _padded_vocab_in_checkpoint(src) -> int:
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(mio.checkpoint_step_dir(src)))
    return int(meta["embedding.word_embeddings.weight"].global_shape[0])


def _require_checkpoint_dir(src: str) -> None:
    """A mistyped source is named as missing, and a directory that is not a checkpoint (a run
    directory, a Hugging Face model) as what it is, before the searches for its model config and
    conversion record would report what they could not find in it."""
    if not Path(src).is_dir():
        raise ConversionError(f"{src}: no such checkpoint directory")
    mio.checkpoint_step_dir(src)


def _load_source(src: str, model_config: str | None) -> tuple[ModelConfig, ModelConfig, object]:
    """(config as recorded, config used to build, loaded TP=1 model) of one of our checkpoints."""
    _require_checkpoint_dir(src)
    cfg = mio.load_model_config(model_config or mio.find_model_config(src))
    build_cfg = cfg if cfg.vocab_size is not None else dataclasses.replace(cfg, vocab_size=_padded_vocab_in_checkpoint(src))
    parallel = mio.init_megatron()
    model = mio.build(build_cfg, parallel)
    mio.load(model, src)
    return cfg, build_cfg, model


def dense_to_msa(src: str, out: str, *, model_config: str | None = None, index_init: str | None = None,
                 block_size: int | None = None, topk: int | None = None, index_head_dim: int | None = None,
                 local_blocks: int | None = None, name: str | None = None, seed: int = 0) -> Path:
    """One of our dense-attention checkpoints -> the MSA model: every tensor kept bit-identical,
    index projections added; the dense run's data position is recorded (init_from_data_position)."""
    from msa_model.training.checkpoint import recorded_data_position

    index_init = index_init or DEFAULT
    cfg, build_cfg, dense = _load_source(src, model_config)
    if cfg.attention != "dense":
        raise ConversionError(f"{src}: model.attention is {cfg.attention!r}; dense-to-msa needs a dense checkpoint")
    s = cfg.msa
    geometry = dataclasses.replace(
        s, block_size=block_size or s.block_size, topk=topk or s.topk, local_blocks=local_blocks or s.local_blocks,
        index_head_dim=index_head_dim or (cfg.head_dim if index_init == "derived" else s.index_head_dim))
    msa_cfg = dataclasses.replace(cfg, attention="msa", msa=geometry, name=name or f"{cfg.name}-msa")
    check_method(msa_cfg, index_init)
    tensors = mio.full_state_dict(dense)
    tensors.update(_index_tensors(msa_cfg, index_init, tensors, seed))

    msa_model = mio.build(dataclasses.replace(msa_cfg, vocab_size=build_cfg.vocab_size), ParallelConfig())
    mio.assign(msa_model, tensors, str(src))
    source_record = mio.find_conversion_record(src) or {}
    # where the dense run stopped reading data, for init_from_data_position
    record = _metadata(kind="dense-to-msa", source=str(Path(src).resolve()), family=source_record.get("family"),
                       index_init=index_init, index_trained=False, source_dtype=source_record.get("source_dtype"),
                       data_position=recorded_data_position(mio.checkpoint_step_dir(src)),
                       hf_config=source_record.get("hf_config"))
    _write(msa_model, msa_cfg, out, record, header=f"MSA model converted from the dense checkpoint {Path(src).resolve()}",
           tokenizer=_checkpoint_tokenizer(src))
    return Path(out)


def _checkpoint_tokenizer(src: str):
    """The tokenizer one of our checkpoints records, built, or None."""
    from msa_model.training.data_setup import checkpoint_tokenizer

    _, spec = checkpoint_tokenizer(mio.checkpoint_step_dir(src))
    return build_tokenizer(spec) if spec is not None else None


# config.json key of an export whose index branch is untrained (derived by a conversion, or still in
# its run's indexer warmup), so that converting it back keeps the warmup; absent: trained
UNTRAINED_KEY = "msa_index_trained"


def msa_to_hf(src: str, out: str, *, family: str | None = None, model_config: str | None = None,
              dtype: str | None = None, max_shard_size: int = 5 * 2**30) -> Path:
    """One of our checkpoints (MSA or dense) -> a Hugging Face directory in the source family's names."""
    _require_checkpoint_dir(src)
    record = mio.find_conversion_record(src) or {}
    family = family or record.get("family")
    if family is None:
        raise ConversionError(f"{src}: no conversion record names the model family; pass --family "
                              f"({', '.join(FAMILIES)})")
    if family not in FAMILIES:
        raise ConversionError(f"--family {family!r} is not supported; choose from {', '.join(FAMILIES)}")
    fam = FAMILIES[family]
    cfg, build_cfg, model = _load_source(src, model_config)
    fam.check_exportable(cfg)
    dtype = dtype or record.get("source_dtype") or ("bfloat16" if cfg.params_dtype == "bf16" else "float32")
    state = mio.full_state_dict(model)
    vocab = build_cfg.vocab_size
    tensors = {}
    for rule in fam.rules(build_cfg, with_index=cfg.attention == "msa"):
        parts = split(rule, state[rule.mcore], build_cfg)
        for hf_name, t in zip(rule.hf, parts):
            if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
                t = t[:vocab]
            tensors[hf_name] = t.to(_DTYPES[dtype]).contiguous()
    tensors = fam.export_layout(tensors, build_cfg)
    files = save_safetensors(tensors, out, max_shard_bytes=max_shard_size)
    hf_cfg = fam.hf_config(build_cfg, record.get("hf_config"))
    hf_cfg["dtype"] = dtype
    # the source's config may carry an earlier export's word: this checkpoint's history decides
    hf_cfg.pop(UNTRAINED_KEY, None)
    if cfg.attention == "msa" and index_branch_trained(src) is False:
        hf_cfg[UNTRAINED_KEY] = False
    tokenizer = _checkpoint_tokenizer(src)
    if tokenizer is not None:
        # the ids of the tokenizer it trained with, where the source's config.json names none: the
        # family's config class would fill in its own (M3's 200034 / 200020, past a byte model's rows)
        hf_cfg.setdefault("bos_token_id", tokenizer.bos)
        hf_cfg.setdefault("eos_token_id", tokenizer.eod)
    (Path(out) / CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save(out)
        log.info("wrote the checkpoint's tokenizer (%s) beside the weights", tokenizer.identity["name"])
    else:
        log.warning("%s records no Hugging Face tokenizer%s: none written to %s", src,
                    " (it was trained with the byte tokenizer)" if tokenizer is not None else "", out)
    log.info("wrote %s (%d tensors in %d file(s)) as %s", out, len(tensors), len(files), fam.architecture)
    return Path(out)
