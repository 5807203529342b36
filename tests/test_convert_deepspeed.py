"""deepspeed-to-msa: a tiny Hugging Face Llama trained one step by DeepSpeed without ZeRO (stage 0),
ZeRO-2 and ZeRO-3 on two gloo ranks (tests/deepspeed_main.py), saved, converted with DeepSpeed's own loader, and checked by
logits against the DeepSpeed model itself.

The conversions and our forward passes run in one worker process (this file as a script).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from convert_fixtures import save_tiny_hf  # noqa: E402
from skeleton_helpers import run_python  # noqa: E402

# stage 0 saves no partitions: the module's weights are read from its model-states file
STAGES = (0, 2, 3)
GEOMETRY = dict(seq_length=128, block_size=16, topk=2)


def _worker(root: Path) -> dict:
    from msa_model.convert.deepspeed_io import deepspeed_to_msa
    from msa_model.convert.verify import compare, hf_logits, our_logits

    results = {}
    for stage in STAGES:
        msa = root / f"msa{stage}"
        deepspeed_to_msa(str(root / f"zero{stage}"), str(msa), hf_config=str(root / "hf"), **GEOMETRY)
        ref = torch.load(root / f"zero{stage}_logits.pt")
        ours = our_logits(str(msa), ref["tokens"])
        results[stage] = {"vs_deepspeed": compare(ref["logits"], ours),
                          # the step moved the weights: the untrained model is far from the trained one
                          "untrained_vs_deepspeed": compare(hf_logits(str(root / "hf"), ref["tokens"]), ref["logits"])}
    return results


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepspeed")
    save_tiny_hf("llama", root / "hf")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             str(REPO / "tests" / "deepspeed_main.py"), str(root / "hf"), str(root), *map(str, STAGES)]
    proc = subprocess.run(train, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = root / "results.json"
    proc = run_python([__file__, str(root), str(out)], env, timeout=600)  # forked (tests/train_server.py)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return root, {int(k): v for k, v in json.loads(out.read_text()).items()}


@pytest.mark.parametrize("stage", STAGES)
def test_zero_checkpoint_converts_with_logits_parity(converted, stage):
    root, results = converted
    r = results[stage]
    print(f"ZeRO-{stage}: vs DeepSpeed {r['vs_deepspeed']}; untrained vs trained {r['untrained_vs_deepspeed']}")
    assert (root / f"zero{stage}" / "latest").is_file()
    assert r["vs_deepspeed"]["max_abs_diff"] <= 1e-4 and r["vs_deepspeed"]["mean_kl"] <= 1e-6
    assert r["untrained_vs_deepspeed"]["max_abs_diff"] > 1e-2
    record = json.loads((root / f"msa{stage}" / "conversion.json").read_text())
    assert record["kind"] == "deepspeed-to-msa" and record["family"] == "llama" and record["index_init"] == "derived"


def test_not_a_deepspeed_checkpoint(converted, tmp_path):
    """A directory without `latest` (e.g. the step directory itself) is refused, naming it; exit code 2."""
    root, _ = converted
    proc = run_python(["-m", "msa_model.convert", "deepspeed-to-msa", str(root / "zero2" / "global_step1"),
                       str(tmp_path / "out"), "--hf-config", str(root / "hf")], timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"error: {root / 'zero2' / 'global_step1'}: not a DeepSpeed checkpoint directory (no `latest` file)")
    assert not (tmp_path / "out").exists()


def test_config_found_in_a_trainer_checkpoint(converted, tmp_path):
    """The Hugging Face Trainer's checkpoint-N/ holds config.json beside `latest`: no --hf-config needed.
    Without one there, the error says to pass it, before anything is written."""
    import shutil

    root, _ = converted
    ckpt = tmp_path / "checkpoint-1"
    shutil.copytree(root / "zero2", ckpt)
    command = ["-m", "msa_model.convert", "deepspeed-to-msa", str(ckpt), str(tmp_path / "out"),
               "--seq-length", "128", "--block-size", "16", "--topk", "2"]
    proc = run_python(command)
    assert proc.returncode == 2 and not (tmp_path / "out").exists()
    assert proc.stderr.strip().splitlines()[-1] == (f"error: {ckpt}: no config.json beside the ZeRO checkpoint; pass "
                                                    "--hf-config DIR, the directory of the model's Hugging Face config.json")
    shutil.copy(root / "hf" / "config.json", ckpt)
    proc = run_python(command)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "conversion.json").read_text())
    assert record["family"] == "llama" and record["hf_config"] == json.loads((root / "hf" / "config.json").read_text())


if __name__ == "__main__":
    root_dir, out_file = Path(sys.argv[1]), Path(sys.argv[2])
    out_file.write_text(json.dumps(_worker(root_dir), indent=2))
