"""Pretrain an MSA-MoE language model: `python train.py [recipe=pt|cpt|dense] [key=value ...]`.

Thin Hydra entry point; everything else lives in msa_model.training.
"""

import os
import sys

import hydra
from omegaconf import DictConfig

from msa_model.config import register_configs

register_configs()

# Hydra prints a composition error (unknown key, wrong type, unknown config group option) over
# several lines with a hint about HYDRA_FULL_ERROR and exits 1; with the variable set it raises
# instead, and the error is reported below in one line with exit code 2. A user who sets the
# variable gets Hydra's full error as before.
_USER_FULL_ERROR = os.environ.get("HYDRA_FULL_ERROR") == "1"
os.environ["HYDRA_FULL_ERROR"] = "1"
_TASK_STARTED = False


@hydra.main(config_path="configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    global _TASK_STARTED
    _TASK_STARTED = True
    from hydra.core.hydra_config import HydraConfig

    from msa_model.training.inputs import task_overrides, unknown_keys
    from msa_model.training import failures

    overrides = task_overrides()
    # keys `+key=value` added beside the schema would be ignored: refused like a misspelled key
    unknown = unknown_keys(cfg, overrides)
    if unknown:
        failures.fail("invalid configuration:\n  - " + "\n  - ".join(unknown), 2)

    from msa_model.training.model_source import take_model_from_checkpoint
    from msa_model.training.distributed import ProcessGroupError
    from msa_model.training.run import INPUT_ERRORS, run

    # a fatal error is said once, by the rank that has it (msa_model/training/failures.py)
    try:
        hydra_cfg = HydraConfig.get()
        searchpath = [o for o in hydra_cfg.overrides.hydra if o.startswith("hydra.searchpath")]
        # init_from / resume without model=: the model the checkpoint records
        cfg, note = take_model_from_checkpoint(cfg, overrides, hydra_cfg.job.config_name, searchpath)
        run(cfg, notes=[note] if note else [])
    except ProcessGroupError as e:
        # one rank's own trouble (a port in use), before the job's store exists to tell the others
        failures.fail(str(e), 2, this_rank=True)
    except INPUT_ERRORS as e:
        # the message names the field, file or holder and the cause; a traceback would bury it
        failures.fail(str(e), 2)
    except KeyboardInterrupt:
        # a second Ctrl-C (the first one asks for a stop with a checkpoint), or one before training
        failures.fail("interrupted; nothing was saved after the last checkpoint", 130, every_rank=True)
    except Exception as e:
        if not failures.active():
            raise
        failures.crash(e)


def _composition_errors() -> tuple:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return HydraException, OmegaConfBaseException


def _submission_errors() -> tuple:
    """What `-m launch=slurm` (Hydra's submitit launcher) raises when sbatch refuses the job."""
    try:
        from submitit.core.utils import FailedJobError
    except ImportError:
        return ()
    return (FailedJobError,)


def submission_refusal(e: Exception):
    """sbatch's verdict, its last line (`fatal: ...`, `error: Batch job submission failed: ...`),
    when `e` is a refused submission: submitit raises FailedJobError from sbatch's failed call. The
    same error type from a job that ran and failed (Hydra's launcher waits for its jobs) gives None:
    its whole message, with the job's log files, is the one to show."""
    import subprocess

    if not isinstance(e.__cause__, subprocess.CalledProcessError):
        return None
    return (str(e).strip().splitlines() or [type(e).__name__])[-1]


# the guard keeps processes that re-import this module (spawned workers) from training
if __name__ == "__main__":
    try:
        main()
    except _submission_errors() as e:
        verdict = submission_refusal(e)
        if verdict is None:
            raise  # a job that ran and failed: submitit's message names its logs
        from msa_model.training import failures

        failures.fail(verdict, 1)
    except _composition_errors() as e:
        if _TASK_STARTED or _USER_FULL_ERROR:
            raise
        from msa_model.training.inputs import composition_error
        from msa_model.training import failures

        failures.fail(composition_error(e, [a for a in sys.argv[1:] if not a.startswith("-")]), 2)
