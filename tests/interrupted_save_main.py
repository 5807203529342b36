"""train.py whose Nth checkpoint save dies half-way: the process is killed (os._exit) after part
of the checkpoint is on disk, as a node failure would. Used by test_train_resume.py."""

import multiprocessing
import os
import sys
from pathlib import Path

import msa_model  # noqa: F401  (before megatron: msa_model/platform/megatron_imports.py)
from megatron.core import dist_checkpointing

DIE_ON_SAVE = int(os.environ["DIE_ON_SAVE"])
_real_save = dist_checkpointing.save
_calls = 0


def dying_save(sharded_state_dict, checkpoint_dir, *args, **kwargs):
    global _calls
    _calls += 1
    if _calls == DIE_ON_SAVE:
        (Path(checkpoint_dir) / "__0_0.distcp").write_bytes(b"half a checkpoint")
        sys.stdout.flush()
        # the whole process tree dies, as on a node failure
        for child in multiprocessing.active_children():
            child.kill()
        os._exit(17)
    return _real_save(sharded_state_dict, checkpoint_dir, *args, **kwargs)


dist_checkpointing.save = dying_save

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import runpy

    sys.argv[0] = "train.py"
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "train.py"), run_name="__main__")
