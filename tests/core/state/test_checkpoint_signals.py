"""The process that writes a checkpoint, SIGKILLed or SIGSTOPped mid-save (issue 17), at the points of a save that
leave different states on disk:
the run restarts by itself (--max-global-restart; a stopped one is found by the supervisor's health check),
resumes from the newest intact checkpoint, and ends with the metrics of an uninterrupted run and every
checkpoint verifying against its manifest.

The signal comes from the process itself, at the n-th call of a function of `relax.core.state.checkpoint`
(tests/support/fault_injection/sitecustomize.py wraps it at import), so it lands at an exact point of a real save.
The save of step 4 is hit (the second save of a 6-step run saving every 2 steps).
"""

from __future__ import annotations

import os

import pytest

from relax.core.state import checkpoint
from relax.telemetry.metrics_file import read_metrics
from tests.support.runs import ROOT, run_relax, tiny_train_args

INJECTION = ROOT / "tests" / "support" / "fault_injection"
STEPS = ("--num-rollout", "6", "--save-interval", "2", "--skip-eval-before-train", "--dump-samples", "0",
         "--no-use-tensorboard", "--max-checkpoints", "2")
# Where, in the order a save runs: each leaves a different state on disk (a kill while the shards or the trainer
# state are written leaves a staging folder without a manifest, as "write_manifest" does; the SIGSTOP test stops
# the process there).
POINTS = [
    ("begin_save", "after"),  # an empty staging folder
    ("write_manifest", "before"),  # every file written, hf/ metadata too, no manifest
    ("mark_latest", "before"),  # renamed to iter_0000004, the pointer still at step 2
    ("rotate", "before"),  # the pointer at step 4, rotation not done
]


def _compare(mine: list[dict], theirs: list[dict]) -> None:
    assert [row["step"] for row in mine] == [row["step"] for row in theirs]
    for a, b in zip(mine, theirs, strict=True):
        for key, value in b.items():
            if not key.startswith("perf/") and isinstance(value, float | int):
                assert a.get(key) == pytest.approx(value, rel=1e-4, abs=1e-6), (a["step"], key)


@pytest.fixture(scope="module")
def uninterrupted(tiny_workspace, tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("signals") / "reference"
    result = run_relax("train", *tiny_train_args(tiny_workspace, run_dir, *STEPS))
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(run_dir / "metrics.jsonl")


def _signalled_run(workspace, tmp_path, point: tuple[str, str], signal_name: str, *extra: str):
    run_dir = tmp_path / "run"
    once = tmp_path / "signal-sent"
    function, when = point
    env = {"PYTHONPATH": os.pathsep.join([str(INJECTION), str(ROOT)]),
           "RELAX_TEST_SIGNAL_AT": f"{function}:{when}:2:{signal_name}", "RELAX_TEST_SIGNAL_ONCE": str(once)}
    result = run_relax("train", *tiny_train_args(workspace, run_dir, *STEPS, "--max-global-restart", "1", *extra),
                       env=env)
    return run_dir, once, result


def _check_recovered(run_dir, once, result, uninterrupted) -> None:
    assert once.exists(), "the signal was never sent"
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restart 1 of 1" in result.stderr
    _compare(read_metrics(run_dir / "metrics.jsonl"), uninterrupted)
    root = run_dir / "checkpoints"
    assert checkpoint.saved_steps(root) == [4, 6]
    for step in (4, 6):
        assert checkpoint.verify(checkpoint.iteration_dir(root, step)) is None
    assert not list(root.glob("*.partial")), "a staging folder left behind"


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS, ids=[f"{f}-{w}" for f, w in POINTS])
def test_a_process_killed_mid_save_resumes_from_the_newest_intact_checkpoint(point, tiny_workspace, tmp_path,
                                                                             uninterrupted):
    run_dir, once, result = _signalled_run(tiny_workspace, tmp_path, point, "SIGKILL")
    _check_recovered(run_dir, once, result, uninterrupted)
    assert "killed by SIGKILL" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("point", [("save_trainer_state", "before")], ids=["shards-written"])
def test_a_process_stopped_mid_save_is_killed_by_the_supervisor_and_resumes(point, tiny_workspace, tmp_path,
                                                                            uninterrupted):
    run_dir, once, result = _signalled_run(tiny_workspace, tmp_path, point, "SIGSTOP", "--use-health-check",
                                           "--heartbeat-timeout-s", "3")
    _check_recovered(run_dir, once, result, uninterrupted)
    assert "has written no health state" in result.stderr


@pytest.mark.slow
def test_a_process_killed_while_an_async_save_seals_resumes(tiny_workspace, tmp_path, uninterrupted):
    """--async-save seals in a background thread: a kill there leaves the previous checkpoint the newest."""
    run_dir, once, result = _signalled_run(tiny_workspace, tmp_path, ("write_manifest", "before"), "SIGKILL",
                                           "--async-save")
    _check_recovered(run_dir, once, result, uninterrupted)
