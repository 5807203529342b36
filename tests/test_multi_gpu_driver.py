"""bench/multi_gpu.py, the driver of the multi-GPU runs, end to end on the CPU (--cpu: a 2-layer tiny
model, 2 gloo processes under torchrun): the parity part (TP 2 + SP against one process, both from
the weights `init` saved) and the preemption drill (SIGUSR1 to the launcher and its ranks once a
checkpoint exists, every rank's stop save, the relaunch through the run's launch.sh, and every
logged number of the resumed steps against an uninterrupted run's), on a blend of two datasets
prepared from site-packages with the validation loss. A second call finds everything done and
runs nothing; a call whose budget fits no job starts none and names each."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from skeleton_helpers import REPO, _env


def _driver(work, out, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "bench/multi_gpu.py", "--cpu", "--work", str(work), "--out", str(out), *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_parity_and_the_preemption_drill_then_resume_and_budget(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    args = ("--parts", "parity,preempt", "--layouts", "tp2", "--steps", "2", "--budget", "500")
    proc = _driver(work, out, *args)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    report = json.loads((out / "multi_gpu.json").read_text())
    jobs = report["jobs"]
    assert sorted(jobs) == sorted(["parity/init", "parity/1gpu", "parity/tp2", "preempt/prepare0",
                                   "preempt/prepare1", "preempt/stopped", "preempt/resumed", "preempt/uninterrupted"])
    assert all(r["status"] == "ok" for r in jobs.values()), {n: r.get("error") for n, r in jobs.items()}

    # parity: the losses of two real steps of each run, compared step by step
    ref = [r["lm_loss"] for r in jobs["parity/1gpu"]["records"]]
    tp2 = [r["lm_loss"] for r in jobs["parity/tp2"]["records"]]
    assert len(ref) == len(tp2) == 2 and all(2.0 < x < 8.0 for x in ref + tp2)
    [row] = report["parts"]["parity"]["layouts"]
    assert row["job"] == "parity/tp2" and row["steps"] == 2
    assert [(r["ref"], r["lm_loss"]) for r in row["rows"]] == list(zip(ref, tp2))
    assert row["max_abs"] == max(abs(a - b) for a, b in zip(ref, tp2)) and row["max_rel"] < 1e-5 and row["agrees"]
    assert jobs["parity/tp2"]["world"] == 2 and "--nproc-per-node=2" in jobs["parity/tp2"]["command"]

    # the drill: signalled after a checkpoint, stopped with a save of both ranks, resumed by launch.sh
    drill = report["parts"]["preempt"]
    stopped, resumed = drill["stopped"], drill["resumed"]
    stop = stopped["stop_step"]
    assert stopped["signal_after_step"] >= 3 and stopped["checkpoint_then"].startswith("step_")
    assert stopped["signal_after_step"] <= stop < 10
    assert stopped["ranks_saved"] == [0, 1] and stopped["latest"] == f"step_{stop:08d}" and stopped["manifest"]
    assert resumed == {"resumed_from": f"step_{stop:08d}", "resumed_at": stop}
    assert jobs["preempt/resumed"]["command"].startswith("bash ") and "launch.sh" in jobs["preempt/resumed"]["command"]
    # the resumed steps against the uninterrupted run's, every logged number, validation included
    assert drill["steps"] == 10 and drill["after_resume"] == list(range(stop + 1, 11))
    assert {"lm_loss", "grad_norm", "valid/lm_loss", "valid/kl_loss"} <= set(drill["keys"])
    assert drill["identical"] and drill["identical_after_resume"] and not drill["differing_steps"]
    a, b = jobs["preempt/resumed"]["records"], jobs["preempt/uninterrupted"]["records"]
    assert [r["lm_loss"] for r in a] == [r["lm_loss"] for r in b] and len(a) == 10
    assert [v["step"] for v in drill["validation"]] == [2, 4, 6, 8, 10]
    assert all(v["resumed"] == v["uninterrupted"] and v["resumed"] > 0 for v in drill["validation"])
    # the indexer warmup ends after the resume: the relaunch restored its state
    assert [r["phase"] for r in drill["lm_loss"]] == ["warmup"] * 5 + ["sparse"] * 5
    assert all(v["tokens"] > 0 for v in drill["prepared"].values())

    md = (out / "multi_gpu.md").read_text()
    assert "| TP 2 + SP | 2 |" in md and "identical to the uninterrupted run's, bit for bit" in md
    assert f"stopped by SIGUSR1 after step {stop}" in md and "bash " in md

    # the same command again: everything is done, nothing starts, the report is the same
    again = _driver(work, out, *args)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "parity: done in an earlier call" in again.stdout and "preempt: done in an earlier call" in again.stdout
    assert ": started" not in again.stdout
    assert json.loads((out / "multi_gpu.json").read_text())["parts"]["preempt"]["identical"]

    # a budget no job fits: nothing starts, and the report says why for each job
    tight = _driver(work, tmp_path / "tight", "--parts", "cp", "--budget", "3")
    assert tight.returncode == 3, tight.stdout[-3000:]
    skipped = json.loads((tmp_path / "tight" / "multi_gpu.json").read_text())["call"]["skipped"]
    assert skipped["cp/init"].startswith("needs about") and skipped["cp/parity_cp2"] == "waits for cp/init"
    assert skipped["cp/speed_cp2_1K"].startswith("needs about")
    assert ": started" not in tight.stdout and not list((work / "results").glob("cp__*"))
