"""`ServerProcess`: one inference server process this run starts, owns and stops (no orphans).

Shared by the engines Relax launches itself (`relax serve` for ``--rollout-engine-protocol relax``, vLLM for
``vllm``): start a Python module as a server in its own session (so one signal reaches the whole process group,
engine children included), tie its life to ours (it gets SIGTERM when the thread that started it dies, even by
SIGKILL), wait for its ``/health``, report its exit with the tail of its log, and stop or kill it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

from relax.backends.inference.remote.sglang import EngineUnavailableError, HTTPClient

# Runs in the server's interpreter before the server module: asks the kernel to SIGTERM the server when its parent
# dies, even by SIGKILL, so a crashed trainer leaves no server behind. Done here rather than in a Popen
# preexec_fn, which is unsafe in a threaded parent; the setting survives exec. The kernel's "parent" is the thread
# that started the server: start it from a long-lived one (the event loop's), never from a worker thread.
DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit('parent exited before the server started')\n"
    "os.execv(sys.executable, [sys.executable, '-m', *sys.argv[2:]])\n"
)


def stop_group(process: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM the process group, give it ``timeout_s`` to exit, then SIGKILL what is left (a stopped process
    cannot act on SIGTERM, so it is killed after the wait too)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and group_alive(process):
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout_s)  # reap the group leader


def group_alive(process: subprocess.Popen) -> bool:
    process.poll()  # reaps the leader once it exits, so only live members keep the group
    try:
        os.killpg(process.pid, 0)
        return True
    except ProcessLookupError:
        return False


async def wait_until_free(host: str, port: int, timeout_s: float) -> None:
    """Wait (bounded) until ``host:port`` can be bound: a server of a previous run process (a global restart) may
    still be shutting down on it; the new one would otherwise fail to bind and exit. Call before `start`."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
            try:
                probe.bind((host, port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    return  # the server's own error (address in use) is then reported with its log
        await asyncio.sleep(0.2)


class ServerProcess:
    """``python -m <module> <args>`` serving on ``host:port``, its output appended to ``log_path``."""

    def __init__(self, name: str, host: str, port: int, log_path: Path, python: Path | str,
                 stop_timeout_s: float = 30.0) -> None:
        self.name = name  # "vLLM", "relax serve": for messages
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"
        self.log_path = log_path
        self.python = Path(python)
        self.stop_timeout_s = stop_timeout_s
        self.starts = 0
        self._process: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None

    def start(self, module: str, args: Sequence[str], env: Mapping[str, str], banner: str = "") -> None:
        """Start the server (stopping a previous one first). Call from a long-lived thread (see DIE_WITH_PARENT)."""
        self.stop()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== {time.strftime('%H:%M:%S')} starting {self.name} on {self.url} {banner}\n".encode())
            log.flush()
            # Own session: stop() and kill() signal the whole group, engine children included.
            self._process = subprocess.Popen([str(self.python), "-c", DIE_WITH_PARENT, str(os.getpid()), module,
                                              *args], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=dict(env), start_new_session=True)
        self.starts += 1
        # Also stopped when this object is collected or the interpreter exits without calling stop().
        self._finalizer = weakref.finalize(self, stop_group, self._process, self.stop_timeout_s)

    @property
    def started(self) -> bool:
        return self._process is not None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    async def wait_ready(self, http: HTTPClient, timeout_s: float) -> None:
        """Poll ``GET /health`` until it answers, the process exits (error with the log's tail), or timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                await http.request("GET", "/health", timeout_s=5.0)
                return
            except EngineUnavailableError:
                await asyncio.sleep(0.5)
        raise TimeoutError(f"{self.name} at {self.url} did not become ready within {timeout_s:.0f} s; log "
                           f"{self.log_path} ends:\n{self.log_tail()}")

    def check_alive(self) -> None:
        if self._process is None:
            raise EngineUnavailableError(f"{self.name} at {self.url} is not started", self.url, "/health")
        code = self._process.poll()
        if code is not None:
            tail = self.log_tail()
            last = next((line for line in reversed(tail.splitlines()) if line.strip()), "")
            # The last line first (a short form of the error is often cut to its first few hundred characters).
            raise EngineUnavailableError(f"{self.name} at {self.url} exited with code {code} ({last.strip()[:200]}); "
                                         f"log {self.log_path} ends:\n{tail}", self.url, "/health")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self) -> None:
        """Graceful: SIGTERM, then SIGKILL after ``stop_timeout_s``."""
        if self._finalizer is not None:
            self._finalizer()  # runs stop_group once; later calls and interpreter exit do nothing
        self._process, self._finalizer = None, None

    def kill(self) -> None:
        """At once: SIGKILL the group (for a server that is hung or stopped and will be replaced)."""
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(10)
        if self._finalizer is not None:
            self._finalizer.detach()
        self._process, self._finalizer = None, None
