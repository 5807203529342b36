"""A fatal error on one rank is said once, by that rank, with its rank and host, and reaches the
job's log; every other rank stops with one line naming it (msa_model/training/failures.py).

The protocol with real processes over a real TCPStore (cheap), then a real bad input that only
rank 1 sees in a two-rank torchrun job: its data.cache_dir (MSA_DATA_CACHE_DIR, resolved on each
node) names a directory rank 0 does not write, as a node-local scratch path would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from skeleton_helpers import REPO, TINY_TEST, _env, free_port

# rank argv[2] of argv[3] on node argv[4]: watches the job's store at port argv[1], then does
# argv[5]: fail (a bad input of its own), crash (a bug), lost (a collective broken by a peer that
# vanished), or idle (busy elsewhere, as in a long step or a collective: the watcher stops it)
RANK = """
import os, sys, time
port, rank, world, node, action = sys.argv[1:6]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=rank, SLURMD_NODENAME=node)
from msa_model.training import failures
failures.watch(int(rank), int(world))
print("watching", flush=True)
while not os.path.exists(sys.argv[6]):
    time.sleep(0.01)
if action == "fail":
    failures.fail("the data cache is not there on this node", 2)
if action == "crash":
    try:
        {}["missing"]
    except KeyError as e:
        failures.crash(e)
if action == "lost":
    # what gloo raises in a collective whose peer is gone
    failures.crash(RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                                "peer [10.0.0.2]:4711. This is typically caused by a remote worker crashing."))
if action == "idle":
    time.sleep(120)
"""


def _job(tmp_path: Path, actions: list[str], world_size: int = 0) -> list[tuple[int, str]]:
    """Run one process per action, ranks 0.. of `world_size` (default: as many as actions);
    (exit code, stderr) of each."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    go = tmp_path / "go"
    world = str(world_size or len(actions))
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(port), str(r), world, f"node{r + 1}", a, str(go)],
                              cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, a in enumerate(actions)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "watching", p.communicate(timeout=60)
        go.touch()
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        del store
    return [(p.returncode, err) for p, (_, err) in zip(procs, outs)]


def test_the_same_error_on_two_ranks_is_heard_once_and_the_other_rank_names_it(tmp_path):
    """Whichever rank records it first says it; the other says one line naming that rank (an idle
    rank, stopped by its watcher: test_a_crash_shows_its_traceback_once)."""
    results = _job(tmp_path, ["fail", "fail"])
    errors = [(r, err.strip()) for r, (_, err) in enumerate(results) if err.startswith("error: ")]
    assert len(errors) == 1, results
    failed, line = errors[0]
    assert line == f"error: [rank {failed} on node{failed + 1}] the data cache is not there on this node"
    other = 1 - failed
    stop = f"[rank {other} on node{other + 1}] stopping: rank {failed} on node{failed + 1} failed"
    assert results[other][1].strip() == stop, results
    # the job ends the way its failing rank did (2: bad input)
    assert [rc for rc, _ in results] == [2, 2]


def test_a_crash_shows_its_traceback_once(tmp_path):
    (rc0, err0), (rc1, err1) = _job(tmp_path, ["crash", "idle"])
    lines = err0.strip().splitlines()
    assert lines[0] == "error: [rank 0 on node1] KeyError: 'missing'", err0
    assert lines[1] == "Traceback (most recent call last):" and lines[-1] == "KeyError: 'missing'", err0
    assert err1.strip() == "[rank 1 on node2] stopping: rank 0 on node1 failed", err1
    assert rc0 == rc1 == 1


def test_a_peer_that_vanished_without_a_word_is_said_so(tmp_path):
    """A collective broken by a rank that was killed (nothing recorded): one line, no traceback."""
    ((rc, err),) = _job(tmp_path, ["lost"], world_size=2)
    assert err.strip() == ("[rank 0 on node1] stopping: lost another rank of the job, which stopped without a message "
                           "(killed, out of memory, or its node failed?): Connection closed by peer [10.0.0.2]:4711")
    assert rc == 1


@pytest.mark.slow
def test_a_bad_input_only_rank_1_sees_reaches_the_log_once(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    node_local = tmp_path / "node-local"
    # each rank resolves data.cache_dir from its own environment; rank 1's names another directory
    per_rank = f'if [ "$RANK" = 1 ]; then export MSA_DATA_CACHE_DIR={node_local}; fi; exec "$0" "$@"'
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--master-port={free_port()}", "--no-python", "bash", "-c", per_rank, sys.executable, "train.py",
           *TINY_TEST, "trainer.max_steps=2", "trainer.indexer_warmup_tokens=1024", f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, env={**_env(), "MSA_DATA_CACHE_DIR": str(data_cache)}, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    error = (f"error: [rank 1 on {host}] data cache {node_local}/stdlib-")
    stop = f"[rank 0 on {host}] stopping: rank 1 on {host} failed"
    assert out.count("error: ") == 1 and error in out and "does not exist after rank 0" in out, out[-4000:]
    assert stop in out, out[-4000:]
    # rank 0 neither hangs nor dumps the broken collective
    assert "Connection closed by peer" not in out and "gloo" not in out, out[-4000:]
    log = (run_dir / "train.log").read_text().splitlines()
    assert error in log[-2] and log[-1].endswith(stop), log[-3:]
    assert "failed (exitcode: 2)" in out  # torchrun's own report: the job failed as its rank 1 did
    # and its summary, the job's last lines, ends with the error (from rank 1, or from rank 0's stop)
    last = proc.stderr.strip().splitlines()[-2]
    said = (f"[rank 1 on {host}] data cache {node_local}/stdlib-",
            f"{stop}: data cache {node_local}/stdlib-")
    assert any(s in last for s in said), proc.stderr[-3000:]


def test_torchrun_ends_with_the_configuration_error(tmp_path):
    """A two-rank torchrun job whose configuration is wrong only for its layout (a global batch of 6
    is no multiple of micro batch 2 x dp 2): after torchrun's own traceback, its summary of the
    failed ranks ends with the error, not with a link to torchrun's documentation."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--master-port={free_port()}", "train.py", "parallel.micro_batch_size=2",
           "parallel.global_batch_size=6", f"run_dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    problem = "parallel.global_batch_size (6) must be a multiple of parallel.micro_batch_size * dp (2 * 2)"
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "error: invalid configuration:" in lines, proc.stderr[-3000:]
    assert "ChildFailedError" in proc.stderr, proc.stderr[-3000:]
    assert any(problem in line for line in lines[-3:]), lines[-12:]
    assert not (tmp_path / "run").exists()


def test_a_port_in_use_is_said_by_the_rank_that_meets_it(tmp_path, data_cache):
    """Rank 0 of a two-rank job whose MASTER_PORT another process holds (under Hydra's submitit
    launcher such an error was kept in the job's result and the rank said nothing): one line with
    its rank and host, the address, exit code 2, nothing trained."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "2",
               "LOCAL_RANK": "0", "SLURMD_NODENAME": "node1", "MSA_DATA_CACHE_DIR": str(data_cache)}
        proc = subprocess.run([sys.executable, "train.py", *TINY_TEST, "trainer.max_steps=2",
                               "trainer.indexer_warmup_tokens=1024", f"run_dir={tmp_path / 'run'}"], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=300)
    err = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(err) == 1 and err[0].startswith("error: [rank 0 on node1] rank 0 of 2 could not start the process "
                                               f"group at 127.0.0.1:{port} ("), err
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_never_came_is_said_after_the_timeout(tmp_path, data_cache, rank):
    """A two-rank job of which one rank failed before the process group (under submitit nothing
    stops the others): the other waits parallel.timeout_minutes, not torch's 30 minutes, then says
    in one line what it waited for; exit code 2, nothing trained."""
    port = free_port()
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2",
           "LOCAL_RANK": "0", "SLURMD_NODENAME": "node1", "MSA_DATA_CACHE_DIR": str(data_cache)}
    proc = subprocess.run([sys.executable, "train.py", *TINY_TEST, "trainer.max_steps=2", "trainer.indexer_warmup_tokens=1024",
                           "parallel.timeout_minutes=0.05", f"run_dir={tmp_path / 'run'}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    err = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = {0: f"rank 0 of 2: 1 of 2 ranks joined the process group at 127.0.0.1:{port} within 3 s "
               "(parallel.timeout_minutes=0.05); the missing ranks' logs say why they did not start",
            1: f"rank 1 of 2 could not reach rank 0's process group at 127.0.0.1:{port} within 3 s "
               "(parallel.timeout_minutes=0.05): did rank 0 fail at start? ("}[rank]
    assert len(err) == 1 and err[0].startswith(f"error: [rank {rank} on node1] {said}"), err
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()
