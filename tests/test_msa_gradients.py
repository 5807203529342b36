"""The index branch's gradients at model level: stop-gradient in both directions, the KL
coefficient, and the index gradient norm apart from the rest (tests/msa_grads_main.py, in a
subprocess because megatron and the CPU shim stay out of the pytest process; forked from one that
has imported the trainer, tests/train_server.py)."""

from __future__ import annotations

from skeleton_helpers import TINY_TEST, _env, run_python


def test_kl_reaches_exactly_the_index_parameters_and_scales_with_its_coefficient():
    overrides = [o for o in TINY_TEST if not o.startswith("logging.")]
    # a CPU check (gloo, the CPU shim): on a GPU machine too, where megatron would otherwise place
    # rotary tables on the GPU beside the CPU model
    proc = run_python(["tests/msa_grads_main.py", *overrides], {**_env(), "CUDA_VISIBLE_DEVICES": ""}, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-5000:]
