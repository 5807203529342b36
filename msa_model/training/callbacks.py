"""The loop's extension points. Side concerns (metrics, checkpoints, schedules) are callbacks so
the loop stays a loop; anything with state that must survive a restart implements
state_dict/load_state_dict and is saved in the checkpoint under its `name`.

Every hook calls the callbacks in the order the trainer was given them (run.py lists and
explains it). What one callback needs of another is handed to it when they are built (the
metrics logger gets the indexer warmup's phase), not left in shared state."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """Progress counters, saved in every checkpoint. `step` counts completed optimizer steps;
    `consumed_samples` is the data position, which starts at `start_samples` (0, or where the
    init_from checkpoint's run stopped with init_from_data_position=true). `step_tokens` is the
    tokens of the run's steps (global batch x sequence length); `schedule_step_tokens` those of a
    step of its lr schedule, the run's first steps' (msa_model/training/resume_tokens.py)."""

    step: int = 0
    consumed_samples: int = 0
    tokens: int = 0
    # the validation stream's position: each evaluation reads the batches after the last one's
    consumed_valid_samples: int = 0
    start_samples: int = 0
    step_tokens: int = 0
    schedule_step_tokens: int = 0
    stop_requested: bool = False

    def state_dict(self) -> dict:
        return {"step": self.step, "consumed_samples": self.consumed_samples, "tokens": self.tokens,
                "consumed_valid_samples": self.consumed_valid_samples, "start_samples": self.start_samples,
                "step_tokens": self.step_tokens, "schedule_step_tokens": self.schedule_step_tokens}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.consumed_samples, self.tokens = sd["step"], sd["consumed_samples"], sd["tokens"]
        # absent from older checkpoints
        self.consumed_valid_samples = sd.get("consumed_valid_samples", 0)
        self.start_samples = sd.get("start_samples", 0)
        # older checkpoints' runs kept one batch: tokens / step (none at step 0: this run's)
        kept = self.tokens // self.step if self.step else self.step_tokens
        self.step_tokens = sd.get("step_tokens", kept)
        self.schedule_step_tokens = sd.get("schedule_step_tokens", kept)


class Callback:
    name: str = ""

    def on_train_start(self, trainer) -> None:
        pass

    def on_step_start(self, trainer) -> None:
        pass

    def on_step_end(self, trainer, metrics: dict) -> None:
        pass

    def on_evaluation_start(self, trainer) -> None:
        """Before a validation pass (after the step, before on_step_end)."""

    def on_train_end(self, trainer) -> None:
        pass

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, sd: dict) -> None:
        pass
