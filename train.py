"""Pretrain an MSA-MoE language model: `python train.py [recipe=pt|cpt|dense] [key=value ...]`.

Thin Hydra entry point; everything else lives in msa_model.training.
"""

import hydra
from omegaconf import DictConfig

from msa_model.config import ConfigError, register_configs

register_configs()


@hydra.main(config_path="configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    from msa_model.training import failures
    from msa_model.training.run import INPUT_ERRORS, run

    # a fatal error is said once, by the rank that has it (msa_model/training/failures.py)
    try:
        run(cfg)
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


# the guard keeps processes that re-import this module (spawned workers) from training
if __name__ == "__main__":
    main()
