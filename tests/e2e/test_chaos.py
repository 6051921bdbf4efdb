"""The chaos suite (issue 17): real signals to the real processes of a running training, which finishes by itself
with the metrics of an uninterrupted run and every group trained exactly once.

One fully-async run with its roles in Ray processes and TransferQueue as the data plane (`--max-staleness 0`, so
that each step's weights, and so its metrics, do not depend on timing) suffers, one after the other: SIGKILL of the
rollout role's process, SIGSTOP of TransferQueue's storage unit, SIGKILL of the actor role's process, SIGSTOP of the
rollout role, SIGKILL of the storage unit, SIGSTOP of the run's own process, and SIGSTOP of the actor role (the
trainer). Each is detected (a named error
in run.log: `RoleDiedError`, a heartbeat older than --heartbeat-timeout-s, TransferQueue's liveness check, the
supervisor's stale health state), the run restarts from its newest checkpoint (--max-global-restart; written
with --async-save, so faults also land while a checkpoint is written in the background), and the metrics after
it equal the uninterrupted run's for every step. The uninterrupted run is the same fully-async run in one process
(blocking saves, no Ray): a Ray run takes the in-process run's steps (tests/core/placement/test_ray_placement.py),
and the one process costs a third of their CPU (23 against 66 CPU-s, each a fresh `relax train`).

A run on rollout engines it started (`relax serve` processes, --use-fault-tolerance) has each engine SIGKILLed
and SIGSTOPped and its own process SIGKILLed: each engine is relaunched at the current weights while its groups
finish on the other, and the metrics equal an uninterrupted run's.

Faults of the other modes have their own tests: the in-process trainer SIGKILLed
(tests/core/state/test_global_restart.py), the process writing a checkpoint SIGKILLed at four points of the save (one
also with --async-save) and SIGSTOPped at one (tests/core/state/test_checkpoint_signals.py; damaged and unwritable
checkpoints: tests/core/state/test_checkpoint_faults.py), environments that crash their worker processes
(tests/rollout/agentic/test_env_workers.py), an external engine SIGKILLed or SIGSTOPped (tests/backends/inference/test_http_engines.py), a
launched engine relaunched (tests/backends/inference/test_engine_relaunch.py), a reward that hangs, leaks or crashes
(tests/rollout/rewards/test_reward_workers.py).
"""

from __future__ import annotations

import math
import sys
import time
from datetime import datetime

import pytest

from benchmarks.chaos_cpu import Fault, _follow, accounting, run_with_faults, version_violations
from relax.core.state.health import format_state, read_state
from relax.distributed.process_group import free_port
from relax.telemetry.metrics_file import read_metrics
from tests.support.runs import ROOT, SUBPROCESS_TIMEOUT_S, run_relax, tiny_train_args

# Tests that start Ray clusters in this process share one xdist worker with the other such tests, one after the
# other (scripts/test.sh runs three workers). The Ray chaos run is a subprocess with its own cluster and mostly waits
# (heartbeats, restarts: 1m07 of CPU in 4m47 alone): a group of its own, so it runs beside them, not after them.
IN_PROCESS_RAY = pytest.mark.xdist_group("ray")

pytest.importorskip("ray")
pytest.importorskip("transfer_queue")

STEPS = 16
GROUPS, SAMPLES = 4, 4  # tiny_train_args: 4 prompts x 4 samples per step
MODE = ("--placement", "ray", "--fully-async", "--max-staleness", "0", "--num-rollout", str(STEPS),
        "--save-interval", "1", "--skip-eval-before-train", "--dump-samples", "0", "--no-use-tensorboard")
HEALTH = ("--use-health-check", "--heartbeat-timeout-s", "6", "--async-save")  # the uninterrupted run saves blocking


def _by_step(rows: list[dict]) -> dict[int, dict]:
    """Each step's rows as one: a fully-async run logs a step's rollout and training rows in either order."""
    merged: dict[int, dict] = {}
    for row in rows:
        merged.setdefault(row["step"], {}).update(row)
    return merged


# What differs between runs by design: timings, the staleness the timing gives, and how the data plane carried the
# samples (TransferQueue passes them by key; the in-process plane streams their fields).
UNCOMPARED = ("perf/", "data/staleness", "data/passed_by_key_fraction", "data/streamed_fields_fraction")


def _compare(mine: list[dict], theirs: list[dict]) -> None:
    """Every step of ``theirs`` (the uninterrupted run) is in ``mine`` with the same metrics, but `UNCOMPARED`."""
    assert sorted(row["step"] for row in mine) == sorted(row["step"] for row in theirs)
    mine_by_step, theirs_by_step = _by_step(mine), _by_step(theirs)
    for step, b in theirs_by_step.items():
        a = mine_by_step[step]
        for key, value in b.items():
            if key.startswith(UNCOMPARED) or not isinstance(value, float | int):
                continue
            if isinstance(value, float) and math.isnan(value):
                continue
            assert a.get(key) == pytest.approx(value, rel=1e-4, abs=1e-6), (a["step"], key)


@pytest.mark.slow
@pytest.mark.xdist_group("ray-chaos")
def test_a_fully_async_ray_run_survives_a_fault_in_each_process(tiny_workspace, tmp_path):
    def held(run_dir, *extra):  # the reward waits while the harness holds the run (see run_with_faults)
        argv = tiny_train_args(tiny_workspace, run_dir, *extra, "--reward-timeout", "300")
        argv[argv.index("--custom-rm-path") + 1] = "tests.support.e2e_rewards:digit_fraction_held"
        return argv

    reference_dir = tmp_path / "reference"
    in_process = list(MODE)
    in_process[in_process.index("--placement") + 1] = "in_process"
    reference = run_relax("train", *held(reference_dir, *in_process), env={"RELAX_CHAOS_HOLD": str(tmp_path / "none")})
    assert reference.returncode == 0, reference.stderr[-3000:]

    run_dir = tmp_path / "chaos"
    faults = [Fault("rollout", "SIGKILL", 1), Fault("storage", "SIGSTOP", 3), Fault("actor", "SIGKILL", 5),
              Fault("rollout", "SIGSTOP", 7), Fault("storage", "SIGKILL", 9), Fault("run", "SIGSTOP", 11),
              Fault("actor", "SIGSTOP", 13)]
    command = [sys.executable, "-m", "relax.cli.main", "train",
               *held(run_dir, *MODE, *HEALTH, "--max-global-restart", str(len(faults)))]
    # Seven restarts: 4 min on two idle cores, about 40 beside two CPU burners; the limit only ends a hung run.
    # Held: a tiny step takes ~0.1 s, and a restarted run outran the harness (on a loaded machine the fault due at
    # step 1 reached the run at step 7, the one due at 7 after the last step, and was never detected).
    report = run_with_faults(command, run_dir, faults, timeout_s=2 * SUBPROCESS_TIMEOUT_S,
                             env={"PYTHONPATH": str(ROOT)}, hold=tmp_path / "hold")
    assert report.returncode == 0, report.stderr_tail
    for fault in faults:  # each detected with a message naming what failed, and recovered from
        assert fault.sent_at is not None and fault.recovered, (fault, report.warnings)
        assert fault.detection_s is not None, fault  # how long it took is benchmarks/chaos_cpu.py's to measure
    names = {"rollout": "rollout role", "actor": "actor role", "storage": "TransferQueueStorageUnit#0",
             "run": "run's process"}
    for fault in faults:
        assert names[fault.target] in fault.detected_by, fault
    # a stopped Ray process was killed at the verdict, so the teardown did not wait on it (the run's own process is
    # the supervisor's to kill)
    run_log = (run_dir / "run.log").read_text()
    processes = {"rollout": "rollout", "actor": "actor",
                 "storage": "TransferQueue storage unit TransferQueueStorageUnit#0"}
    for fault in faults:
        if fault.signal == "SIGSTOP" and fault.target != "run":
            assert f"{processes[fault.target]}'s process killed" in run_log, fault

    mine, theirs = read_metrics(run_dir / "metrics.jsonl"), read_metrics(reference_dir / "metrics.jsonl")
    assert version_violations(mine, max_staleness=0) == []  # no sample from weights outside the bound
    _compare(mine, theirs)
    # every step trained from TransferQueue's keys, none from payloads sent through the run's process
    assert {step: row.get("data/passed_by_key_fraction") for step, row in _by_step(mine).items()} == \
        {step: 1.0 for step in range(1, STEPS + 1)}
    counts = accounting(mine, STEPS, GROUPS, SAMPLES)
    assert counts["samples_lost"] == counts["samples_duplicated"] == counts["outstanding_groups"] == 0, counts
    assert counts["steps_logged"] == STEPS

    state = read_state(run_dir)  # what `relax health` shows after the run
    assert state["global_restarts"] == len(faults) and "rollout" in format_state(state)
    # Its last run ended well, so it ended healthy: no verdict, every process healthy, `relax health` exits 0
    assert state["fatal"] is None and state["ended"] and all(role["healthy"] for role in state["roles"].values())
    assert run_relax("health", str(run_dir)).returncode == 0


def _log_line(at: float, level: str, text: str, milliseconds: bool = True) -> str:
    stamp = datetime.fromtimestamp(at).strftime("%Y-%m-%d %H:%M:%S")
    return f"{stamp},{int(at % 1 * 1000):03d} {level} {text}" if milliseconds else f"{stamp} {level} {text}"


def test_the_harness_counts_a_fault_recovered_only_by_the_restarted_runs_steps(tmp_path):
    """A fully-async run may still log a step between a fault and its detection, and errors while it ends: neither
    is the fault's detection or recovery, so the next fault waits for the restarted run instead of reaching the
    dying one (and being blamed on its teardown's errors)."""
    sent = time.time() - 60
    fault = Fault("actor", "SIGKILL", 5, pid=1, sent_at=sent)
    run_log = tmp_path / "run.log"

    def log(*lines: str) -> None:
        with run_log.open("a") as out:
            out.write("".join(line + "\n" for line in lines))

    log(_log_line(sent - 0.2, "ERROR", "relax: an error of the previous fault's teardown"),
        _log_line(sent - 0.1, "INFO", "relax: step 5: {}"), _log_line(sent + 0.3, "INFO", "relax: step 6: {}"))
    _follow(fault, tmp_path, step=6)
    assert fault.detection_s is None and not fault.recovered
    log(_log_line(sent + 0.5, "ERROR", "relax: relax train: failed: the actor role's Ray process died"))
    _follow(fault, tmp_path, step=6)
    assert fault.detected_by.endswith("the actor role's Ray process died") and fault.detection_s == 0.5
    assert not fault.recovered  # step 6 came from the dying run
    log(_log_line(sent + 2, "WARNING", "relax.supervisor: the run died (exit code 1); restart 1 of 7", False),
        _log_line(sent + 20, "INFO", "relax: step 5: {}"))
    _follow(fault, tmp_path, step=6)
    assert not fault.recovered  # the restarted run is not past the fault's step yet
    log(_log_line(sent + 21, "INFO", "relax: step 6: {}"))
    _follow(fault, tmp_path, step=6)
    assert fault.recovered


@IN_PROCESS_RAY
@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSTOP"])
def test_a_dead_or_stopped_storage_unit_ends_data_plane_calls_naming_it(signal_name, monkeypatch):
    """Without health checks too: a write to a killed storage unit, or a read from a stopped one, ends within the
    liveness bound (TransferQueue alone would wait 200 s per attempt, then the reader --data-wait-timeout)."""
    import asyncio
    import os
    import signal

    import ray

    from relax.data_plane import StalenessGate, tq_plane
    from tests.data_plane.test_data_plane import make_group

    monkeypatch.setattr(tq_plane, "UNANSWERED_LIMIT_S", 3.0)
    tq_plane.start_local_transfer_queue(num_storage_units=1, num_cpus=2)
    pid = None
    try:
        plane = tq_plane.TransferQueueDataPlane(StalenessGate(1))
        storage = ray.get_actor("TransferQueueStorageUnit#0")
        pid = ray.get(storage.__ray_call__.remote(lambda actor: os.getpid()))
        os.kill(pid, getattr(signal, signal_name))

        async def use_the_plane():
            if signal_name == "SIGKILL":
                await plane.put(0, make_group(0))
            else:
                async for _ in plane.stream(0, batch_size=4):
                    pass

        with pytest.raises(tq_plane.DataPlaneError, match="storage unit TransferQueueStorageUnit#0"):
            # a missed verdict ends in wait_for's TimeoutError instead
            asyncio.run(asyncio.wait_for(use_the_plane(), tq_plane.UNANSWERED_LIMIT_S + 60))
    finally:
        if pid is not None and signal_name == "SIGSTOP":
            os.kill(pid, signal.SIGKILL)
        tq_plane.stop_local_transfer_queue()


def test_a_stopped_in_process_run_is_killed_and_restarted_by_its_supervisor(tiny_workspace, tmp_path):
    """In-process placement: the run is one process; stopped (SIGSTOP), its health state goes stale and the
    supervisor of --max-global-restart kills and restarts it (the SIGKILLed run: tests/core/state/test_global_restart.py)."""
    steps = ("--num-rollout", "8", "--save-interval", "2", "--skip-eval-before-train", "--dump-samples", "0",
             "--no-use-tensorboard")

    def args(run_dir, *extra):  # ~0.5 s steps (a paced reward), so the signal lands inside the run
        argv = tiny_train_args(tiny_workspace, run_dir, *steps, *extra)
        argv[argv.index("--custom-rm-path") + 1] = "tests.support.e2e_rewards:digit_fraction_paced"
        return argv

    reference_dir = tmp_path / "reference"
    assert run_relax("train", *args(reference_dir)).returncode == 0
    run_dir = tmp_path / "stopped"
    fault = Fault("run", "SIGSTOP", 3)
    command = [sys.executable, "-m", "relax.cli.main", "train",
               *args(run_dir, "--use-health-check", "--heartbeat-timeout-s", "3", "--max-global-restart", "1")]
    report = run_with_faults(command, run_dir, [fault], timeout_s=300, env={"PYTHONPATH": str(ROOT)})
    assert report.returncode == 0, report.stderr_tail
    assert fault.recovered and "has written no health state" in fault.detected_by, fault
    assert fault.detection_s is not None, fault
    _compare(read_metrics(run_dir / "metrics.jsonl"), read_metrics(reference_dir / "metrics.jsonl"))


@pytest.mark.slow
def test_a_run_on_engines_it_started_survives_their_faults(tiny_workspace, tmp_path):
    """--rollout-engine-protocol relax with --use-fault-tolerance: two `relax serve` processes. Engine A is
    SIGKILLed, engine B SIGSTOPped, A SIGKILLed again, then the run's own process (a global restart: the new run
    starts its engines on the same ports). Each engine fault is logged naming the engine, the engine is
    relaunched at the current weights while its groups finish on the other, and every metric equals the
    uninterrupted run's (a sample generated with stale weights would change train/ppo_kl and the loss)."""
    steps = 18
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]

    def args(run_dir, *extra):
        argv = tiny_train_args(
            tiny_workspace, run_dir, "--num-rollout", str(steps), "--save-interval", "2", "--skip-eval-before-train",
            "--dump-samples", "0", "--no-use-tensorboard", "--rollout-external", "--rollout-engine-protocol",
            "relax", "--rollout-external-engine-addrs", *urls, "--reward-timeout", "300", *extra)
        argv[argv.index("--custom-rm-path") + 1] = "tests.support.e2e_rewards:digit_fraction_held"
        return argv

    reference_dir = tmp_path / "reference"
    reference = run_relax("train", *args(reference_dir), env={"RELAX_CHAOS_HOLD": str(tmp_path / "none")})
    assert reference.returncode == 0, reference.stderr[-3000:]

    run_dir = tmp_path / "chaos"
    faults = [Fault(urls[0], "SIGKILL", 2), Fault(urls[1], "SIGSTOP", 6), Fault(urls[0], "SIGKILL", 10),
              Fault("run", "SIGKILL", 14)]
    command = [sys.executable, "-m", "relax.cli.main", "train", *args(
        run_dir, "--use-fault-tolerance", "--rollout-health-check-interval", "1",
        "--rollout-health-check-timeout", "3", "--use-health-check", "--max-global-restart", "1")]
    # Held (see run_with_faults): on a loaded machine a relaunch can take longer than the steps left to the run.
    report = run_with_faults(command, run_dir, faults, timeout_s=600, env={"PYTHONPATH": str(ROOT)},
                             hold=tmp_path / "hold")
    assert report.returncode == 0, report.stderr_tail
    for fault in faults:
        assert fault.sent_at is not None and fault.recovered, (fault, report.warnings)
        assert fault.detection_s is not None, fault
    for fault in faults[:3]:
        assert fault.target in fault.detected_by, fault
    log = (run_dir / "run.log").read_text()
    # At least: on a loaded machine a slow health check can also count as a stopped engine (and relaunch it).
    assert log.count(f"engine {urls[0]} relaunched") >= 2 and log.count(f"engine {urls[1]} relaunched") >= 1

    mine, theirs = read_metrics(run_dir / "metrics.jsonl"), read_metrics(reference_dir / "metrics.jsonl")
    assert version_violations(mine, max_staleness=0) == []  # no sample from weights outside the bound
    _compare(mine, theirs)
    state = read_state(run_dir)  # `relax health` lists the engines of the run's router
    assert [engine["engine"] for engine in state["engines"]] == urls and all(e["healthy"] for e in state["engines"])
    assert urls[0] in format_state(state)
