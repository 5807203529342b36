"""Pretrain an MSA-MoE language model: `python train.py [recipe=pt|cpt|dense] [model=tiny|small] [key=value ...]`.

Thin Hydra entry point; everything else lives in msa_model.training.
"""

import sys

import hydra
from omegaconf import DictConfig

from msa_model.config import register_configs

register_configs()


@hydra.main(config_path="configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    from msa_model.training.run import INPUT_ERRORS, run

    try:
        run(cfg)
    except INPUT_ERRORS as e:
        # the message names the field, file or holder and the cause; a traceback would bury it
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


# the guard matters: checkpoint saving starts worker processes that re-import this module
if __name__ == "__main__":
    main()
