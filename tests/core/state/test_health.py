"""Heartbeats and the health monitor (`relax.core.state.health`) on real processes and signals, `relax health`, and the
metrics endpoint's per-role health."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relax.core.state.health import (
    HEARTBEAT_DIR,
    HealthMonitor,
    HealthStateError,
    RoleFailedError,
    format_state,
    read_state,
)
from relax.telemetry.metrics_service import MetricsService
from tests.support.runs import ROOT, run_relax
from tests.support.waits import PROCESS_PATIENCE_S, wait_until

BEATING_ROLE = """
import sys, time
from relax.core.state.health import Heartbeat
Heartbeat(sys.argv[1], "rollout", interval_s=0.1).start()
time.sleep(120)
"""


def _start_role(run_dir) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BEATING_ROLE, str(run_dir / HEARTBEAT_DIR)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def _wait_for(predicate, timeout_s: float = PROCESS_PATIENCE_S) -> None:
    wait_until(predicate, timeout_s, "the condition", interval_s=0.05)


@pytest.mark.parametrize("fault, expected", [("SIGSTOP", "sent no heartbeat for"), ("SIGKILL", "is gone")])
def test_a_stopped_or_killed_role_ends_the_run_naming_it(tmp_path, fault, expected):
    role = _start_role(tmp_path)
    ended = []

    def end_process(name):  # the placement's strategy; Ray placement's is ray.kill of the role's actor
        ended.append(name)
        os.kill(role.pid, signal.SIGKILL)

    monitor = HealthMonitor(tmp_path, ["rollout"], heartbeat_timeout_s=1.5, interval_s=0.1,
                            phase_of=lambda: {"step": 3, "phase": "rollout", "since": time.time()},
                            end_process=end_process)
    try:
        _wait_for(lambda: (tmp_path / HEARTBEAT_DIR / "rollout.json").exists())
        monitor.start()
        _wait_for(lambda: (read_state(tmp_path) or {}).get("roles", {}).get("rollout", {}).get("pid") == role.pid)
        assert read_state(tmp_path)["roles"]["rollout"]["healthy"] and read_state(tmp_path)["controller"]["step"] == 3

        async def training():
            await asyncio.sleep(60)

        os.kill(role.pid, getattr(signal, fault))
        if fault == "SIGKILL":
            role.wait(10)
        with pytest.raises(RoleFailedError, match=rf"the rollout role(.s process)? \(pid {role.pid}\) .*{expected}"):
            asyncio.run(monitor.guard(training()))  # a missed verdict: training() returns after 60 s, no error
        # The run has ended, as a real one would after the error: without this the verdict's exit timer would end
        # this process (pytest's) once its grace passed during the slow checks below.
        monitor.stop()
        state = read_state(tmp_path)
        assert not state["roles"]["rollout"]["healthy"] and expected in state["fatal"]
        # the process it named was ended before the loop was cancelled: a stopped one no longer holds the teardown
        assert ended == ["rollout"] and role.wait(10) == -signal.SIGKILL

        # `relax health` shows it and exits 1; --json gives the file
        shown = run_relax("health", str(tmp_path))
        assert shown.returncode == 1 and "rollout" in shown.stdout and "NO" in shown.stdout, shown.stdout
        assert json.loads(run_relax("health", str(tmp_path), "--json").stdout)["fatal"] == state["fatal"]
    finally:
        monitor.stop()  # also ends the verdict's exit timer, which would end this process
        role.kill()
        role.wait(10)


def test_a_healthy_role_keeps_the_run_going_and_reaches_the_metrics_endpoint(tmp_path):
    role = _start_role(tmp_path)
    service = MetricsService(0)
    monitor = HealthMonitor(tmp_path, ["rollout"], heartbeat_timeout_s=1.5, interval_s=0.1)
    try:
        _wait_for(lambda: (tmp_path / HEARTBEAT_DIR / "rollout.json").exists())
        monitor.start()

        async def training():
            await asyncio.sleep(3)  # two heartbeat timeouts: beats keep it healthy
            return "done"

        assert asyncio.run(monitor.guard(training())) == "done" and monitor.fatal is None
        service.role_health = monitor.snapshot
        service.start()
        port = service.port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'relax_role_healthy{role="rollout"} 1.0' in text and "relax_role_heartbeat_age_s" in text
        assert run_relax("health", str(tmp_path)).returncode == 0
    finally:
        monitor.stop()
        service.close()
        role.kill()
        role.wait(10)


def test_relax_health_names_a_run_without_health_state(tmp_path):
    result = run_relax("health", str(tmp_path))
    assert result.returncode == 2 and "health.json" in result.stderr and "--use-health-check" in result.stderr


_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4)
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
# Health states with any of their fields of any shape, so the damage reaches every field format_state reads.
_STATES = _JSON | st.fixed_dictionaries({"time": st.floats(0, 2e9) | _JSON}, optional={
    "pid": _JSON, "fatal": _JSON, "ended": _JSON, "global_restarts": _JSON,
    "controller": _JSON | st.fixed_dictionaries({}, optional={"step": _JSON, "phase": _JSON, "since": _JSON}),
    "roles": _JSON | st.dictionaries(st.text(max_size=4), _JSON | st.fixed_dictionaries({}, optional={
        "last_heartbeat": _JSON | st.floats(0, 2e9), "healthy": _JSON, "pid": _JSON, "error": _JSON}), max_size=2),
    "engines": _JSON | st.lists(_JSON | st.fixed_dictionaries({"engine": _JSON}, optional={
        "healthy": _JSON, "pid": _JSON, "weight_version": _JSON, "last_error": _JSON}), max_size=2)})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=_STATES)
def test_any_health_json_is_shown_or_refused_naming_the_file(tmp_path, state):
    """A health.json of any shape (damaged, or another program's) is shown as a table or refused with a
    HealthStateError naming the file: `relax health` had ended in a traceback (KeyError, AttributeError)."""
    (tmp_path / "health.json").write_text(json.dumps(state))
    try:
        shown = read_state(tmp_path)
    except HealthStateError as err:
        assert str(err).startswith(str(tmp_path / "health.json"))
    else:
        assert isinstance(format_state(shown), str)


@pytest.mark.parametrize("content", [b"[]", b'{"time": 1, "roles": {"actor": 5}}', b"{", b"\xff"])
def test_relax_health_refuses_a_damaged_state_naming_the_file(tmp_path, content):
    (tmp_path / "health.json").write_bytes(content)
    result = run_relax("health", str(tmp_path))
    assert result.returncode == 2 and "health.json" in result.stderr and "Traceback" not in result.stderr


def test_heartbeat_timeout_needs_health_checks(tmp_path):
    from relax.cli.args import parse_config
    from relax.config import ConfigError

    with pytest.raises(ConfigError, match="--heartbeat-timeout-s needs --use-health-check"):
        parse_config(["--heartbeat-timeout-s", "5", "--output-dir", str(tmp_path)])


VERDICT = """
import asyncio, sys, tempfile, time
from pathlib import Path
import relax.core.state.health as health
health.FATAL_GRACE_S = health.MIN_FATAL_GRACE_S = 1.0
def end_process(name):  # the ghost has no process to end: the verdict stands, the grace still runs
    raise KeyError(name)
monitor = health.HealthMonitor(Path(tempfile.mkdtemp()), ["ghost"], heartbeat_timeout_s=0.3, interval_s=0.1,
                               end_process=end_process).start()
async def training():
    await asyncio.sleep(30)
try:
    asyncio.run(monitor.guard(training()))
except health.RoleFailedError:
    pass
if sys.argv[1] == "stop":
    monitor.stop()  # the run's end after its teardown
time.sleep(3)  # a teardown that hangs
print("survived")
"""


@pytest.mark.parametrize("ends", ["stop", "hangs"])
def test_a_verdict_ends_the_process_unless_the_run_ends_within_the_grace(ends):
    result = subprocess.run([sys.executable, "-c", VERDICT, ends], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60, check=False)
    assert "could not end ghost's process: 'ghost'" in result.stderr
    if ends == "stop":
        assert result.returncode == 0 and "survived" in result.stdout, result.stderr
    else:
        assert result.returncode == 1 and "survived" not in result.stdout
        assert "did not end within 1 s of the fault; exiting" in result.stderr


def test_the_state_shows_the_routers_engines(tmp_path):
    """In-process engines behind a router (`--rollout-external`): health.json and `relax health` list each one."""
    engines = [{"engine": "http://127.0.0.1:30000", "healthy": True, "draining": False, "relaunching": False,
                "relaunches": 2, "outstanding": 8, "weight_version": 7, "last_error": "", "served": 99, "pid": 4242},
               {"engine": "http://127.0.0.1:30001", "healthy": False, "draining": False, "relaunching": True,
                "relaunches": 1, "outstanding": 0, "weight_version": 0, "last_error": "EngineUnresponsiveError: x"}]
    monitor = HealthMonitor(tmp_path, [], heartbeat_timeout_s=5, interval_s=0.1, engine_stats=lambda: engines)
    monitor.start()
    try:
        _wait_for(lambda: (read_state(tmp_path) or {}).get("engines") is not None)
    finally:
        monitor.stop()
    state = read_state(tmp_path)
    assert [e["relaunches"] for e in state["engines"]] == [2, 1] and "served" not in state["engines"][0]
    table = format_state(state).splitlines()
    assert table[-2].split()[:6] == ["http://127.0.0.1:30000", "yes", "4242", "7", "2", "8"]
    assert table[-1].split()[:3] == ["http://127.0.0.1:30001", "relaunching", "-"]  # no pid: it has no server
    assert table[-1].endswith("EngineUnresponsiveError: x")


def test_the_state_exists_as_soon_as_the_monitor_starts(tmp_path):
    """A run stopped in its first interval must leave a state whose age the supervisor can judge (it once left
    none, so a run stopped right after its monitor started was never restarted)."""
    monitor = HealthMonitor(tmp_path, [], heartbeat_timeout_s=5, interval_s=60).start()
    try:
        state = read_state(tmp_path)
        assert state is not None and state["pid"] == os.getpid() and not state["ended"]
    finally:
        monitor.stop()
