"""Data parallelism with real processes: DP=2 under torchrun (gloo) follows the same losses as
one process with the same global batch (fp32, CPU)."""

from __future__ import annotations

import pytest

from skeleton_helpers import metrics, run_train


@pytest.mark.slow
def test_dp2_matches_a_single_process(tmp_path, data_cache):
    cache = data_cache
    common = ("trainer.max_steps=3", "trainer.indexer_warmup_tokens=2048", "checkpoint.interval=0")
    run_train(tmp_path / "dp1", *common, data_cache=cache)
    run_train(tmp_path / "dp2", *common, data_cache=cache, nproc=2)
    one, two = metrics(tmp_path / "dp1"), metrics(tmp_path / "dp2")
    assert sorted(one) == sorted(two) == [1, 2, 3]
    assert [one[s]["phase"] for s in one] == ["warmup", "warmup", "sparse"]
    for step in one:
        for key in ("lm_loss", "kl_loss", "moe_aux_loss", "grad_norm"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-5), (step, key)
