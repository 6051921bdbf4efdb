"""The real `relax` command in its own process, on the tiny workspace of `tests/conftest.py` (``tiny_workspace``).

A `relax` process spends seconds of CPU importing torch and transformers before it does anything, and the suite
starts a few hundred of them; on two cores that import was most of the suite's time. So `run_relax` forks each run
from a process that imported them once (Python's forkserver, one per test worker): the run is still a process of
its own (its own pid, signals, exit code, stdout and stderr, environment and working directory), started from a
clean interpreter that never ran a test; `popen_relax` does the same for a run the test drives itself (signals,
polling, a server it talks to) and returns it with `subprocess.Popen`'s members. Runs that need a fresh interpreter
(their ``env`` names a ``PYTHONPATH``, for the fault injection of `tests/support/fault_injection/sitecustomize.py`;
Ctrl-C during the imports) start `python -m relax.cli.main` as before. ``RELAX_TEST_FORKSERVER=0`` turns the
forkserver off.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository
# A subprocess's limit: far above any run's expected time (a few minutes at most), so that a loaded machine (the
# suite beside other work, at many times the cores' load) slows a test down and never fails it; a hung run still ends.
SUBPROCESS_TIMEOUT_S = 1800
# What the forkserver imports once, so that the runs forked from it do not.
PRELOADED = ["relax.cli.main", "relax.cli.train", "relax.cli.evaluate", "relax.cli.export", "matplotlib.figure"]

_context: multiprocessing.context.ForkServerContext | None = None


def tiny_train_args(workspace: Path, output_dir: Path, *extra: str) -> list[str]:
    """`relax train` arguments of a small GRPO run on the tiny model and its addition data."""
    return [
        "--hf-checkpoint", str(workspace / "model"), "--prompt-data", str(workspace / "train.jsonl"),
        "--eval-prompt-data", "held_out", str(workspace / "test.jsonl"),
        "--custom-rm-path", "tests.support.e2e_rewards:digit_fraction",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4",
        "--micro-batch-size", "4", "--lr", "1e-3", "--rollout-shuffle", "--output-dir", str(output_dir),
        *extra,
    ]


def run_torchrun(nproc: int, *relax_args: str, attempts: int = 3) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc relax ...`` on the loopback, with the gloo settings of the suite. The master
    port is picked free and bound later by torchrun's agent, so another process can take it in between (seen in CI:
    EADDRINUSE at the rendezvous, before any rank started): that run is started again on a new port, up to
    ``attempts`` times; any other failure is returned as it is."""
    from relax.distributed.process_group import free_loopback_port

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    for _ in range(attempts):
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
                   "127.0.0.1", "--master-port", str(free_loopback_port()), "-m", "relax.cli.main", *relax_args]
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=SUBPROCESS_TIMEOUT_S)
        if result.returncode == 0 or "EADDRINUSE" not in result.stderr:
            return result
    return result


def run_ranks(nproc: int, *relax_args: str, timeout: float = SUBPROCESS_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``relax ARGS`` as ``nproc`` ranks of one process group: each a process forked from this worker's forkserver
    (`ForkedRelax`) with the variables torchrun gives a rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``) and a file rendezvous (``RELAX_PG_INIT_METHOD``, so no port can be taken in between):
    `run_torchrun`'s run without torchrun's agent and each rank's imports. Once a rank fails, the others get 60 s
    before they are killed (they may wait in a collective for it). The exit code is the first failing rank's (0
    when all succeed); stdout and stderr are every rank's, rank 0's first."""
    from relax.distributed.process_group import PG_INIT_METHOD_ENV

    with tempfile.TemporaryDirectory(prefix="relax-ranks-") as scratch:
        common = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "WORLD_SIZE": str(nproc),
                  "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                  PG_INIT_METHOD_ENV: f"file://{scratch}/rendezvous"}
        ranks = [ForkedRelax(list(relax_args), {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)})
                 for rank in range(nproc)]
        deadline = time.monotonic() + timeout
        while any(rank.poll() is None for rank in ranks):
            if any(rank.returncode not in (None, 0) for rank in ranks):
                deadline = min(deadline, time.monotonic() + 60)
            if time.monotonic() > deadline:
                for rank in ranks:
                    rank.kill()
                break
            time.sleep(0.1)
        outputs = [rank.communicate(timeout=30) for rank in ranks]
    code = next((rank.returncode for rank in ranks if rank.returncode), 0)
    return subprocess.CompletedProcess(["relax", *relax_args], code, "".join(out for out, _ in outputs),
                                       "".join(err or "" for _, err in outputs))


def assert_ranks_take_the_one_process_steps(args_of, root: Path, steps: int, *rank_flags: str,
                                            nproc: int = 2, abs_tol: float = 1e-7) -> tuple[Path, Path]:
    """``relax <args_of(out)>`` once in one process (``root/one``) and once on ``nproc`` ranks (`run_ranks`) with
    ``rank_flags`` added (``root/two``); both succeed, log ``steps`` training rows with the same metrics, and
    every step's ``train/`` metric (timings aside) agrees to 1e-5 relative, ``abs_tol`` absolute. Returns the two run
    directories."""
    from relax.telemetry.metrics_file import read_metrics

    one, two = root / "one", root / "two"
    result = run_relax(*args_of(one))
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_ranks(nproc, *args_of(two, *rank_flags))
    assert result.returncode == 0, result.stderr[-4000:]
    expected, got = ([{k: v for k, v in row.items() if k.startswith("train/")}
                      for row in read_metrics(out / "metrics.jsonl") if "train/loss" in row] for out in (one, two))
    assert len(got) == len(expected) == steps
    for step, (row, reference) in enumerate(zip(got, expected), start=1):
        assert row.keys() == reference.keys(), step
        for key, value in reference.items():
            if not (key.endswith("_s") or "time" in key):
                assert row[key] == pytest.approx(value, rel=1e-5, abs=abs_tol), (step, key)
    return one, two


def run_relax(*args: str, timeout: float = SUBPROCESS_TIMEOUT_S, env: dict[str, str] | None = None,
              **popen_kwargs) -> subprocess.CompletedProcess:
    """`relax ...` in a process of its own, from the repository root (so `tests.*` reward paths import); ``env``
    adds variables to this process's environment. Returns its exit code, stdout and stderr.

    Forked from the worker's forkserver (`ForkedRelax`) unless a ``PYTHONPATH`` in ``env`` must reach the process
    (the fault injection's `sitecustomize` loads only in a fresh interpreter), or ``popen_kwargs`` ask for
    `subprocess.run`. A supervised `relax train` (--max-global-restart) is forked even then: its runs, where
    anything is injected, are the children it starts itself, fresh interpreters with its environment."""
    fresh = "PYTHONPATH" in (env or {}) and not _supervised(args)
    if popen_kwargs or fresh or not _forking():
        return subprocess.run([sys.executable, "-m", "relax.cli.main", *args], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, capture_output=True,
                              text=True, timeout=timeout, **popen_kwargs)
    return _forked_run(list(args), env, timeout)


def _supervised(args: tuple[str, ...]) -> bool:
    """`relax train ... --max-global-restart N` with N > 0: the process is the supervisor of its runs."""
    try:
        restarts = args[args.index("--max-global-restart") + 1]
    except (ValueError, IndexError):
        return False
    return args[0] == "train" and restarts.isdigit() and int(restarts) > 0


def forkserver() -> multiprocessing.context.ForkServerContext:
    """This test worker's forkserver, which imports `PRELOADED` (torch, transformers, the CLI) once when it starts:
    the processes forked from it skip those imports (Python keeps one forkserver per process; its preload is set
    here, before anything starts it)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOADED)
    return _context


def start_ranks(target, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.start_processes(target, args, nprocs)`` (each rank gets its index first; joined,
    a rank's exception raised here) with the ranks forked from `forkserver`, not spawned: a spawned rank imported
    torch and transformers afresh, about 4 s of CPU each on the suite's machine. Like spawn, a rank starts from a
    clean interpreter that never ran a test; it gets the forkserver's environment, so a rank sets what it needs."""
    import torch.multiprocessing as mp

    forkserver()
    mp.start_processes(target, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def _forking() -> bool:
    return os.environ.get("RELAX_TEST_FORKSERVER") != "0"


def popen_relax(*args: str, env: dict[str, str] | None = None, merge_stderr: bool = False):
    """`relax ARGS` started and left running, for a test that drives it: `ForkedRelax`, or (with a ``PYTHONPATH``
    in ``env``, or ``RELAX_TEST_FORKSERVER=0``) `subprocess.Popen` of ``python -m relax.cli.main`` with its output in
    pipes; either way ``communicate`` gives its stdout and stderr (None when merged)."""
    if _forking() and "PYTHONPATH" not in (env or {}):
        return ForkedRelax(list(args), env, merge_stderr)
    return subprocess.Popen([sys.executable, "-m", "relax.cli.main", *args], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True)


class ForkedRelax:
    """`relax ARGS` forked from this worker's forkserver and left running, with the members of `subprocess.Popen`
    the tests use (``pid``, ``args``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``,
    ``communicate``, and ``stdout``/``stderr`` to read once it ended). Its streams go to files, not pipes, so a
    run that writes much never blocks on a reader; ``merge_stderr`` writes both to one (``stderr=STDOUT``). A test
    that needs a fresh interpreter (the fault injection's ``PYTHONPATH``; Ctrl-C during the imports) keeps
    `subprocess.Popen`."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, merge_stderr: bool = False) -> None:
        self.args = ["relax", *args]
        self._scratch = tempfile.TemporaryDirectory(prefix="relax-run-")
        self._out = Path(self._scratch.name) / "stdout"
        self._err = self._out if merge_stderr else Path(self._scratch.name) / "stderr"
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self._process = forkserver().Process(
            target=_relax_main, args=(list(args), full_env, str(ROOT), str(self._out), str(self._err)))
        self._process.start()
        self.pid = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    @property
    def stdout(self) -> io.StringIO:
        return io.StringIO(_text(self._out))

    @property
    def stderr(self) -> io.StringIO:
        return io.StringIO(_text(self._err))

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Wait for the exit (`subprocess.TimeoutExpired` after ``timeout``), then the run's stdout and stderr
        (None when merged into stdout)."""
        self.wait(timeout)
        return _text(self._out), None if self._err == self._out else _text(self._err)


def _forked_run(args: list[str], env: dict[str, str] | None, timeout: float) -> subprocess.CompletedProcess:
    process = ForkedRelax(args, env)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:  # as subprocess.run's timeout: kill, then say so
        process.kill()
        stdout, stderr = process.communicate()
        raise subprocess.TimeoutExpired(process.args, timeout, stdout, stderr) from None
    stdout, stderr = process.communicate()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _relax_main(args: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the forked process: the environment, directory and standard streams of `python -m relax.cli.main`, then
    the command; it ends as that process would (its exit code, and its exit handlers run)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = ["relax", *args]
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
    if err == out:  # one file for both (stderr=STDOUT): one descriptor, so neither overwrites the other
        os.dup2(1, 2)
    else:
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stdout until it exits
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    from relax.cli.main import main

    try:
        code = main(args)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback on stderr, exit 1
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # a forked process skips them; `python -m relax...` runs them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
