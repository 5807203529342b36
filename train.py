"""Pretrain an MSA-MoE language model: `python train.py [recipe=pt|cpt|dense] [key=value ...]`.

Thin Hydra entry point; everything else lives in msa_model.training.
"""

import os
import sys

import hydra
from omegaconf import DictConfig

from msa_model.config import ConfigError, register_configs

register_configs()


def _fail(message: str, code: int) -> None:
    """A user error: its message once (rank 0), no traceback, a non-zero exit."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


@hydra.main(config_path="configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    from msa_model.training.run import INPUT_ERRORS, run

    try:
        run(cfg)
    except INPUT_ERRORS as e:
        # the message names the field, file or holder and the cause; a traceback would bury it
        _fail(str(e), 2)
    except KeyboardInterrupt:
        # a second Ctrl-C (the first one asks for a stop with a checkpoint), or one before training
        _fail("interrupted; nothing was saved after the last checkpoint", 130)


# the guard keeps processes that re-import this module (spawned workers) from training
if __name__ == "__main__":
    main()
