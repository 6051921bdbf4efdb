"""A silent process that is only starved of CPU is not a hung one (`relax.core.state.liveness`): real processes,
real signals; a heartbeat that stops while its process computes is waited for, one whose process is stopped or
blocked is a verdict, and the wait is bounded."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from relax.core.state.health import HEARTBEAT_DIR, HealthMonitor, RoleFailedError
from relax.core.state.liveness import STARVED_LIMIT_FACTOR, SilenceJudge, process_activity
from tests.support.waits import PROCESS_PATIENCE_S, wait_until

COMPUTES = "x = 0\nwhile True:\n    x += 1\n"  # works, never beats (as a role whose beat thread gets no CPU)
BLOCKS = "import time\ntime.sleep(600)\n"  # neither works nor beats (as a role stuck in a wait that never ends)


@pytest.fixture
def child():
    started: list[subprocess.Popen] = []

    def start(code: str) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", code])
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        process.wait(10)


def _until(predicate, timeout_s: float = PROCESS_PATIENCE_S) -> None:
    wait_until(predicate, timeout_s, "the condition", interval_s=0.05)


def test_activity_tells_computing_blocked_and_stopped_apart(child):
    computing, blocked = child(COMPUTES), child(BLOCKS)
    _until(lambda: process_activity(computing.pid).cpu_s > 0.05)
    busy = process_activity(computing.pid)
    assert busy.runnable and not busy.stopped
    _until(lambda: not process_activity(blocked.pid).runnable)
    idle = process_activity(blocked.pid)
    assert not idle.runnable and not idle.stopped
    os.kill(computing.pid, signal.SIGSTOP)
    _until(lambda: process_activity(computing.pid).stopped)
    assert not process_activity(computing.pid).runnable
    computing.kill()
    computing.wait(10)
    assert process_activity(computing.pid) is None  # gone: nothing to observe


def _settled(pid: int) -> bool:
    """Whether ``pid`` is neither runnable nor gaining CPU time over 0.2 s: at its blocking wait, past interpreter
    start-up (which sleeps on disk reads between bursts of work, so one non-runnable sample does not show it)."""
    before = process_activity(pid)
    time.sleep(0.2)
    after = process_activity(pid)
    return not before.runnable and not after.runnable and after.cpu_s == before.cpu_s


def test_the_judge_waits_for_a_working_process_and_only_for_it(child):
    timeout_s = 1.0
    judge = SilenceJudge(timeout_s)
    computing, blocked = child(COMPUTES), child(BLOCKS)
    _until(lambda: _settled(blocked.pid))
    for pid in (computing.pid, blocked.pid):
        judge.look(pid)
    time.sleep(0.3)
    assert judge.starved(computing.pid, silent_s=2 * timeout_s)  # silent past the timeout, still computing
    assert not judge.starved(blocked.pid, silent_s=2 * timeout_s)  # silent and doing nothing: hung
    # bounded: past STARVED_LIMIT_FACTOR timeouts a computing process is judged hung too
    assert not judge.starved(computing.pid, silent_s=(STARVED_LIMIT_FACTOR + 1) * timeout_s)
    os.kill(computing.pid, signal.SIGSTOP)
    _until(lambda: process_activity(computing.pid).stopped)
    assert not judge.starved(computing.pid, silent_s=2 * timeout_s)  # stopped: hung at once


def _beat_once(run_dir, role: str, pid: int) -> None:
    (run_dir / HEARTBEAT_DIR).mkdir(parents=True, exist_ok=True)
    payload = {"pid": pid, "time": time.time(), "host": socket.gethostname()}
    (run_dir / HEARTBEAT_DIR / f"{role}.json").write_text(json.dumps(payload))


def test_a_role_that_stops_beating_while_it_computes_is_waited_for_until_it_is_stopped(tmp_path, child, caplog):
    """The monitor of a run: a role whose beats stop while it computes gets no verdict over several heartbeat
    timeouts (it is said once to be starved); SIGSTOP it and the verdict comes within the timeout."""
    timeout_s = 1.0
    role = child(COMPUTES)
    _beat_once(tmp_path, "rollout", role.pid)
    monitor = HealthMonitor(tmp_path, ["rollout"], heartbeat_timeout_s=timeout_s, interval_s=0.1).start()
    try:
        _until(lambda: monitor.snapshot()["rollout"]["pid"] == role.pid)

        async def training():
            await asyncio.sleep(4 * timeout_s)  # four timeouts without a beat, computing all along
            os.kill(role.pid, signal.SIGSTOP)
            await asyncio.sleep(60)  # a missed verdict: this returns, and no error is raised

        with caplog.at_level("WARNING", logger="relax"), \
                pytest.raises(RoleFailedError, match=rf"the rollout role \(pid {role.pid}\) sent no heartbeat"):
            asyncio.run(monitor.guard(training()))
        starved = [r.getMessage() for r in caplog.records if "starved of CPU" in r.getMessage()]
        assert len(starved) == 1 and f"pid {role.pid}" in starved[0], starved  # said once, before the stop
    finally:
        monitor.stop()
