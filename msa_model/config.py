"""Typed configuration schemas. The YAML files under configs/ only compose these.

Every section is a dataclass registered with Hydra's ConfigStore as the `train_schema` node, so
the composed config is in struct mode: a misspelled key in YAML or on the command line is an
error, and values are type-checked. `validate` checks what types cannot (divisibility, geometry)
and names the offending fields.
"""

from __future__ import annotations

import dataclasses
import typing

from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.retrieval import DEFAULT_TASKS as DEFAULT_RETRIEVAL_TASKS
# the ops own their geometry: PRODUCTION_* (MiniMax's block size and top-k, the ops' defaults; the
# conversions take them from here)
from msa_model.ops.common import PRODUCTION_BLOCK_SIZE, PRODUCTION_TOPK, keys_per_query  # noqa: F401
from msa_model.ops.tuning import OPS as TUNED_OPS


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the fields involved."""


_PROBLEMS = "invalid configuration:\n  - "


def config_problems(error: ConfigError) -> list[str]:
    """The problem lines of a ConfigError raised by `validate`."""
    text = str(error)
    return text[len(_PROBLEMS):].split("\n  - ") if text.startswith(_PROBLEMS) else [text]



# what a layer's CUDA graph holds (model.msa.cuda_graph_scope)
GRAPH_SCOPES = ("attention", "core")

# (block size, top-k) from the production geometry down, tried in this order by sparse_geometry:
# fewer blocks first (down to 8), then smaller blocks (down to 16 tokens, the Triton kernels' least),
# then fewer again
_GEOMETRIES = ((128, 16), (128, 8), (64, 8), (32, 8), (16, 8), (16, 4), (16, 2))
# the share of a context the sparse phase reads at most: the production 2048 keys of 8K or more
SPARSE_SHARE = 4


def sparse_geometry(seq_length: int, block_size: Optional[int] = None, topk: Optional[int] = None,
                    local_blocks: int = 1) -> Optional[tuple[int, int]]:
    """(block_size, topk) whose keys per query, topk * block_size, are at most a quarter of
    `seq_length` (SPARSE_SHARE) with blocks that divide it and more than `local_blocks` of them:
    the production 128 x 16 from 8K tokens on, fewer and smaller blocks below. A given
    `block_size` or `topk` is kept. None: nothing fits."""
    for b, k in _GEOMETRIES:
        if block_size is not None and topk is None:
            # the largest top-k for the given block
            b, k = block_size, max(1, min(PRODUCTION_TOPK, seq_length // SPARSE_SHARE // block_size))
        elif topk is not None and block_size is None:
            k = topk
        elif block_size is not None and topk is not None:
            b, k = block_size, topk
        # at least one block chosen beyond the forced local ones
        if k > local_blocks and keys_per_query(b, k) * SPARSE_SHARE <= seq_length and seq_length % b == 0:
            return b, k
    return None


def fitting_geometry_hint(seq_length: int, block_size: int, topk: int, local_blocks: int = 1) -> str:
    """Overrides that make a sparse phase select something at this context, for error messages."""
    options = []
    keep_block = sparse_geometry(seq_length, block_size=block_size, local_blocks=local_blocks)
    if keep_block is not None:
        options.append(f"model.msa.topk={keep_block[1]}")
    other = sparse_geometry(seq_length, local_blocks=local_blocks)
    if other is not None and other != keep_block:
        options.append(f"model.msa.block_size={other[0]} model.msa.topk={other[1]}")
    keys = keys_per_query(block_size, topk)
    options.append(f"model.seq_length={SPARSE_SHARE * keys} (anything above {keys} that is a multiple of "
                   f"{block_size} runs)")
    return "overrides that fit: " + "; ".join(options)


def _tuning_section(name: str, op: str) -> type:
    """The schema of one op's kernel settings: every field of its `Tuning`, each None (unset: the
    op's default). Typed, so `model.msa.tuning.<op>.<field>=value` needs no `+`."""
    tuning = TUNED_OPS[op].Tuning
    hints = typing.get_type_hints(tuning)
    fields = [(f.name, Optional[List[int] if hints[f.name] is tuple else hints[f.name]], None)
              for f in dataclasses.fields(tuning)]
    section = dataclasses.make_dataclass(name, fields)
    section.__module__ = __name__  # pickled by name, as the other sections
    return section


SparseAttentionTuning = _tuning_section("SparseAttentionTuning", "sparse_attention")
SelectBlocksTuning = _tuning_section("SelectBlocksTuning", "select_blocks")
IndexerKLTuning = _tuning_section("IndexerKLTuning", "indexer_kl")


@dataclass
class KernelTuningConfig:
    """model.msa.tuning: the MSA ops' Triton launch settings, a field per setting of each op's
    `Tuning` (msa_model/ops/<op>/tuning.py); unset (null) fields keep the op's defaults, and set
    ones apply over its GPU defaults (`msa_model.ops.tuning.kernel_tuning`). See docs/msa.md."""

    sparse_attention: SparseAttentionTuning = field(default_factory=SparseAttentionTuning)
    select_blocks: SelectBlocksTuning = field(default_factory=SelectBlocksTuning)
    indexer_kl: IndexerKLTuning = field(default_factory=IndexerKLTuning)


def tuning_overrides(tuning) -> dict:
    """model.msa.tuning (a KernelTuningConfig, a DictConfig of one, or a plain dict) as
    {op: {field: value}}, the form `msa_model.ops.tuning.kernel_tuning` takes."""
    if dataclasses.is_dataclass(tuning):
        return dataclasses.asdict(tuning)
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(tuning) if isinstance(tuning, DictConfig) else dict(tuning or {})


@dataclass
class MSAConfig:
    """Geometry of MiniMax Sparse Attention (see docs/msa.md). The defaults are the `tiny` CPU
    model's; configs/model/*.yaml set each preset's, PRODUCTION_* above is MiniMax's."""

    block_size: int = 32  # Bk: tokens per key block
    topk: int = 4  # k: blocks read per (query, group); topk * block_size keys per query
    index_head_dim: int = 32  # Di
    kl_coeff: float = 1.0  # weight of the indexer KL in the total loss
    force_sink: bool = False  # always select the first block
    # blocks ending with the query's own that are always selected (MiniMax-M3 index_local_blocks)
    local_blocks: int = 1
    # products of the block selection's scores, one of INDEX_PRECISIONS: input (the index q/k
    # dtype) | fp8 (e4m3 on the fp8 tensor cores, sm89+: about 1.6x faster scoring, near-tied
    # blocks may swap; docs/msa.md)
    index_precision: str = "input"
    # where the KL's teacher (the main branch's head-mean probabilities) is computed, one of
    # KL_TEACHERS: backward (from the attention's backward, which recomputes them anyway; the
    # Triton sparse path in training, elsewhere it falls back to forward) | forward (by the KL's
    # own kernels). Same loss and gradients; backward saves the teacher's q.k (docs/msa.md)
    kl_teacher: str = "backward"
    # the KL's student is softmax(index scores / sqrt(Di) / kl_temperature) (MiniMax's
    # lse_temperature): it rescales the index distribution the KL trains, never the top-k ranking
    kl_temperature: float = 1.0
    # the sparse attention's probabilities rounded to float8 e4m3 (of P x 448, P relative to each
    # key block's max) in the forward, gradients straight through: quantization-aware training for
    # a model served with fp8 attention (MiniMax-M3). The warmup's dense attention is unaffected
    fp8_probs: bool = False
    backend: str = "auto"  # msa_model.ops backend: auto | reference | triton
    # replay each MSA layer's sparse-phase core (selection, attention, KL: forward and backward) as a
    # CUDA graph captured at its first training step: one launch where the eager core issues dozens,
    # for layers bound by issuing work (short context, few heads a group). GPU only, and only where
    # a replay runs the work of its capture: no context parallelism, pipeline parallelism or
    # recompute; packed documents get a graph per size of their block table (docs/msa.md, "CUDA graphs")
    cuda_graph: bool = False
    # what each graph holds: attention (the whole attention block: q/k/v and index projections,
    # their norms and RoPE, the core and the output projection, with their weights' gradients;
    # needs parallel.tp=1, no communication in a graph) | core (selection, attention, KL)
    cuda_graph_scope: str = "attention"
    # the Triton kernels' launch settings, per op and field (KernelTuningConfig); unset: defaults
    tuning: KernelTuningConfig = field(default_factory=KernelTuningConfig)


@dataclass
class RopeScalingConfig:
    """RoPE frequency scaling, as in Hugging Face `rope_parameters` (for converted models)."""

    type: str = "none"  # none | linear (positions divided by factor) | llama3 (Llama 3.x per-band)
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass
class ModelConfig:
    name: str = "tiny"
    attention: str = "msa"  # msa | dense (full-attention GQA baseline, no index branch)
    num_layers: int = 4
    hidden_size: int = 256
    ffn_hidden_size: int = 512  # dense (non-MoE) layers
    num_attention_heads: int = 4  # Hq
    num_query_groups: int = 2  # Hkv
    head_dim: int = 32  # D
    qk_layernorm: bool = True
    seq_length: int = 512
    rotary_base: float = 10000.0
    # channels of each head that RoPE rotates (the first ones; < head_dim is partial RoPE). When set,
    # the index q/k rotate their first rotary_dim channels with the same table (MiniMax-M3); None:
    # every head channel, and an index branch with Di != D gets a table of its own
    rotary_dim: Optional[int] = None
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    qkv_bias: bool = False  # bias on the q/k/v projections (Qwen2); no other linear has one
    norm_eps: float = 1e-5  # epsilon of every RMSNorm (layer, QK and final norms)
    # every RMSNorm scales by (1 + w) with w stored and initialised at 0 (Gemma, MiniMax-M3)
    norm_zero_centered: bool = False
    # MLP: swiglu = silu(gate) * up; quick_geglu = gate * sigmoid(glu_alpha * gate) * (up + glu_linear_offset),
    # with gate <= activation_clamp and |up| <= activation_clamp when the clamp is set (MiniMax-M3)
    activation: str = "swiglu"
    glu_alpha: float = 1.702
    glu_linear_offset: float = 0.0
    activation_clamp: Optional[float] = None
    num_experts: int = 4
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 256
    moe_shared_expert_size: int = 0  # width of an always-active shared expert in each MoE layer; 0: none
    first_dense_layers: int = 1  # leading layers with a dense MLP instead of experts
    moe_aux_loss_coeff: float = 1e-2
    moe_token_dispatcher: str = "alltoall"  # alltoall | allgather
    # true: softmax over all experts, keep the top-k probabilities as they are (Qwen3-MoE with
    # norm_topk_prob=false); false: softmax over the top-k logits (Mixtral, norm_topk_prob=true)
    moe_router_pre_softmax: bool = False
    moe_router_score_function: str = "softmax"  # softmax | sigmoid (top-k probabilities renormalised)
    # a per-expert bias added to the scores for choosing experts only, moved toward balanced load
    # after every step by moe_router_bias_update_rate (aux-loss-free balancing; sigmoid only)
    moe_router_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_topk_scaling_factor: Optional[float] = None  # routed experts' weights x this (M3 routed_scaling_factor)
    # per layer "msa" or "full" (full attention, no index branch) when attention=msa; []: every
    # layer MSA. attention=dense makes every layer full whatever this says (the dense baseline)
    attention_types: List[str] = field(default_factory=list)
    # per layer "dense" or "moe"; []: first_dense_layers dense layers, then MoE (when num_experts > 0)
    mlp_types: List[str] = field(default_factory=list)
    init_method_std: float = 0.02
    tie_embeddings: bool = False
    # embedding rows before padding; None: the tokenizer's vocabulary. Set by checkpoint
    # conversion to the source model's vocabulary (must be >= the tokenizer's)
    vocab_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 64
    params_dtype: str = "fp32"  # fp32 | bf16
    # activation recomputation: none | selective (the attention core: MSA selection, sparse
    # attention and KL, or the dense baseline's attention; expert activations are always
    # recomputed by the grouped experts) | full (every layer from its input, megatron's "full")
    recompute: str = "none"
    # routed experts as grouped GEMMs (msa_model/model/experts.py); None: on CUDA yes, on CPU the loop
    moe_grouped_gemm: Optional[bool] = None
    msa: MSAConfig = field(default_factory=MSAConfig)


@dataclass
class DataConfig:
    """Where the tokens come from (docs/data.md): prepared datasets (`blend`, made by
    `python -m data.prepare`) or, when no blend is given, a directory of text files tokenized into a
    cache at the first use (the embedded default: the standard library's sources)."""

    # "stdlib": the Python standard library sources shipped with the interpreter; otherwise a
    # directory whose files matching `glob` form the corpus (used when `blend` is not set); None:
    # no such corpus (the full-scale recipes: they train on data.blend)
    source: Optional[str] = "stdlib"
    glob: str = "**/*.py"
    max_bytes: int = 4_000_000  # corpus bound, files taken in sorted order
    # `byte`, or a local Hugging Face tokenizer directory. None: the tokenizer of the checkpoint the
    # run starts from (resume, then init_from) when it has one, else the one the blend's datasets
    # were prepared with when that directory still exists, else `byte`
    tokenizer: Optional[str] = None
    # the token that ends a document; None: the tokenizer's end-of-sequence token
    eod_token: Optional[str] = None
    # the file-directory corpus: put the tokenizer's beginning-of-sequence token before each
    # document (prepared datasets record their own choice: `data.prepare --add-bos`)
    add_bos: bool = False
    # prepared datasets, megatron's blend: [[weight, prefix], ...] (or plain prefixes, weight 1);
    # each prefix names PREFIX.bin / PREFIX.idx / PREFIX.json written by `python -m data.prepare`
    blend: Optional[List[Any]] = None
    # documents of every dataset split [train, validation, test] by these proportions (megatron's
    # split, as a list: data.split=[98,2,0])
    split: List[float] = field(default_factory=lambda: [99.0, 1.0, 0.0])
    # validation datasets of their own, in the blend's format; the split then serves training only
    valid_blend: Optional[List[Any]] = None
    # leave end-of-document tokens out of the loss
    eod_mask_loss: bool = False
    # accepted for parity with megatron's --reset-position-ids and has no effect: positions are
    # never restarted. It needs document_mask, under which a document's rotary scores are already
    # those of positions from 0 (RoPE scores by distance); the run's first line says so
    reset_position_ids: bool = False
    # refuse | allow: a run whose tokenizer differs from its datasets' or its checkpoint's
    tokenizer_mismatch: str = "refuse"
    # the tokenized corpus and the sample indices; MSA_DATA_CACHE_DIR moves the default (e.g. to a
    # shared scratch disk)
    cache_dir: str = "${oc.env:MSA_DATA_CACHE_DIR,.cache/data}"
    # how long a rank waits for rank 0 to prepare the data, and a job for another job that builds
    # the same cache (data/shared_build.py), before it gives up naming the builder
    cache_wait_s: float = 3600.0
    seed: int = 1234
    # packed documents are separate sequences: each token attends to (and the indexer selects
    # from) its own document only, found from end-of-document tokens. Positions are not reset:
    # RoPE scores depend on relative positions only, so a document sees the same scores at any
    # offset (docs/msa.md, "Packed documents")
    document_mask: bool = False
    # also hash every byte of the cached tokens, the prepared datasets and the sample indices
    # before use (sizes and sampled blocks are always checked)
    verify_cache: bool = False
    # share of the training tokens in synthetic retrieval documents (data/retrieval.py: passkey,
    # multi-key, variable tracking; up to model.seq_length tokens each); 0: none. File-directory
    # corpus only
    retrieval_share: float = 0.0
    # the tasks those documents draw from, uniformly; kvrecall asks for dozens of needles a document
    retrieval_tasks: List[str] = field(default_factory=lambda: list(DEFAULT_RETRIEVAL_TASKS))
    # their shortest length in tokens, drawn uniformly up to model.seq_length; 0: max(256,
    # seq_length / 8). Short documents (e.g. 128) let a small model learn retrieval over short
    # distances first
    retrieval_min_length: int = 0


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4
    # the schedule's steps (warmup_steps, decay_steps, schedule_start_step) are steps of the run's
    # first tokens a step: a resume at another batch keeps their length in tokens (resume_tokens.py)
    warmup_steps: int = 8
    decay_style: str = "cosine"  # cosine | linear | constant
    decay_steps: Optional[int] = None  # None: trainer.max_steps (the run's last step)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0
    # None: the index branch is clipped with the rest on the global norm (optim.clip_grad); a value:
    # the index branch is clipped to it on its own norm, the rest to clip_grad on theirs
    index_clip_grad: Optional[float] = None
    # the lr schedule's step at this run's start (its warmup and decay as if that many steps had
    # run): a run that continues another's schedule, e.g. CPT branched from a dense run at step s
    # with the dense run's lr, warmup_steps and decay_steps, gives s. Only a fresh run applies it
    # (a resumed one takes the step from its checkpoint)
    schedule_start_step: int = 0
    use_distributed_optimizer: bool = True


@dataclass
class ParallelConfig:
    """Parallel layout. dp is derived: world_size / (tp * pp * cp)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    micro_batch_size: int = 2
    global_batch_size: int = 8
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    # how long a rank waits for the others: to join the process group at start (a rank that failed
    # there leaves the others waiting this long), and in any one collective
    timeout_minutes: float = 10.0


@dataclass
class LoggingConfig:
    log_interval: int = 10
    progress_bar: bool = True
    # time each layer's attention and MLP block, forward and backward (msa_model/training/module_timer.py;
    # one device synchronisation per step)
    time_modules: bool = False
    tensorboard: bool = True
    jsonl: bool = True
    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_project: str = "msa-moe"
    wandb_entity: Optional[str] = None
    # every N steps: index recall, captured attention mass, per-layer KL, selection heatmaps
    # (msa_model/training/diagnostics.py) on one micro-batch; 0: off. A multiple of log_interval
    msa_diagnostics_interval: int = 0


@dataclass
class CheckpointConfig:
    interval: int = 40  # steps between saves; 0 disables periodic saves
    dir: Optional[str] = None  # None: <run_dir>/checkpoints
    keep: int = 2  # most recent checkpoints kept on disk; 0 keeps all
    save_at_end: bool = True


@dataclass
class TrainerConfig:
    max_steps: int = 80
    # stop (with a checkpoint) after this step although the schedules run to max_steps;
    # used to split one run into several jobs
    stop_at_step: Optional[int] = None
    seed: int = 1234
    # dense attention + dense KL for this many tokens, then top-k selection (MSA only)
    indexer_warmup_tokens: int = 0
    # after the warmup, one step in N (step numbers 1, N + 1, 2N + 1, ...) runs as a warmup step:
    # dense attention and the KL over every causal key, which also reaches blocks the selection
    # skipped (the sparse phase's KL covers the selected blocks only); 0: never (MiniMax's recipe)
    indexer_dense_interval: int = 0
    # init_from's index branch decides the warmup: none when it was trained (MiniMax-M3, an MSA
    # run; msa_model/training/index_history.py), indexer_warmup_tokens otherwise; a value of
    # indexer_warmup_tokens given on the command line wins (recipe cpt sets this)
    indexer_warmup_from_init: bool = False
    # on these signals: finish the step, save, exit cleanly; [] leaves signals alone. A second
    # SIGINT (Ctrl-C) aborts without saving
    stop_signals: List[str] = field(default_factory=lambda: ["SIGUSR1", "SIGTERM", "SIGINT"])
    device: str = "auto"  # auto | cpu | cuda
    # held-out loss every N steps (a multiple of logging.log_interval) and at the last step, on
    # eval_iters global batches of the validation split or data.valid_blend; 0: off
    eval_interval: int = 0
    eval_iters: int = 4
    # at every evaluation, also the synthetic retrieval tasks (data/retrieval.py: passkey, multikey,
    # vartrack, kvrecall) answered at the full model.seq_length, probe_samples examples each, the
    # haystacks cut from the run's file-directory corpus (data.source): exact match, answer loss and
    # rank as valid/probe/<task>/... (msa_model/training/retrieval_probe.py); needs eval_interval
    # but no validation split. []: off
    probe_tasks: List[str] = field(default_factory=list)
    probe_samples: int = 32
    # the same losses and weights bit for bit run to run and across stop and resume: torch's
    # deterministic algorithms, cuBLAS and NCCL settings, ordered sums instead of atomics in the
    # kernels (msa_model/training/determinism.py); slower
    deterministic: bool = False


@dataclass
class LaunchConfig:
    """Scheduler settings, read by both SLURM launchers: `python -m launch.slurm` (its options set
    these keys) and `launch=slurm`, which maps them onto Hydra's submitit launcher."""

    name: str = "local"  # local | slurm (the submitit launcher)
    nodes: int = 1
    ranks_per_node: int = 1  # training processes per node: one per GPU
    gpus_per_node: Optional[int] = None  # None or 0: CPU ranks (gloo)
    # memory of one GPU the job runs on, GiB: the dry run warns when its per-GPU estimate exceeds it.
    # None: this machine's GPU, else 80 (H100 80GB; an H200 has 141)
    gpu_memory_gib: Optional[float] = None
    cpus_per_task: Optional[int] = None
    time_min: int = 60  # SLURM time limit in minutes
    partition: Optional[str] = None
    account: Optional[str] = None
    signal_seconds: int = 300  # USR1 this long before the time limit
    job_name: str = "${model.name}-${name}"
    # how `python -m launch.slurm` starts the ranks: torchrun (one srun task per node, torchrun
    # starts the node's ranks) | srun (one srun task per rank). The submitit launcher always runs
    # one task per rank
    mode: str = "torchrun"
    # a stop on one of these signals inside a running SLURM batch job saves, then requeues the
    # job (a job SLURM itself is cancelling or requeueing is left to SLURM)
    requeue_signals: List[str] = field(default_factory=lambda: ["SIGUSR1", "SIGTERM"])


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    name: str = MISSING  # set by the recipe
    run_dir: str = "runs/${model.name}-${name}"
    # auto: continue from <run_dir>/checkpoints/latest if there is one (refused if its files differ
    # from its manifest) | fallback: like auto, but a damaged latest gives way to the newest older
    # checkpoint that verifies | never: refuse a run_dir that holds checkpoints
    resume: str = "auto"
    init_from: Optional[str] = None  # checkpoint dir: load model weights only
    # init_from a checkpoint of another shape: load the tensors whose name and shape match, keep
    # the rest freshly initialised (otherwise differing models are refused, naming the fields)
    init_from_partial: bool = False
    # continue the data stream where the init_from checkpoint's run stopped: the first step reads
    # the sample after the last one that run trained on (its consumed samples; a dense-to-msa
    # conversion carries its source's), as many tokens in where that run's model.seq_length was
    # another (resume_tokens.py). The run's own step and token counts start at 0
    init_from_data_position: bool = False
    # the recipe continues another model (CPT): refuse to start from random weights
    requires_init_from: bool = False
    dry_run: bool = False


def moe_layers(m) -> list[bool]:
    """Per layer: True where the MLP is a mixture of experts (a ModelConfig's mlp_types, or its
    first_dense_layers dense layers followed by MoE layers)."""
    if m.mlp_types:
        return [t == "moe" for t in m.mlp_types]
    return [m.num_experts > 0 and i >= m.first_dense_layers for i in range(m.num_layers)]


def msa_layers_of(m) -> list[bool]:
    """Per layer: True where the attention is MSA (index branch and top-k blocks), False for full
    attention (a ModelConfig's attention_types, or `attention` for every layer)."""
    if m.attention != "msa":
        return [False] * m.num_layers
    if m.attention_types:
        return [t == "msa" for t in m.attention_types]
    return [True] * m.num_layers


def steps_for_tokens(tokens: float, *, _root_) -> int:
    """`${steps_for_tokens:3e12}` in a recipe: the steps that train this many tokens at the run's
    own batch (parallel.global_batch_size x model.seq_length), rounded down, so a layout with
    another batch (the 128K one's 8M tokens a step) keeps the recipe's token budget. A run resumed
    at another batch than its checkpoint's counts from the tokens it trained (token_budget)."""
    step_tokens = _root_.parallel.global_batch_size * _root_.model.seq_length
    # a batch of no tokens is the batch's own error (validate names it), not a division here
    return int(tokens // step_tokens) if step_tokens > 0 else 1


def token_budget(cfg) -> Optional[int]:
    """X of `trainer.max_steps: ${steps_for_tokens:X}`, read before the config is resolved (a
    resume at another batch counts its steps from the tokens trained: resume_tokens.py); None
    where max_steps does not use the resolver. `cfg`: the whole config (max_steps may refer to
    other keys). max_steps is resolved with the resolver recording its argument: any form whose
    value is the resolver's own (through other keys, X an interpolation) gives its X; one that
    changes it or calls it twice is a ConfigError, since its steps could not be counted by tokens."""
    raw = OmegaConf.to_container(cfg.trainer, resolve=False)["max_steps"]
    # the probe's marker is no integer: the value is the resolver's own where it is the marker
    marker = "\0steps_for_tokens"
    calls, value = resolve_with_steps_for_tokens(cfg, "trainer.max_steps", lambda tokens: marker)
    if not calls:
        return None
    tokens = calls[0]
    if len(calls) > 1 or value != marker or isinstance(tokens, bool) or not isinstance(tokens, (int, float)):
        raise ConfigError(
            f"trainer.max_steps={raw} uses ${{steps_for_tokens:...}} in a form whose tokens cannot be read, so a "
            "resume at another batch would train the steps of the new batch instead of the tokens left: write "
            "${steps_for_tokens:X} itself (X a number, or an interpolation of one), an interpolation of a key "
            "that holds exactly that, or an integer number of steps")
    return int(tokens)


def resolve_with_steps_for_tokens(cfg, key: str, steps_of) -> tuple[list, object]:
    """(the X of every `${steps_for_tokens:X}` that `key` of the unresolved `cfg` uses, directly or
    through other keys; its value with the resolver giving `steps_of(X)` instead), resolved in a
    plain copy. ([], None) where it cannot resolve (resolving the config then says why)."""
    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    calls = []
    OmegaConf.register_new_resolver("steps_for_tokens", lambda tokens: calls.append(tokens) or steps_of(tokens),
                                    replace=True)
    try:
        value = OmegaConf.select(plain, key, throw_on_resolution_failure=True)
    except OmegaConfBaseException:
        return [], None
    finally:
        OmegaConf.register_new_resolver("steps_for_tokens", steps_for_tokens, replace=True)
    return calls, value


def register_configs() -> None:
    """Register the schema so `defaults: [train_schema, ...]` in configs/train.yaml finds it, and
    the resolvers the recipes use."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    OmegaConf.register_new_resolver("steps_for_tokens", steps_for_tokens, replace=True)


def validate(cfg, world_size: Optional[int] = None, gpu: Optional[bool] = None) -> None:
    """Raise ConfigError listing every problem found. `cfg` is a TrainConfig (or DictConfig).

    Without `world_size` only the checks that do not depend on the launch are made. `gpu` says
    whether the job runs on GPUs (None: this machine's trainer.device decides), which sets the
    shapes the fused kernels accept.
    """
    # the checks live in msa_model/config_checks.py (imported here: it imports this module)
    from msa_model.config_checks import check_config

    check_config(cfg, world_size, gpu)
