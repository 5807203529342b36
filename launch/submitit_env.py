"""Hydra callback used by `python train.py -m launch=slurm ...` (Hydra's submitit launcher).

Submitit runs the training function in one process per SLURM task. Before the trainer starts its
process group, this exports the variables of torch.distributed's env:// method (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) from submitit's view of the job, so the trainer sees the same
environment as under torchrun.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from hydra.experimental.callback import Callback


class RequireSlurmClient(Callback):
    def on_multirun_start(self, config: Any = None, **kwargs: Any) -> None:
        # before the sweep writes anything: submitit needs sbatch and srun where it submits from,
        # and says so otherwise in a traceback. An exit, since Hydra turns a callback's exception
        # into a warning and goes on
        missing = [command for command in ("sbatch", "srun") if shutil.which(command) is None]
        if missing:
            from msa_model.training import failures

            failures.fail(f"launch=slurm submits with {' and '.join(missing)}, not found on this machine: "
                          "run it on a SLURM login node", 2)


class ExportTorchDistributedEnv(Callback):
    def on_job_start(self, config: Any = None, **kwargs: Any) -> None:
        # the callback also runs where no SLURM job exists (e.g. the submitit local executor)
        if "SLURM_JOB_ID" not in os.environ or "SUBMITIT_EXECUTOR" not in os.environ:
            return
        from submitit.helpers import TorchDistributedEnvironment

        # submitit draws the port at random from 20000-60000, which overlaps Linux's ephemeral range
        # (32768+): the job's port is chosen as launch/submit.sbatch.in chooses it
        job, attempt = int(os.environ["SLURM_JOB_ID"].split("_")[0]), int(os.environ.get("SLURM_RESTART_COUNT", 0))
        os.environ["MASTER_PORT"] = str(20000 + (job * 16 + attempt) % 12768)
        # overwrite: a job submitted from inside another job inherits that job's variables
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
