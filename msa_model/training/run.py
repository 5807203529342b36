"""One training run from a composed config: validate, (dry run), set up, resume, train, shut down."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from data.cache_check import DataCacheError
from msa_model.platform.compat import warn_untested_versions
from msa_model.config import ConfigError, config_problems, msa_layers_of, validate
from msa_model.training.checkpoint_checks import CheckpointError
from msa_model.training.distributed import ProcessGroupError, launch_env, parallel_layout
from msa_model.training.run_dir import RunDirBusy, lock_run_dir, setup_logging, write_run_files

log = logging.getLogger(__name__)

# bad input, each named in its message: train.py prints these in one line, without a traceback
INPUT_ERRORS = (ConfigError, CheckpointError, DataCacheError, RunDirBusy, ProcessGroupError)


def _retrieval_probe(cfg, tokenizer):
    """The retrieval probe of trainer.probe_tasks (None: off), its haystacks from the run's corpus files."""
    if not cfg.trainer.probe_tasks:
        return None
    from data.corpus import list_corpus_files
    from msa_model.training.data_setup import document_bos
    from msa_model.training.retrieval_probe import RetrievalProbe

    files = list_corpus_files(cfg.data.source, cfg.data.glob, cfg.data.max_bytes)[1]
    return RetrievalProbe(cfg.trainer.probe_tasks, cfg.trainer.probe_samples, files, tokenizer,
                          cfg.model.seq_length, cfg.parallel.micro_batch_size, document_bos(cfg.data, tokenizer))


def _build_optimizer(cfg, model_chunks, decay_steps=None):
    """`decay_steps`: the lr decay's length where optim.decay_steps is None (None: trainer.max_steps;
    a resume at another batch passes its own, resume_tokens.py)."""
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from msa_model.platform.compat import use_foreach_multi_tensor_ops

    use_foreach_multi_tensor_ops()
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
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=o.decay_steps or decay_steps or cfg.trainer.max_steps, lr_decay_style=o.decay_style,
        start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=cfg.trainer.max_steps, wd_incr_style="constant",
        # on resume the config's schedule wins (a relaunch may train longer or lower the lr); only
        # the step count comes from the checkpoint. Its steps are of the run's first tokens a step
        # (resume_tokens.py)
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True,
    )
    return optimizer, scheduler


def _build_model(cfg, env, tokenizer):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from msa_model.model.gpt import build_model

    model = build_model(cfg.model, cfg.parallel, tokenizer.vocab_size,
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


def _flops_counter(cfg, tokenizer):
    from msa_model.training.flops import flops_per_token

    return lambda keys_per_query, sparse: flops_per_token(cfg.model, tokenizer.vocab_size, keys_per_query, sparse)


def _metric_sinks(cfg, run_dir: Path) -> list:
    """Where rank 0's metric records go, in this order: the console line first, so that a sink
    that fails cannot hide the step's numbers."""
    from msa_model.training.metrics import ConsoleLine, JsonlFile, TensorBoard, Wandb

    sinks = [ConsoleLine(cfg.trainer.max_steps, cfg.logging.log_interval, cfg.logging.progress_bar)]
    if cfg.logging.jsonl:
        sinks.append(JsonlFile(run_dir / "metrics.jsonl"))
    if cfg.logging.tensorboard:
        sinks.append(TensorBoard(run_dir / "tensorboard"))
    if cfg.logging.wandb_mode != "disabled":
        sinks.append(Wandb(cfg.logging, run_dir, OmegaConf.to_container(cfg, resolve=True)))
    return sinks


def _log_summary(state, cfg, run_dir: Path, ckpt_root: Path, last: dict | None, seconds: float) -> None:
    """The run's last lines: where it stopped, its last losses, where everything went."""
    from msa_model.training.checkpoint import latest_checkpoint

    minutes, secs = divmod(int(seconds), 60)
    losses = ""
    if last and "lm_loss" in last:
        kl = f", indexer KL {last['kl_loss']:.4f}" if "kl_loss" in last else ""
        losses = f"; last logged lm loss {last['lm_loss']:.4f}{kl} ({last['phase']})"
    # short of max_steps without a stop signal: trainer.stop_at_step ended the job, not the run
    early = state.step < cfg.trainer.max_steps
    after = (f"; trainer.stop_at_step={cfg.trainer.stop_at_step} ended this job: run {run_dir / 'launch.sh'} "
             "to continue") if early else ""
    log.info("%s at step %d of %d (%s tokens) in %dm%02ds%s%s", "stopped" if early else "finished", state.step,
             cfg.trainer.max_steps, f"{state.tokens:,}", minutes, secs, losses, after)
    latest = latest_checkpoint(ckpt_root)
    logs = [name for name, on in (("train.log", True), ("metrics.jsonl", cfg.logging.jsonl),
                                  ("tensorboard/", cfg.logging.tensorboard),
                                  ("wandb/", cfg.logging.wandb_mode != "disabled")) if on]
    log.info("run dir %s: %s; checkpoints in %s (latest: %s)", run_dir, ", ".join(logs), ckpt_root,
             latest.name if latest else "none")


def _start_fresh(cfg, trainer, model_chunks, optimizer, scheduler, model_config) -> None:
    """A run without a checkpoint of its own: init_from's weights (and data position), the lr
    schedule's start step."""
    from msa_model.training import checkpoint as ckpt

    if cfg.init_from:
        # its manifest was checked before the run's records were written (run)
        ckpt.load_model_weights(model_chunks, cfg.init_from, model_config, partial=cfg.init_from_partial,
                                verify=False)
        # bf16 training keeps fp32 main copies made when the optimizer was built: refresh them,
        # or the first step would put the fresh initialisation back
        optimizer.reload_model_params()
        if cfg.init_from_data_position:
            from msa_model.training.resume_tokens import continue_data_position

            position, step_dir = ckpt.init_data_position(cfg.init_from)
            log.info("%s", continue_data_position(trainer.state, position, step_dir, cfg.model.seq_length))
    if cfg.optim.schedule_start_step:
        scheduler.step(increment=cfg.optim.schedule_start_step)
        log.info("lr schedule starts at its step %d (optim.schedule_start_step): lr %.3g", cfg.optim.schedule_start_step,
                 optimizer.param_groups[0]["lr"])


def check_configuration(cfg, world_size: int) -> list[str]:
    """Every problem of the configuration (msa_model.config.validate) and of the corpus and
    checkpoints it names (msa_model.training.inputs.check_inputs), and of the directories it writes
    (output_problems), one line each. Nothing is written; the tokenizer and prepared datasets are
    `_tokenizer`'s."""
    from msa_model.training.inputs import check_inputs, output_problems

    problems = []
    try:
        validate(cfg, world_size)
    except ConfigError as e:
        problems += config_problems(e)
    return problems + output_problems(cfg) + check_inputs(cfg)


def _tokenizer(cfg):
    """(tokenizer or None, where it came from, problem lines) of the run (data_setup.py)."""
    from msa_model.training.data_setup import step_dir_of, tokenizer_problems
    from msa_model.training.inputs import checkpoint_step

    ckpt_root = Path(cfg.checkpoint.dir or Path(cfg.run_dir) / "checkpoints")
    resume_dir = step_dir_of(ckpt_root) if cfg.resume != "never" else None
    # an init_from that is no checkpoint is reported by check_inputs, not as one without a tokenizer
    init_dir = checkpoint_step("init_from", cfg.init_from)[0] if cfg.init_from else None
    return tokenizer_problems(cfg, resume_dir, init_dir)


def _vocab_rows(cfg, tokenizer) -> list[str]:
    """The checkpoint a run resumes (else its init_from) against the embedding rows this layout
    builds: the padded vocabulary follows parallel.tp, so a relaunch on another TP would stop at
    the load, after the run's records are rewritten."""
    from msa_model.training.checkpoint_checks import vocab_rows_problem
    from msa_model.training.data_setup import step_dir_of
    from msa_model.training.inputs import checkpoint_step

    if tokenizer is None:
        return []
    ckpt_root = Path(cfg.checkpoint.dir or Path(cfg.run_dir) / "checkpoints")
    resume_dir = step_dir_of(ckpt_root) if cfg.resume != "never" else None
    if resume_dir is not None:
        where, step = f"resume: {resume_dir}", resume_dir
    elif cfg.init_from and not cfg.init_from_partial:
        where, step = f"init_from={cfg.init_from}", checkpoint_step("init_from", cfg.init_from)[0]
    else:
        return []
    if step is None:
        return []  # no checkpoint there: check_inputs says so
    problem = vocab_rows_problem(where, step, cfg.model, tokenizer.vocab_size, cfg.parallel.tp)
    return [problem] if problem else []


def input_problems(cfg, overrides: list[str] | None = None) -> list[str]:
    """What a launch of `cfg` would stop at on its inputs (corpus or datasets, checkpoints,
    tokenizer), one line each; the dry run and `python -m launch.slurm` show them as warnings,
    since either may be made away from the data. `overrides`: as for check_inputs."""
    from msa_model.training.inputs import check_inputs

    tokenizer, _, problems = _tokenizer(cfg)
    return check_inputs(cfg, overrides) + problems + _vocab_rows(cfg, tokenizer)


def _name_loaded_step(named: Path | None, loaded: Path | None):
    """line -> line naming `loaded` where it named `named`: the model's and the tokenizer's source
    lines are read from the step `latest` pointed at (`named`), and resume=fallback loads an older
    one when that one is damaged. The load refuses an older step recording another model; the
    tokenizer line is renamed only where the older step records the same tokenizer."""
    if named is None or loaded is None or named == loaded:
        return lambda line: line
    return lambda line: line.replace(str(named), str(loaded))


def run(cfg: DictConfig, notes: list[str] | tuple[str, ...] = ()) -> None:
    """`notes`: lines about how the config was made (e.g. the model taken from a checkpoint), logged
    once the checkpoint a resume loads is chosen."""
    from msa_model.config import token_budget
    from msa_model.training.index_history import (WARMUP_KEY, given_on_command_line, plan_indexer_warmup,
                                                  resumed_warmup_note)

    from msa_model.training.resume_tokens import planned_max_steps, schedule_steps_by_tokens

    # the tokens of `${steps_for_tokens:X}`, before resolving turns it into steps (optim.*'s in the
    # steps of a resumed lr schedule)
    budget = token_budget(cfg)
    # (resolved again below from the checkpoint loaded, where resume=fallback takes an older one)
    unresolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    schedule_lines = schedule_steps_by_tokens(cfg)
    OmegaConf.resolve(cfg)
    rank, world_size, _ = launch_env()
    # init_from's index branch may make the warmup unnecessary (before the config is checked and
    # written: what runs is what config.yaml says)
    warmup_note = plan_indexer_warmup(cfg, given_on_command_line(WARMUP_KEY))
    # a resume at other tokens a step than its checkpoint's: trainer.stop_at_step is checked against
    # the steps it goes to (set again below from the checkpoint the resume loads), and the dry run
    # shows them
    planned = planned_max_steps(cfg, budget)
    if planned is not None:
        cfg.trainer.max_steps = planned
    if cfg.dry_run:
        # a dry run checks the layout it will be launched with, not this one process
        layout_world = max(world_size, cfg.launch.nodes * cfg.launch.ranks_per_node)
        validate(cfg, layout_world)
        if rank == 0:
            from msa_model.config_checks import missing_init_from, setting_warnings
            from msa_model.training.dry_run import dry_run_report
            from msa_model.training.resume_tokens import resume_preview

            # inputs a launch from here would stop at (a dry run may be made away from the data)
            missing = missing_init_from(cfg)
            input_warnings = [f"warning: {p}" for p in ([missing] if missing else []) + input_problems(cfg)
                              + setting_warnings(cfg)]
            report = dry_run_report(cfg, layout_world)
            print("\n".join([*(f"# {n}" for n in notes), report, *([warmup_note] if warmup_note else []),
                             *resume_preview(cfg, budget), *schedule_lines, *input_warnings]), flush=True)
        return
    started = time.monotonic()
    # before anything is written (run directory, data cache, lock): every problem at once
    problems = check_configuration(cfg, world_size)
    # the tokenizer against the model, the checkpoints and the prepared datasets (a wrong one would
    # train the embedding rows of another vocabulary)
    ckpt_root = Path(cfg.checkpoint.dir or Path(cfg.run_dir) / "checkpoints")
    tokenizer, tokenizer_source, more = _tokenizer(cfg)
    more += _vocab_rows(cfg, tokenizer)
    if problems or more:
        # the blend's entries are the schema's and the datasets' check both: each line once
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(dict.fromkeys(problems + more)))

    from data.tokenizer import describe_identity
    from msa_model.training import checkpoint as ckpt
    from msa_model.training import failures
    from msa_model.training.data_setup import build_data
    from msa_model.training.distributed import cuda_connections, init_distributed, shutdown
    from msa_model.training.indexer_warmup import IndexerWarmup
    from msa_model.training.metrics import MetricsLogger
    from msa_model.training.preemption import StopSignal, plan_requeue, requeue_slurm_job
    from msa_model.training.resume_tokens import (change_line, convert_positions, resumed_max_steps,
                                                  schedule_decay_steps, schedule_problem)
    from msa_model.training.trainer import OutOfMemory, Trainer

    # first, so that a stop during start-up (which can take minutes at scale) is not lost
    stop_signal = StopSignal(list(cfg.trainer.stop_signals)) if cfg.trainer.stop_signals else None
    run_dir = Path(cfg.run_dir)
    # a run directory this launch made is removed again where it stops before writing into it
    # (a damaged init_from): a refused run leaves nothing behind
    made_run_dir = rank == 0 and not run_dir.exists()
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    # the console only: train.log is the run's, written once the run dir's lock is ours
    setup_logging(None, rank == 0)
    if rank == 0:
        from msa_model.platform.quiet import backend_note

        from msa_model.config_checks import setting_warnings

        line = backend_note()
        if line:
            log.info("%s", line)
        for line in setting_warnings(cfg):
            log.warning("warning: %s", line)
        warn_untested_versions()
    latest = ckpt.latest_checkpoint(ckpt_root)
    # the step the model's and the tokenizer's source lines were read from (resume=fallback may
    # load an older one)
    named = latest
    if cfg.resume == "never" and latest is not None:
        # (found by check_inputs already, unless a checkpoint appeared since)
        raise ConfigError(f"resume=never but {ckpt_root} already holds checkpoints; choose another run_dir")

    determinism = []
    if cfg.trainer.deterministic:
        from msa_model.training.determinism import deterministic_mode

        # before CUDA, cuBLAS and NCCL start: they read their settings once
        determinism = deterministic_mode()
    # before CUDA starts, like the above
    connections = cuda_connections(cfg.parallel, cfg.trainer.device)
    env = init_distributed(cfg.parallel, cfg.trainer.device, cfg.trainer.seed)
    failures.watch(env.rank, world_size)
    requeue, lock, failed = False, None, False
    try:
        # before anything is written: a second launch into a busy run dir would delete the first
        # one's save in progress and interleave its metrics
        lock = lock_run_dir(run_dir, env.is_main)
        if latest is None and cfg.init_from:
            # a new run starts from init_from: checked against its manifest before any of the
            # run's records (config.yaml, launch.sh, train.log) is written
            from msa_model.training.inputs import checkpoint_step
            from msa_model.training.manifest import verify_checkpoint

            verify_checkpoint(checkpoint_step("init_from", cfg.init_from)[0], "init_from")
        if env.is_main:
            setup_logging(run_dir, True)
        # checked against its manifest before the run's records are rewritten or anything is
        # built: a damaged checkpoint stops here, leaving config.yaml and launch.sh as they were
        latest = ckpt.resume_checkpoint(ckpt_root, fallback=cfg.resume == "fallback") if latest is not None else None
        # a resume at other tokens a step than its checkpoint's goes on by tokens (resume_tokens.py):
        # its max_steps is set before the run's records and everything that reads it
        step_tokens = cfg.parallel.global_batch_size * cfg.model.seq_length
        saved, saved_seq = ckpt.saved_progress(latest, step_tokens) if latest is not None else (None, None)
        if saved is not None and budget is not None:
            cfg.trainer.max_steps = resumed_max_steps(saved, step_tokens, budget)
        if saved is not None and latest != named:
            # resume=fallback loaded an older step than `latest` names, whose counters the lines
            # above may not have read: the schedule's keys in its steps
            schedule_lines = schedule_steps_by_tokens(unresolved, saved, into=cfg)
        # before the run's records: megatron's scheduler would stop at it deep in the optimizer's set-up
        problem = schedule_problem(cfg, saved)
        if problem:
            raise ConfigError(problem)
        if env.is_main:
            from msa_model.training.data_setup import checkpoint_tokenizer, document_mask_line

            # after the resume's choice: lines that name the step read name the step loaded
            loaded = _name_loaded_step(named, latest)
            for line in notes:
                log.info("%s", loaded(line))
            if checkpoint_tokenizer(latest)[0] == tokenizer.identity:
                tokenizer_source = loaded(tokenizer_source)
            write_run_files(cfg, run_dir, resuming=latest is not None)
            ckpt.cleanup_partial_saves(ckpt_root)
            log.info("run dir %s | %s | %s", run_dir,
                     " ".join(f"{k}={v}" for k, v in parallel_layout(cfg.parallel, world_size).items()),
                     document_mask_line(cfg))
            log.info("tokenizer %s (%s)", describe_identity(tokenizer.identity), tokenizer_source)
            # a resume past the warmup: where it ended, not init_from's index branch before it
            warmup_note = resumed_warmup_note(warmup_note, latest, cfg.trainer.indexer_warmup_tokens)
            if warmup_note:
                log.info("%s", warmup_note)
            for line in determinism:
                log.info("%s", line)
            if env.device.type == "cuda":  # (on CPU the variable is set but means nothing)
                for line in connections:
                    log.info("%s", line)
            changed = None if saved is None else change_line(saved, saved_seq, cfg.parallel.global_batch_size,
                                                             cfg.model.seq_length, cfg.trainer.max_steps, budget)
            for line in ([changed] if changed else []) + schedule_lines:
                log.info("%s", line)
        model_chunks = _build_model(cfg, env, tokenizer)
        optimizer, scheduler = _build_optimizer(cfg, model_chunks,
                                                schedule_decay_steps(cfg.trainer.max_steps, step_tokens, saved))
        model_chunks[0].config.grad_scale_func = optimizer.scale_loss

        # the callbacks run in this order at every hook: the module timer first (its step end is
        # marked before any other callback's work); the indexer warmup, which sets the step's
        # attention phase at its start; the diagnostics, which add to the step's metrics; the
        # checkpointer; the metrics logger last, given the warmup's phase to record
        callbacks = []
        if cfg.logging.time_modules:
            from msa_model.training.module_timer import ModuleTimer

            callbacks.append(ModuleTimer(env.device))
        warmup = None
        # phases exist where some layer is MSA (a model of full-attention layers only is dense)
        if any(msa_layers_of(cfg.model)):
            from msa_model.training.index_history import index_branch_trained

            warmup = IndexerWarmup(cfg.trainer.indexer_warmup_tokens, cfg.model.msa,
                                   index_trained=bool(cfg.init_from) and bool(index_branch_trained(cfg.init_from)),
                                   dense_interval=cfg.trainer.indexer_dense_interval)
            callbacks.append(warmup)
            if cfg.logging.msa_diagnostics_interval > 0:
                from msa_model.training.diagnostics import MSADiagnostics

                callbacks.append(MSADiagnostics(cfg.logging.msa_diagnostics_interval, cfg.model.msa,
                                                cfg.model.num_layers, cfg.model.seq_length, run_dir, env.is_main))
        model_config = OmegaConf.to_container(cfg.model, resolve=True)
        checkpointer = ckpt.Checkpointer(ckpt_root, cfg.checkpoint.interval, cfg.checkpoint.keep,
                                         cfg.checkpoint.save_at_end, model_config, tokenizer=tokenizer)
        callbacks.append(checkpointer)
        metrics_logger = MetricsLogger(_metric_sinks(cfg, run_dir) if env.is_main else [], cfg.logging.log_interval,
                                       cfg.trainer.max_steps, flops_per_token=_flops_counter(cfg, tokenizer),
                                       world_size=world_size, phase=(lambda: warmup.phase) if warmup else None)
        callbacks.append(metrics_logger)
        # the train dataset holds start_samples + max_steps global batches (read at its first use,
        # after any checkpoint is loaded), or the samples read + the steps left where more
        train_data, valid_data = build_data(cfg, tokenizer, lambda: (trainer.state.start_samples, trainer.state.step,
                                                                     trainer.state.consumed_samples),
                                            lambda: (trainer.state.step, trainer.state.consumed_valid_samples))
        trainer = Trainer(cfg.trainer, cfg.parallel, cfg.model, model_chunks=model_chunks, optimizer=optimizer,
                          scheduler=scheduler, data=train_data, valid_data=valid_data, callbacks=callbacks,
                          device=env.device, stop_signal=stop_signal, probe=_retrieval_probe(cfg, tokenizer))
        if latest is not None:
            ckpt.load_checkpoint(trainer, latest, verify=False, model_config=model_config)
            if saved_seq and saved_seq != cfg.model.seq_length:
                convert_positions(trainer.state, saved_seq, cfg.model.seq_length)
        else:
            _start_fresh(cfg, trainer, model_chunks, optimizer, scheduler, model_config)
        if trainer.state.step >= cfg.trainer.max_steps:
            log.info("nothing to do: %s is already at step %d of %d (resume=auto); pass another run_dir= "
                     "to start a new run", run_dir, trainer.state.step, cfg.trainer.max_steps)
            return

        try:
            state = trainer.train()
        except OutOfMemory as e:
            if failures.active():
                # said once, and named by the other ranks; the process ends there
                failures.fail(str(e), 1)
            log.error("%s", e)
            # the message says it all; the process group cannot be shut down cleanly after it
            logging.shutdown()
            sys.stdout.flush()
            os._exit(1)
        finished = state.step >= cfg.trainer.max_steps
        if trainer.stop_reason is not None and not finished:
            # a requested stop ends with one line: signal, step, checkpoint, what happens next
            plan = plan_requeue(trainer.stop_reason, list(cfg.launch.requeue_signals), finished,
                                relaunch=f"run {run_dir / 'launch.sh'}") if env.is_main else None
            requeue = plan is not None and plan.requeue
            where = checkpointer.last_saved or ckpt.latest_checkpoint(ckpt_root)
            log.info("stopped by %s after step %d: checkpoint %s; %s", trainer.stop_reason, state.step,
                     where or "none (checkpointing is off)", plan.note if plan else "")
        else:
            _log_summary(state, cfg, run_dir, ckpt_root, metrics_logger.last_record, time.monotonic() - started)
    except BaseException:
        failed = True
        raise
    finally:
        try:
            # the handlers stay until the process group is gone: SLURM may repeat a signal meanwhile.
            # A rank of several that failed leaves the group as it is: its last barrier would pair
            # with whatever collective the others wait in (train.py reports the error; the process ends)
            if not failed or world_size == 1:
                failures.stop_watching()
                shutdown()
            if stop_signal is not None:
                stop_signal.restore()
        finally:
            if lock is not None:
                lock.release()
            if failed and made_run_dir:
                # (rmdir: only while empty)
                with contextlib.suppress(OSError):
                    run_dir.rmdir()
    # last: every rank must be done with the checkpoint before the job is requeued
    if requeue and not requeue_slurm_job():
        # neither finished nor back in the queue: an exit status of 0 would read as a completed job
        # (to SLURM, submitit and afterok dependencies); the batch script exits 1 here too
        failures.fail("the job was not requeued; resume it by relaunching it", 1)
