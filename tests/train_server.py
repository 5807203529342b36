"""One-process runs of train.py for the tests, without paying for their imports every time.

A `python train.py` spends about 4 s of CPU importing torch, megatron-core and the trainer before
it composes its config, more than the few steps a test trains. A server (started on first use; a
test process has two, and one per rank of the largest job run_together has started) imports them
once and then forks a fresh process for each run: the child takes the run's environment,
working directory and argv, runs the script (or `-m MODULE`, or `-c CODE`, as python does) as
`__main__` with its stdout and stderr going to files of the caller's, and exits with the script's
exit code (atexit handlers run, as at any interpreter exit). Each run is still a process of its
own, which nothing has touched but those imports; it only does not show what the imports print
(tests/test_readme.py, tests/test_inputs.py and every torchrun, SLURM or signal test start real
processes for that).

What a fresh process would not share with the one before it, forked runs do not share either:
`random` (reseeded by Python at every fork) and numpy's global generator (reseeded here) start from
new entropy, and consecutive runs come from two servers in turn, each with its own string-hash seed
and memory layout. So two runs a test compares (a run and its resumed copy) differ in all that, as
two launches of train.py do, and a state a checkpoint forgets to restore still shows.

    skeleton_helpers.run_train / run_python  one-process runs, when no GPU is present
    run_together (tests/test_parallel.py)    the ranks of one job, each from a server of its own
    MSA_TEST_FORK=0 python -m pytest ...     every run a plain `python train.py` (torchrun) instead

Protocol, JSON lines over the server's stdin/stdout: {"argv", "cwd", "env", "stdout", "stderr",
"timeout"} -> {"pid"} at once, then {"code", "timed_out"} when the run is over (a run over its
timeout is killed).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ---- the server --------------------------------------------------------------------------------

def _preload() -> None:
    """What train.py imports before and during its first step, in its order (msa_model first)."""
    import msa_model  # noqa: F401
    import hydra  # noqa: F401
    import omegaconf  # noqa: F401

    import msa_model.config  # noqa: F401
    import msa_model.model.gpt  # noqa: F401
    import msa_model.training.checkpoint  # noqa: F401
    import msa_model.training.failures  # noqa: F401
    import msa_model.training.inputs  # noqa: F401
    import msa_model.training.model_source  # noqa: F401
    import msa_model.training.run  # noqa: F401
    import msa_model.training.trainer  # noqa: F401
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.distributed  # noqa: F401
    import megatron.core.optimizer  # noqa: F401


def _exit_code(code) -> int:
    """What the interpreter makes of SystemExit(code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _child(request: dict) -> None:
    """The run, in the forked process; never returns."""
    code = 1
    try:
        stdin = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd, target in ((stdin, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import torch

        # the server imported with one thread; a run gets its own count, or the machine's cores
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))))
        import numpy

        numpy.random.seed()  # fresh entropy, as at a process's first import of numpy
        argv = list(request["argv"])
        module = argv[1] if argv[0] == "-m" else None  # `python -m MODULE ARGS...`
        code_text = argv[1] if argv[0] == "-c" else None  # `python -c CODE ARGS...`
        if module:
            sys.argv = argv[1:]  # argv[0] becomes the module's file, as under `python -m`
            sys.path[0] = os.getcwd()
        elif code_text is not None:
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
        else:
            script = os.path.abspath(argv[0])
            sys.argv = argv
            sys.path[0] = os.path.dirname(script)
        import runpy
        import traceback

        try:
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            elif code_text is not None:
                import types

                main = sys.modules["__main__"] = types.ModuleType("__main__")  # this file's stays as it was
                exec(compile(code_text, "<string>", "exec"), main.__dict__)
            else:
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def serve() -> None:
    _preload()
    # a fork copies only the thread that calls it: the imports must have started none
    assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1, "threads before fork"
    # the protocol gets a descriptor of its own; anything else printed here goes to the log
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    print("ready", file=protocol, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        protocol.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            protocol.close()
            _child(request)
        print(json.dumps({"pid": pid}), file=protocol, flush=True)
        deadline, timed_out = time.monotonic() + request["timeout"], False
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                timed_out = True
                break
            time.sleep(0.02)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status), "timed_out": timed_out}), file=protocol,
              flush=True)


# ---- the client ----------------------------------------------------------------------------------

class Server:
    def __init__(self, env: dict):
        self.log = tempfile.NamedTemporaryFile(prefix="msa-train-server-", suffix=".log", delete=False)
        # one thread while it imports (OpenMP's pool would not survive a fork); each run sets its own
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], cwd=REPO,
                                     env={**env, "OMP_NUM_THREADS": "1"}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, bufsize=0)
        self.buffer = b""
        if self.line() != "ready":
            raise RuntimeError(f"tests/train_server.py did not start: {self.log_tail()}")

    def log_tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def line(self, timeout: float | None = None) -> str | None:
        """The server's next line; None if none came within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError(f"tests/train_server.py exited: {self.log_tail()}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    def start(self, argv: list[str], cwd: Path, env: dict, timeout: float, out: Path, err: Path) -> int:
        """Fork the run; its pid."""
        request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err),
                   "timeout": timeout}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        return json.loads(self.line())["pid"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


_SERVERS: list[Server] = []
_TURN = [0]


def _server(i: int, env: dict) -> Server:
    while len(_SERVERS) <= i:
        _SERVERS.append(None)
    if _SERVERS[i] is None or _SERVERS[i].proc.poll() is not None:
        _SERVERS[i] = Server(env)
        atexit.register(_SERVERS[i].close)
    return _SERVERS[i]


def _completed(argv: list[str], reply: dict, out: Path, err: Path, timeout: float,
               raise_timeout: bool = True) -> subprocess.CompletedProcess:
    stdout = out.read_text(errors="replace") if out.exists() else ""
    stderr = err.read_text(errors="replace") if err.exists() else ""
    cmd = [sys.executable, *argv]
    if reply["timed_out"]:
        if raise_timeout:
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
        stderr += f"\n(killed after its timeout of {timeout} s)"
    return subprocess.CompletedProcess(cmd, reply["code"], stdout, stderr)


def run(argv: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`python *argv` as a forked child of one of this process's two servers, in turn (each started
    on first use with `env`, which must hold what the imports read, e.g. TRITON_INTERPRET)."""
    turn = _TURN[0]
    _TURN[0] = 1 - turn
    server = _server(turn, env)
    with tempfile.TemporaryDirectory(prefix="msa-train-run-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        server.start(argv, cwd, env, timeout, out, err)
        return _completed(argv, json.loads(server.line()), out, err, timeout)


def run_together(runs: list[tuple[list[str], dict]], cwd: Path, timeout: float) -> list[subprocess.CompletedProcess]:
    """Processes that run at once, (argv, env) each: the ranks of one job, rank r forked from server
    r, so that, as under torchrun, no two ranks share a hash seed or a memory layout. A rank that
    fails has the others killed (they would wait for it in a collective)."""
    with tempfile.TemporaryDirectory(prefix="msa-train-run-") as tmp:
        files = [(Path(tmp) / f"stdout{r}", Path(tmp) / f"stderr{r}") for r in range(len(runs))]
        servers = [_server(r, env) for r, (_, env) in enumerate(runs)]
        pids = [server.start(argv, cwd, env, timeout, *files[r])
                for r, (server, (argv, env)) in enumerate(zip(servers, runs))]
        replies: dict[int, dict] = {}
        while len(replies) < len(runs):
            for r, server in enumerate(servers):
                if r not in replies:
                    line = server.line(timeout=0.05)
                    if line is not None:
                        replies[r] = json.loads(line)
            if any(reply["code"] or reply["timed_out"] for reply in replies.values()):
                for r, pid in enumerate(pids):
                    if r not in replies:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
        return [_completed(argv, replies[r], *files[r], timeout, raise_timeout=False)
                for r, (argv, _) in enumerate(runs)]


def enabled() -> bool:
    """Forked runs on CPU machines (a CUDA process is not forked) unless MSA_TEST_FORK=0."""
    if os.environ.get("MSA_TEST_FORK", "1") == "0" or not hasattr(os, "fork"):
        return False
    import torch

    return not torch.cuda.is_available()


if __name__ == "__main__":
    sys.path[0] = str(REPO)  # as for `python train.py`, whose directory this is
    serve()
