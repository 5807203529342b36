"""What `msa_model.config.validate` checks beyond the schema's types: sizes, divisibility, the MSA
geometry and the kernels' shapes, the parallel layout, data, launch and run options. Every
problem found is named in one line; `check_config` raises ConfigError with all of them.
"""

from __future__ import annotations

import math
import signal
from typing import Optional

from data.retrieval import MIN_LENGTH as RETRIEVAL_MIN_LENGTH, TASKS as RETRIEVAL_TASKS
from msa_model.config import (GRAPH_SCOPES, ConfigError, fitting_geometry_hint, moe_layers, msa_layers_of,
                              tuning_overrides)
from msa_model.ops.common import block_size_problem, keys_per_query
# the ops own their options' values: KL_TEACHERS (where the indexer KL's teacher is computed),
# INDEX_PRECISIONS (select_blocks' products)
from msa_model.ops.msa_attention import KL_TEACHERS
from msa_model.ops.select_blocks.fp8 import INDEX_PRECISIONS
from msa_model.ops.tuning import tuning_problems


def _check(errors: list[str], ok: bool, message: str) -> None:
    if not ok:
        errors.append(message)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _on_gpu(cfg, gpu: Optional[bool]) -> bool:
    """Whether the job runs on GPUs: `gpu` when given, else trainer.device (auto: this machine)."""
    if gpu is not None:
        return gpu
    device = cfg.trainer.device
    if device != "auto":
        return device == "cuda"
    import torch

    return torch.cuda.is_available()


def _uses_triton(cfg, gpu: Optional[bool]) -> bool:
    """Whether the MSA ops will run the Triton kernels (msa_model.ops.common.resolve_backend)."""
    backend = cfg.model.msa.backend
    if backend != "auto":
        return backend == "triton"
    return _on_gpu(cfg, gpu)


def _check_kernel_shapes(errors: list[str], cfg, gpu: Optional[bool]) -> None:
    """What the model's rotary embeddings and, on GPU, the fused MSA kernels need of the shapes."""
    m, msa = cfg.model, cfg.model.msa
    # rotary embeddings rotate pairs of channels
    _check(errors, m.head_dim % 2 == 0, f"model.head_dim ({m.head_dim}) must be even (rotary embeddings rotate "
                                        "pairs of channels)")
    if m.attention != "msa":
        return
    _check(errors, msa.index_head_dim % 2 == 0, f"model.msa.index_head_dim ({msa.index_head_dim}) must be even "
                                                "(the index branch's rotary embeddings rotate pairs of channels)")
    if not _uses_triton(cfg, gpu):
        return
    # the limits the Triton kernels check at launch (msa_model/ops/*/triton.py), stated up front
    where = f"with the Triton kernels (model.msa.backend={msa.backend} on GPU)"
    _check(errors, m.head_dim in (16, 32, 64, 128, 256),
           f"model.head_dim ({m.head_dim}) must be a power of two in [16, 256] {where}")
    _check(errors, _is_pow2(msa.index_head_dim) and msa.index_head_dim >= 16,
           f"model.msa.index_head_dim ({msa.index_head_dim}) must be a power of two >= 16 {where}")
    problem = block_size_problem(msa.block_size, triton=True)
    _check(errors, problem is None, f"model.msa.block_size ({msa.block_size}) {problem} {where}")


# the longest context at which model.msa.cuda_graph was measured to pay (bench/RESULTS.md, 8K)
GRAPH_MEASURED_LENGTH = 8192


def _check_cuda_graph(errors: list[str], cfg, gpu: Optional[bool]) -> None:
    """model.msa.cuda_graph: where a captured core replays the same work on the same buffers."""
    m, p = cfg.model, cfg.parallel
    _check(errors, m.msa.cuda_graph_scope in GRAPH_SCOPES,
           f"model.msa.cuda_graph_scope must be one of {', '.join(GRAPH_SCOPES)} (got {m.msa.cuda_graph_scope!r})")
    if not m.msa.cuda_graph:
        return
    on_gpu = _on_gpu(cfg, gpu)
    unsupported = [
        (m.attention != "msa", "model.attention=msa (a dense model has no MSA core)"),
        (not on_gpu, "a GPU (trainer.device=cuda)"),
        (m.recompute != "none", f"model.recompute=none (got {m.recompute}: a recomputed core runs its forward "
                                "again inside the backward)"),
        (p.pp > 1, f"parallel.pp=1 (got {p.pp}: a pipeline holds several micro-batches' forwards before "
                   "their backwards, and a layer's graph keeps one)"),
        (p.cp > 1, f"parallel.cp=1 (got {p.cp}: the core runs per query chunk against gathered keys)"),
    ]
    if m.msa.cuda_graph_scope == "attention":
        unsupported.append((p.tp > 1, f"parallel.tp=1 with model.msa.cuda_graph_scope=attention, the default "
                                      f"(got {p.tp}: the block's projections communicate across tensor-parallel "
                                      "ranks; model.msa.cuda_graph_scope=core graphs the sparse core alone)"))
    for bad, need in unsupported:
        _check(errors, not bad, f"model.msa.cuda_graph=true needs {need}")


def _check_m3_options(errors: list[str], m) -> None:
    """The per-layer, activation, router, RoPE and norm options (MiniMax-M3 and alike)."""
    _check(errors, m.rotary_dim is None or (0 < m.rotary_dim <= m.head_dim and m.rotary_dim % 2 == 0),
           f"model.rotary_dim ({m.rotary_dim}) must be even and in (0, model.head_dim={m.head_dim}]")
    _check(errors, m.activation in ("swiglu", "quick_geglu"),
           f"model.activation must be swiglu or quick_geglu, got {m.activation!r}")
    _check(errors, m.activation_clamp is None or m.activation_clamp > 0,
           f"model.activation_clamp must be positive (or null), got {m.activation_clamp}")
    _check(errors, m.activation == "quick_geglu" or m.glu_alpha == 1.702,
           f"model.glu_alpha ({m.glu_alpha}) is used by activation=quick_geglu only")
    _check(errors, m.moe_router_score_function in ("softmax", "sigmoid"),
           f"model.moe_router_score_function must be softmax or sigmoid, got {m.moe_router_score_function!r}")
    _check(errors, not m.moe_router_expert_bias or m.moe_router_score_function == "sigmoid",
           "model.moe_router_expert_bias needs model.moe_router_score_function=sigmoid")
    _check(errors, not m.moe_router_pre_softmax or m.moe_router_score_function == "softmax",
           "model.moe_router_pre_softmax applies to moe_router_score_function=softmax only")
    _check(errors, m.moe_router_topk_scaling_factor is None or m.moe_router_topk_scaling_factor > 0,
           f"model.moe_router_topk_scaling_factor must be positive (or null), got {m.moe_router_topk_scaling_factor}")
    for name, types, allowed in (("model.attention_types", m.attention_types, ("msa", "full")),
                                 ("model.mlp_types", m.mlp_types, ("dense", "moe"))):
        if not types:
            continue
        _check(errors, len(types) == m.num_layers,
               f"{name} lists {len(types)} layers, model.num_layers is {m.num_layers}")
        bad = sorted({str(t) for t in types} - set(allowed))
        _check(errors, not bad, f"{name}: unknown value(s) {bad} (use {' or '.join(allowed)})")
    _check(errors, m.num_experts > 0 or "moe" not in m.mlp_types,
           "model.mlp_types names moe layers but model.num_experts is 0")


def _check_data(errors: list[str], d, t, logging_cfg, dry_run: bool = False) -> None:
    """The data keys and the validation schedule (the files themselves: data.prepared.check_blends)."""
    from data.prepared import parse_blend, split_shares

    # a dry run shows a full-scale recipe as it stands; a run needs the user's datasets
    _check(errors, dry_run or bool(d.blend) or d.source is not None,
           "no training data: set data.blend=[[weight,prefix],...] (datasets made by `python -m data.prepare`, "
           "docs/data.md), or data.source=DIR (a directory of text files)")
    shares = split_shares(d.split)
    _check(errors, shares is not None, f"data.split must be three finite non-negative numbers [train, validation, test] "
           f"with a positive train share (e.g. [98,2,0]), got {list(d.split)}")
    _check(errors, d.tokenizer_mismatch in ("refuse", "allow"),
           f"data.tokenizer_mismatch must be refuse or allow, got {d.tokenizer_mismatch!r}")
    for key in ("blend", "valid_blend"):
        errors += parse_blend(getattr(d, key), f"data.{key}")[2]
    bad = [t for t in d.retrieval_tasks if t not in RETRIEVAL_TASKS]
    _check(errors, not bad, f"data.retrieval_tasks: unknown {bad} (known: {', '.join(RETRIEVAL_TASKS)})")
    _check(errors, bool(d.retrieval_tasks) or d.retrieval_share == 0,
           "data.retrieval_tasks is empty but data.retrieval_share is not 0: name the tasks to mix (e.g. [kvrecall])")
    _check(errors, not (d.blend and d.retrieval_share > 0),
           "data.retrieval_share mixes synthetic documents into the file-directory corpus only; with data.blend, "
           "prepare them as a dataset of their own and blend it")
    # RoPE scores depend on relative positions only, so within a document restarted positions change
    # nothing; across documents (no document mask) the rotary table would need per-token positions
    _check(errors, not d.reset_position_ids or d.document_mask,
           "data.reset_position_ids needs data.document_mask=true: with rotary embeddings a masked document "
           "already scores as if its positions started at 0; positions restarted without the mask are not supported")
    _check(errors, t.indexer_dense_interval == 0 or t.indexer_dense_interval >= 2,
           f"trainer.indexer_dense_interval must be 0 (off) or >= 2 (1 would make every step dense), got "
           f"{t.indexer_dense_interval}")
    _check(errors, t.eval_interval >= 0, f"trainer.eval_interval must be >= 0, got {t.eval_interval}")
    # the mirror of the check below: validation datasets that no evaluation would read
    _check(errors, not d.valid_blend or t.eval_interval != 0,
           "data.valid_blend names validation datasets but trainer.eval_interval is 0 (off), so no validation "
           f"loss would be computed: set trainer.eval_interval=N (a multiple of logging.log_interval, "
           f"{logging_cfg.log_interval}), or leave data.valid_blend unset")
    if t.eval_interval > 0:
        _check(errors, t.eval_interval % logging_cfg.log_interval == 0,
               f"trainer.eval_interval ({t.eval_interval}) must be a multiple of logging.log_interval "
               f"({logging_cfg.log_interval}): e.g. trainer.eval_interval="
               f"{max(1, round(t.eval_interval / logging_cfg.log_interval)) * logging_cfg.log_interval}, "
               f"or logging.log_interval={math.gcd(t.eval_interval, logging_cfg.log_interval)}")
        _check(errors, t.eval_iters > 0, f"trainer.eval_iters must be positive, got {t.eval_iters}")
        _check(errors, bool(d.valid_blend) or shares is None or shares[1] > 0 or bool(t.probe_tasks),
               f"trainer.eval_interval={t.eval_interval} needs validation data: a data.split with a validation "
               f"share (e.g. [98,2,0]; now {list(d.split)}) or data.valid_blend (or trainer.probe_tasks alone)")
    bad = [x for x in t.probe_tasks if x not in RETRIEVAL_TASKS]
    _check(errors, not bad, f"trainer.probe_tasks: unknown {bad} (known: {', '.join(RETRIEVAL_TASKS)})")
    if t.probe_tasks:
        _check(errors, t.eval_interval > 0,
               "trainer.probe_tasks runs at every evaluation: set trainer.eval_interval (e.g. 50)")
        _check(errors, t.probe_samples > 0, f"trainer.probe_samples must be positive, got {t.probe_samples}")
        _check(errors, d.source is not None,
               "trainer.probe_tasks cuts its haystacks from a file-directory corpus: set data.source=DIR "
               "(data.blend's prepared tokens hold no text)")


def _check_launch(errors: list[str], launch) -> None:
    for name in ("nodes", "ranks_per_node", "time_min"):
        value = getattr(launch, name)
        _check(errors, value > 0, f"launch.{name} must be positive, got {value}")
    _check(errors, launch.mode in ("torchrun", "srun"), f"launch.mode must be torchrun or srun, got {launch.mode!r}")
    _check(errors, launch.gpu_memory_gib is None or launch.gpu_memory_gib > 0,
           f"launch.gpu_memory_gib must be positive (or null), got {launch.gpu_memory_gib}")
    # the warning must come after the job starts, and leave it time to save
    _check(errors, 0 <= launch.signal_seconds < launch.time_min * 60,
           f"launch.signal_seconds ({launch.signal_seconds}) must be in [0, launch.time_min * 60 = "
           f"{launch.time_min * 60}): the stop warning comes that long before the time limit")


def missing_init_from(cfg) -> Optional[str]:
    """The line for a recipe that continues a checkpoint (`requires_init_from`) without
    init_from=, else None: an error for a run, a warning for its dry run (which shows the recipe)."""
    if not cfg.requires_init_from or cfg.init_from:
        return None
    return (f"recipe {cfg.name} continues a dense checkpoint: set init_from=PATH (an MSA checkpoint made by "
            "`python -m msa_model.convert dense-to-msa` or `hf-to-msa`)")


def setting_warnings(cfg) -> list[str]:
    """Settings that do nothing in this configuration, or cost more than they were measured to give,
    one line each: warnings, not errors (a study's `--override` applies to its dense arm too, and a
    larger GPU may hold what a smaller one did not)."""
    lines = []
    m = cfg.model
    if cfg.logging.msa_diagnostics_interval and not any(msa_layers_of(m)):
        lines.append(f"logging.msa_diagnostics_interval={cfg.logging.msa_diagnostics_interval} logs nothing: the "
                     "model has no MSA layer (model.attention / model.attention_types)")
    if m.msa.cuda_graph and any(msa_layers_of(m)) and m.seq_length > GRAPH_MEASURED_LENGTH:
        lines.append(f"model.msa.cuda_graph=true at model.seq_length={m.seq_length}: each MSA layer's graph keeps "
                     "its own memory pool, as large as the layer's transient memory (the sparse core's partial "
                     "buffers alone up to model.msa.tuning.sparse_attention.partial_bytes), held between steps; "
                     "msa_109b_proxy at 32K ran out of memory on an 80 GB GPU with the graphs (53.7 GiB without "
                     f"them). They were measured to pay at {GRAPH_MEASURED_LENGTH} tokens, where the step waits on "
                     "the host (bench/RESULTS.md)")
    return lines


def check_config(cfg, world_size: Optional[int] = None, gpu: Optional[bool] = None) -> None:
    """`msa_model.config.validate`: raise ConfigError listing every problem found."""
    errors: list[str] = []
    m, msa, p, o, t = cfg.model, cfg.model.msa, cfg.parallel, cfg.optim, cfg.trainer
    # sizes first: the divisibility checks below would divide by them
    for name, value in (("model.num_layers", m.num_layers), ("model.hidden_size", m.hidden_size),
                        ("model.num_attention_heads", m.num_attention_heads),
                        ("model.num_query_groups", m.num_query_groups), ("model.head_dim", m.head_dim),
                        ("model.seq_length", m.seq_length), ("model.msa.block_size", msa.block_size),
                        ("model.msa.topk", msa.topk), ("model.msa.index_head_dim", msa.index_head_dim),
                        ("parallel.tp", p.tp), ("parallel.pp", p.pp), ("parallel.ep", p.ep), ("parallel.cp", p.cp),
                        ("parallel.micro_batch_size", p.micro_batch_size),
                        ("parallel.global_batch_size", p.global_batch_size),
                        ("logging.log_interval", cfg.logging.log_interval),
                        ("model.ffn_hidden_size", m.ffn_hidden_size), ("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size),
                        ("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
                        ("model.norm_eps", m.norm_eps), ("model.rotary_base", m.rotary_base),
                        ("optim.lr", o.lr), ("optim.eps", o.eps), ("data.max_bytes", cfg.data.max_bytes),
                        ("data.cache_wait_s", cfg.data.cache_wait_s)):
        _check(errors, value > 0, f"{name} must be positive, got {value}")
    for name, value in (("model.num_experts", m.num_experts), ("model.moe_shared_expert_size", m.moe_shared_expert_size),
                        ("model.moe_aux_loss_coeff", m.moe_aux_loss_coeff), ("model.msa.kl_coeff", msa.kl_coeff),
                        ("trainer.indexer_warmup_tokens", t.indexer_warmup_tokens),
                        ("optim.min_lr", o.min_lr), ("optim.warmup_steps", o.warmup_steps),
                        ("optim.schedule_start_step", o.schedule_start_step),
                        ("optim.weight_decay", o.weight_decay), ("optim.clip_grad", o.clip_grad),
                        ("checkpoint.interval", cfg.checkpoint.interval), ("checkpoint.keep", cfg.checkpoint.keep)):
        _check(errors, value >= 0, f"{name} must be >= 0, got {value}")
    _check(errors, m.vocab_size is None or m.vocab_size > 0, f"model.vocab_size must be positive, got {m.vocab_size}")
    _check(errors, o.decay_steps is None or o.decay_steps > 0, f"optim.decay_steps must be positive, got {o.decay_steps}")
    for name, value in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        _check(errors, 0 <= value < 1, f"{name} must be in [0, 1), got {value}")
    _check(errors, t.stop_at_step is None or 0 < t.stop_at_step < t.max_steps,
           f"trainer.stop_at_step ({t.stop_at_step}) must be in (0, trainer.max_steps={t.max_steps})")
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))
    _check(errors, m.attention in ("msa", "dense"), f"model.attention must be msa or dense, got {m.attention!r}")
    _check(errors, m.num_attention_heads % m.num_query_groups == 0,
           f"model.num_attention_heads ({m.num_attention_heads}) must be a multiple of "
           f"model.num_query_groups ({m.num_query_groups})")
    _check(errors, m.params_dtype in ("fp32", "bf16"), f"model.params_dtype must be fp32 or bf16, got {m.params_dtype!r}")
    _check(errors, m.recompute in ("none", "selective", "full"),
           f"model.recompute must be none, selective or full, got {m.recompute!r}")
    _check(errors, m.moe_token_dispatcher in ("alltoall", "allgather"),
           f"model.moe_token_dispatcher must be alltoall or allgather, got {m.moe_token_dispatcher!r}")
    _check(errors, 0 <= m.first_dense_layers <= m.num_layers,
           f"model.first_dense_layers ({m.first_dense_layers}) must be in [0, model.num_layers={m.num_layers}]")
    if m.num_experts > 0:
        _check(errors, 1 <= m.moe_router_topk <= m.num_experts,
               f"model.moe_router_topk ({m.moe_router_topk}) must be in [1, model.num_experts={m.num_experts}]")
        _check(errors, m.num_experts % p.ep == 0,
               f"model.num_experts ({m.num_experts}) must be a multiple of parallel.ep ({p.ep})")
    else:
        _check(errors, p.ep == 1, "parallel.ep > 1 needs model.num_experts > 0")
    _check_kernel_shapes(errors, cfg, gpu)
    _check_cuda_graph(errors, cfg, gpu)
    _check(errors, m.rope_scaling.type in ("none", "linear", "llama3"),
           f"model.rope_scaling.type must be none, linear or llama3, got {m.rope_scaling.type!r}")
    _check(errors, m.rope_scaling.factor > 0, f"model.rope_scaling.factor must be positive, got {m.rope_scaling.factor}")
    _check_m3_options(errors, m)
    errors += tuning_problems(tuning_overrides(msa.tuning), "model.msa.tuning")
    if m.attention == "msa":
        # the index branch reuses the main rotary table when Di == D or rotary_dim is set; a table
        # of its own (Di != D, rotary_dim unset) is unscaled
        _check(errors, m.rope_scaling.type == "none" or msa.index_head_dim == m.head_dim or m.rotary_dim is not None,
               f"model.rope_scaling ({m.rope_scaling.type}) needs model.msa.index_head_dim == model.head_dim "
               f"({msa.index_head_dim} != {m.head_dim})")
        _check(errors, 1 <= msa.local_blocks <= msa.topk,
               f"model.msa.local_blocks ({msa.local_blocks}) must be in [1, model.msa.topk={msa.topk}]")
        _check(errors, msa.index_precision in INDEX_PRECISIONS,
               f"model.msa.index_precision must be input or fp8, got {msa.index_precision!r}")
        _check(errors, msa.kl_teacher in KL_TEACHERS,
               f"model.msa.kl_teacher must be forward or backward, got {msa.kl_teacher!r}")
        _check(errors, math.isfinite(msa.kl_temperature) and msa.kl_temperature > 0,
               f"model.msa.kl_temperature must be a finite positive number, got {msa.kl_temperature}")
        # with rotary_dim set the index q/k rotate their first rotary_dim channels with the main table
        _check(errors, m.rotary_dim is None or m.rotary_dim <= msa.index_head_dim,
               f"model.rotary_dim ({m.rotary_dim}) must be <= model.msa.index_head_dim ({msa.index_head_dim}): "
               "the index branch rotates the same channels as the main heads")
        _check(errors, msa.block_size > 0 and msa.topk > 0, "model.msa.block_size and model.msa.topk must be positive")
        # a sparse phase whose top-k covers the whole context is dense attention in disguise
        sparse_steps_exist = t.indexer_warmup_tokens < t.max_steps * p.global_batch_size * m.seq_length
        keys = keys_per_query(msa.block_size, msa.topk)
        _check(errors, not sparse_steps_exist or keys < m.seq_length,
               f"model.msa.topk * model.msa.block_size ({msa.topk} * {msa.block_size} = "
               f"{keys}) must be < model.seq_length ({m.seq_length}) "
               "for the sparse phase to select anything; "
               + fitting_geometry_hint(m.seq_length, msa.block_size, msa.topk, msa.local_blocks))
        run_tokens = t.max_steps * p.global_batch_size * m.seq_length
        # the fix a shortened run needs, in whole steps
        half_run = t.max_steps // 2 * p.global_batch_size * m.seq_length
        # a one-step run has no half to warm up in: sparse from its first step
        fix = (f"trainer.indexer_warmup_tokens={half_run} warms up for half the run" if half_run else
               "trainer.indexer_warmup_tokens=0 runs top-k from the first step")
        _check(errors, t.indexer_warmup_tokens < run_tokens,
               f"trainer.indexer_warmup_tokens ({t.indexer_warmup_tokens:,}) must be < the run's tokens "
               f"(trainer.max_steps * parallel.global_batch_size * model.seq_length = {run_tokens:,}); "
               f"otherwise top-k selection never switches on; {fix} (use recipe=dense for a dense run)")
        _check(errors, m.seq_length % msa.block_size == 0,
               f"model.seq_length ({m.seq_length}) must be a multiple of model.msa.block_size ({msa.block_size})")
    # whole GQA groups per tensor-parallel rank, so no group's indexer KL spans ranks
    _check(errors, m.attention != "msa" or m.num_query_groups % p.tp == 0,
           f"model.attention=msa needs whole GQA groups on each tensor-parallel rank: parallel.tp ({p.tp}) must "
           f"divide model.num_query_groups ({m.num_query_groups}) (so tp <= num_query_groups)")
    _check(errors, m.num_query_groups % p.tp == 0 or p.tp % m.num_query_groups == 0,
           f"model.num_query_groups ({m.num_query_groups}) and parallel.tp ({p.tp}) must divide one another")
    # megatron splits the query heads over TP (its own check, a traceback once the run has started)
    _check(errors, m.num_attention_heads % p.tp == 0,
           f"model.num_attention_heads ({m.num_attention_heads}) must be a multiple of parallel.tp ({p.tp})")
    _check(errors, m.num_layers % p.pp == 0, f"model.num_layers ({m.num_layers}) must be a multiple of parallel.pp ({p.pp})")
    if p.ep > 1 and p.pp > 1 and m.num_layers % p.pp == 0:
        # with EP the experts have an optimizer of their own; on a stage without experts it holds no
        # parameter, and megatron's distributed optimizer (torch's Adam) cannot save its state
        per_stage, moe = m.num_layers // p.pp, moe_layers(m)
        empty = [s for s in range(p.pp) if not any(moe[s * per_stage:(s + 1) * per_stage])]
        first = empty[0] if empty else 0
        _check(errors, not empty or len(empty) == p.pp,
               f"parallel.ep ({p.ep}) with parallel.pp ({p.pp}): pipeline stage {first} (layers "
               f"{first * per_stage}-{(first + 1) * per_stage - 1}) holds no MoE layer, and the distributed "
               "optimizer cannot checkpoint the experts' optimizer on a stage without experts; choose parallel.pp "
               "so that every stage holds MoE layers (model.first_dense_layers, model.mlp_types), or parallel.ep=1")
    _check(errors, m.seq_length % (2 * p.cp) == 0 or p.cp == 1,
           f"model.seq_length ({m.seq_length}) must be a multiple of 2 * parallel.cp ({2 * p.cp})")
    _check(errors, not (p.tp > 1 and m.num_experts > 0) or p.sequence_parallel,
           "parallel.sequence_parallel must be true when parallel.tp > 1 with MoE layers")
    _check(errors, p.global_batch_size % p.micro_batch_size == 0,
           f"parallel.global_batch_size ({p.global_batch_size}) must be a multiple of "
           f"parallel.micro_batch_size ({p.micro_batch_size})")
    _check(errors, p.timeout_minutes > 0, f"parallel.timeout_minutes must be positive, got {p.timeout_minutes}")
    _check(errors, o.min_lr <= o.lr, f"optim.min_lr ({o.min_lr}) must be <= optim.lr ({o.lr})")
    _check(errors, o.decay_style in ("cosine", "linear", "constant"),
           f"optim.decay_style must be cosine, linear or constant, got {o.decay_style!r}")
    _check(errors, o.warmup_steps < (o.decay_steps or t.max_steps),
           f"optim.warmup_steps ({o.warmup_steps}) must be < optim.decay_steps or trainer.max_steps "
           f"({o.decay_steps or t.max_steps}): e.g. optim.warmup_steps={max(0, (o.decay_steps or t.max_steps) // 10)}")
    _check(errors, t.max_steps > 0, f"trainer.max_steps must be positive, got {t.max_steps}")
    _check(errors, t.device in ("auto", "cpu", "cuda"), f"trainer.device must be auto, cpu or cuda, got {t.device!r}")
    missing = missing_init_from(cfg)
    _check(errors, missing is None or cfg.dry_run, missing or "")
    _check(errors, not cfg.init_from_data_position or bool(cfg.init_from),
           "init_from_data_position=true needs init_from=PATH (the checkpoint whose data position it continues)")
    _check(errors, cfg.resume in ("auto", "fallback", "never"),
           f"resume must be auto, fallback or never, got {cfg.resume!r}")
    for field_name, names in (("trainer.stop_signals", t.stop_signals),
                              ("launch.requeue_signals", cfg.launch.requeue_signals)):
        bad = [n for n in names if not isinstance(getattr(signal, str(n), None), signal.Signals)]
        _check(errors, not bad, f"{field_name}: unknown signal name(s) {bad} (use names like SIGUSR1, SIGTERM)")
    _check(errors, 0.0 <= cfg.data.retrieval_share < 1.0,
           f"data.retrieval_share must be in [0, 1), got {cfg.data.retrieval_share}")
    _check_data(errors, cfg.data, t, cfg.logging, cfg.dry_run)
    _check(errors, 0 <= cfg.data.retrieval_min_length <= m.seq_length,
           f"data.retrieval_min_length must be 0 (the default lengths) or at most model.seq_length "
           f"({m.seq_length}), got {cfg.data.retrieval_min_length}")
    # found at the first evaluation otherwise, after the run has trained
    _check(errors, not t.probe_tasks or m.seq_length >= RETRIEVAL_MIN_LENGTH,
           f"trainer.probe_tasks needs model.seq_length >= {RETRIEVAL_MIN_LENGTH} (the shortest retrieval example "
           f"of every task, as python -m msa_model.eval --lengths), got {m.seq_length}")
    _check(errors, o.index_clip_grad is None or o.index_clip_grad > 0,
           f"optim.index_clip_grad must be positive or null, got {o.index_clip_grad}")
    _check(errors, o.index_clip_grad is None or m.attention == "msa",
           "optim.index_clip_grad needs model.attention=msa (a dense model has no index branch)")
    diag = cfg.logging.msa_diagnostics_interval
    _check(errors, diag >= 0 and (diag == 0 or diag % cfg.logging.log_interval == 0),
           f"logging.msa_diagnostics_interval ({diag}) must be 0 (off) or a multiple of "
           f"logging.log_interval ({cfg.logging.log_interval})")
    _check(errors, cfg.logging.wandb_mode in ("offline", "online", "disabled"),
           f"logging.wandb_mode must be offline, online or disabled, got {cfg.logging.wandb_mode!r}")
    _check_launch(errors, cfg.launch)
    # a world of no ranks (launch.nodes=0) is reported by _check_launch; nothing divides it
    if world_size is not None and world_size > 0:
        model_parallel = p.tp * p.pp * p.cp
        _check(errors, world_size % model_parallel == 0,
               f"world size {world_size} must be a multiple of parallel.tp * parallel.pp * parallel.cp ({model_parallel})")
        if world_size % model_parallel == 0:
            dp = world_size // model_parallel
            _check(errors, p.global_batch_size % (p.micro_batch_size * dp) == 0,
                   f"parallel.global_batch_size ({p.global_batch_size}) must be a multiple of "
                   f"parallel.micro_batch_size * dp ({p.micro_batch_size} * {dp})")
            # experts are split over the data- and context-parallel ranks (expert TP = TP)
            _check(errors, (dp * p.cp) % p.ep == 0,
                   f"parallel.ep ({p.ep}) must divide dp * cp ({dp} * {p.cp})")
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))
