"""Indexer warmup schedule, counted in tokens: dense attention and a dense KL until
`warmup_tokens` training tokens have been consumed, then top-k block selection. With
`dense_interval` N > 0, one step in N after the warmup (step numbers 1, N + 1, 2N + 1, ...: the
first of every N, so that logging and diagnostics intervals dividing N end on a sparse step) runs
as a warmup step again (phase "dense-step"), so the indexer's KL also sees the blocks its selection
skips; validation always runs in the run's phase (sparse after the warmup).

The phase of a step is decided by the tokens consumed before it and its number, so a resumed run
switches at exactly the same steps as an uninterrupted one; the step of the switch is kept in the
checkpoint, and so is whether the index branch is trained (`index_trained`: the run trained a
sparse step, or started from a trained branch; msa_model/training/index_history.py reads it).
"""

from __future__ import annotations

import logging

from msa_model.model.attention import msa_layers, set_msa_phase
from msa_model.ops.common import keys_per_query
from msa_model.training.callbacks import Callback

log = logging.getLogger(__name__)


class IndexerWarmup(Callback):
    name = "indexer_warmup"

    def __init__(self, warmup_tokens: int, msa_cfg, index_trained: bool = False, dense_interval: int = 0):
        self.warmup_tokens = warmup_tokens
        self.msa_cfg = msa_cfg
        self.dense_interval = dense_interval
        # the index branch was trained before this run (init_from's record), or by a sparse step
        self.index_trained = index_trained
        self.sparse: bool | None = None  # the layers' setting
        self.past_warmup: bool | None = None
        self.dense_step = False  # the current step is a dense step after the warmup
        self.switched_at_step: int | None = None
        self.switched_at_tokens: int | None = None

    @property
    def phase(self) -> str:
        """The attention phase of the current step, set at its start: "warmup", "sparse", or
        "dense-step" (a dense step after the warmup, `dense_interval`)."""
        if not self.past_warmup:
            return "warmup"
        return "dense-step" if self.dense_step else "sparse"

    def _set_layers(self, trainer, sparse: bool) -> None:
        if sparse != self.sparse:
            self.sparse = sparse
            set_msa_phase(trainer.model_chunks, sparse)

    def _apply(self, trainer) -> None:
        tokens = trainer.state.tokens
        past = tokens >= self.warmup_tokens
        # the step about to run is number state.step + 1: dense at 1, N + 1, 2N + 1, ...
        self.dense_step = past and self.dense_interval > 0 and trainer.state.step % self.dense_interval == 0
        switched, self.past_warmup = past and not self.past_warmup, past
        if not past and self.switched_at_step is not None:
            # resumed with a longer warmup than its checkpoint's run had, and back in it: the switch
            # recorded was the old warmup's, and the new one is announced and recorded when it comes
            self.switched_at_step = self.switched_at_tokens = None
        self._set_layers(trainer, past and not self.dense_step)
        if not switched:
            return
        # the switch is due now when the step before this one still began in warmup: in a running
        # job, and in one resumed from the checkpoint taken on the last warmup step, whose steps
        # may have had other tokens than this job's (the checkpoint's counters say, until the
        # trainer's first step)
        due_now = self.warmup_tokens > 0 and tokens - trainer.state.step_tokens < self.warmup_tokens
        if self.switched_at_step is None and due_now:
            self.switched_at_step, self.switched_at_tokens = trainer.state.step, tokens
            c = self.msa_cfg
            log.info("indexer warmup done after step %d (%s tokens >= %s): switching to sparse attention, "
                     "top-%d of %d-token blocks (<= %d keys per query)", trainer.state.step,
                     f"{tokens:,}", f"{self.warmup_tokens:,}", c.topk, c.block_size,
                     keys_per_query(c.block_size, c.topk))
        if self.dense_interval:
            # said once a process: at the switch, or at the start of a job past the warmup
            log.info("%s", self._dense_steps_line(trainer.state.step + 1))

    def _dense_steps_line(self, first: int) -> str:
        """Which steps from step number `first` on run dense (1, N + 1, 2N + 1, ...)."""
        n = self.dense_interval
        nxt = first + (1 - first) % n
        return (f"one step in {n} from here on (steps {nxt}, {nxt + n}, ...) runs dense attention and the dense KL "
                "(trainer.indexer_dense_interval)")

    def on_train_start(self, trainer) -> None:
        if not msa_layers(trainer.model_chunks):
            self.sparse = self.past_warmup = True
            return
        self._apply(trainer)
        warmup = "ended at" if self.past_warmup else "until"
        log.info("attention phase at step %d: %s (indexer warmup %s %s tokens)", trainer.state.step,
                 self.phase, warmup, f"{self.warmup_tokens:,}")

    def on_step_start(self, trainer) -> None:
        self._apply(trainer)

    def on_evaluation_start(self, trainer) -> None:
        # the held-out loss measures the model as it runs: a dense step's layers go back to top-k
        self._set_layers(trainer, bool(self.past_warmup))

    def on_step_end(self, trainer, metrics: dict) -> None:
        # a step past the warmup (sparse, or dense by the interval) trained the index branch
        self.index_trained = self.index_trained or bool(self.past_warmup)

    def state_dict(self) -> dict:
        return {"warmup_tokens": self.warmup_tokens, "switched_at_step": self.switched_at_step,
                "switched_at_tokens": self.switched_at_tokens, "index_trained": self.index_trained}

    def load_state_dict(self, sd: dict) -> None:
        self.switched_at_step = sd.get("switched_at_step")
        self.switched_at_tokens = sd.get("switched_at_tokens")
        # checkpoints before the field: trained once the switch happened
        self.index_trained = bool(sd.get("index_trained", self.switched_at_step is not None)) or self.index_trained
        if sd.get("warmup_tokens") != self.warmup_tokens:
            log.warning("indexer warmup: checkpoint had warmup_tokens=%s, config says %s; using the config",
                        sd.get("warmup_tokens"), self.warmup_tokens)
