"""train.py that also writes the token ids of every micro-batch it trains on, one JSON line each
({"tokens": [[...], ...]}), to the file named by BATCH_LOG. Used by test_recipes.py to compare the
batches of two runs."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import data.datasets as datasets  # noqa: E402

_real_iterator = datasets.build_train_iterator


def recording_iterator(*args, **kwargs):
    with open(os.environ["BATCH_LOG"], "a") as f:
        for batch in _real_iterator(*args, **kwargs):
            f.write(json.dumps({"tokens": batch["tokens"].tolist()}) + "\n")
            f.flush()
            yield batch


datasets.build_train_iterator = recording_iterator

if __name__ == "__main__":
    import runpy

    sys.argv[0] = "train.py"
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "train.py"), run_name="__main__")
