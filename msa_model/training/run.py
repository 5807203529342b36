"""One training run from a composed config: validate, (dry run), set up, resume, train, shut down."""

from __future__ import annotations

import warnings

# megatron warns at import time that TE/apex are absent; the local modules are what we use
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
# deprecation notices about torch.distributed names megatron still calls
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\..*")
# megatron reads .grad of non-leaf tensors while collecting params; harmless and noisy
warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")

import logging  # noqa: E402
from pathlib import Path  # noqa: E402

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from msa_model.config import validate  # noqa: E402
from msa_model.training.distributed import launch_env, parallel_layout  # noqa: E402
from msa_model.training.run_dir import setup_logging, write_run_files  # noqa: E402

log = logging.getLogger(__name__)


def _build_optimizer(cfg, model_chunks):
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o = cfg.optim
    bf16 = cfg.model.params_dtype == "bf16"
    msa = cfg.model.attention == "msa"
    if msa:
        from msa_model.training.grad_norm import tag_index_parameters

        tag_index_parameters(model_chunks)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                        adam_beta1=o.beta1, adam_beta2=o.beta2, adam_eps=o.eps, clip_grad=o.clip_grad,
                        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                        use_distributed_optimizer=o.use_distributed_optimizer),
        model_chunks,
    )
    if msa:
        from msa_model.training.grad_norm import GroupNormOptimizer

        # the index branch's gradient norm apart from the rest; optionally clipped on its own
        optimizer = GroupNormOptimizer(optimizer, o.clip_grad, o.index_clip_grad)
    max_steps = cfg.trainer.max_steps
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=o.decay_steps or max_steps, lr_decay_style=o.decay_style,
        start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=max_steps, wd_incr_style="constant",
        # on resume the config's schedule wins (a relaunch may train longer or lower the lr); only
        # the step count comes from the checkpoint
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True,
    )
    return optimizer, scheduler


def _build_model(cfg, env):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from data.tokenizer import build_tokenizer
    from msa_model.model import build_model

    model = build_model(cfg.model, cfg.parallel, build_tokenizer(cfg.data.tokenizer).vocab_size,
                        on_cpu=env.device.type == "cpu",
                        pre_process=parallel_state.is_pipeline_first_stage(),
                        post_process=parallel_state.is_pipeline_last_stage())
    model.to(env.device)
    config = model.config
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                      use_distributed_optimizer=cfg.optim.use_distributed_optimizer),
        model,
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return [ddp]


def run(cfg: DictConfig) -> None:
    OmegaConf.resolve(cfg)
    rank, world_size, _ = launch_env()
    if cfg.dry_run:
        # a dry run checks the layout it will be launched with, not this one process
        layout_world = max(world_size, cfg.launch.nodes * cfg.launch.ranks_per_node)
        validate(cfg, layout_world)
        if rank == 0:
            from msa_model.dry_run import dry_run_report

            print(dry_run_report(cfg, layout_world), flush=True)
        return
    validate(cfg, world_size)

    from data.datasets import build_train_dataset, build_train_iterator
    from msa_model.training import checkpoint as ckpt
    from msa_model.training.distributed import data_parallel_info, init_distributed, shutdown
    from msa_model.training.indexer_warmup import IndexerWarmup
    from msa_model.training.metrics import MetricsLogger
    from msa_model.training.preemption import StopSignal, requeue_slurm_job, should_requeue
    from msa_model.training.trainer import Trainer

    run_dir = Path(cfg.run_dir)
    ckpt_root = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(run_dir if rank == 0 else None, rank == 0)
    latest = ckpt.latest_checkpoint(ckpt_root)
    if cfg.resume == "never" and latest is not None:
        raise FileExistsError(f"resume=never but {ckpt_root} already holds checkpoints; choose another run_dir")

    env = init_distributed(cfg.parallel, cfg.trainer.device, cfg.trainer.seed)
    requeue = False
    try:
        if env.is_main:
            write_run_files(cfg, run_dir)
            ckpt.cleanup_partial_saves(ckpt_root)
            log.info("run dir %s | %s", run_dir, " ".join(f"{k}={v}" for k, v in parallel_layout(cfg.parallel, world_size).items()))
        model_chunks = _build_model(cfg, env)
        optimizer, scheduler = _build_optimizer(cfg, model_chunks)
        model_chunks[0].config.grad_scale_func = optimizer.scale_loss

        callbacks = []
        if cfg.model.attention == "msa":
            callbacks.append(IndexerWarmup(cfg.trainer.indexer_warmup_tokens, cfg.model.msa))
            if cfg.logging.msa_diagnostics_interval > 0:
                from msa_model.training.diagnostics import MSADiagnostics

                # before the metrics logger: it adds its values to the step's metrics
                callbacks.append(MSADiagnostics(cfg.logging.msa_diagnostics_interval, cfg.model.msa,
                                                cfg.model.num_layers, cfg.model.seq_length, run_dir, env.is_main))
        callbacks.append(ckpt.Checkpointer(ckpt_root, cfg.checkpoint.interval, cfg.checkpoint.keep, cfg.checkpoint.save_at_end))
        callbacks.append(MetricsLogger(cfg.logging, run_dir, env.is_main, cfg.trainer.max_steps,
                                       OmegaConf.to_container(cfg, resolve=True)))
        stop_signal = StopSignal(list(cfg.trainer.stop_signals)) if cfg.trainer.stop_signals else None
        trainer = Trainer(
            model_chunks=model_chunks, optimizer=optimizer, scheduler=scheduler, data_iterator=None,
            callbacks=callbacks, max_steps=cfg.trainer.max_steps, stop_at_step=cfg.trainer.stop_at_step,
            seq_length=cfg.model.seq_length, micro_batch_size=cfg.parallel.micro_batch_size,
            global_batch_size=cfg.parallel.global_batch_size, num_layers=cfg.model.num_layers,
            device=env.device, stop_signal=stop_signal,
        )
        if cfg.resume == "auto" and latest is not None:
            ckpt.load_checkpoint(trainer, latest)
        elif cfg.init_from:
            ckpt.load_model_weights(model_chunks, cfg.init_from)
            # bf16 training keeps fp32 main copies made when the optimizer was built: refresh them,
            # or the first step would put the fresh initialisation back
            optimizer.reload_model_params()
        if trainer.state.step >= cfg.trainer.max_steps:
            log.info("nothing to do: %s is already at step %d of %d (resume=auto); pass another run_dir= "
                     "to start a new run", run_dir, trainer.state.step, cfg.trainer.max_steps)
            return

        dataset = build_train_dataset(cfg.data, cfg.model.seq_length, cfg.trainer.max_steps * cfg.parallel.global_batch_size)
        dp_rank, dp_size = data_parallel_info()
        trainer.data_iterator = build_train_iterator(dataset, trainer.state.consumed_samples,
                                                     cfg.parallel.micro_batch_size, dp_rank, dp_size)
        state = trainer.train()
        log.info("finished at step %d (%s tokens); checkpoints in %s", state.step, f"{state.tokens:,}", ckpt_root)
        requeue = should_requeue(stop_signal, list(cfg.launch.requeue_signals), state.step >= cfg.trainer.max_steps)
        if stop_signal is not None:
            stop_signal.restore()
    finally:
        shutdown()
    # last: requeueing ends this job at once, so every rank must be done with the checkpoint
    if requeue and env.is_main:
        requeue_slurm_job()
