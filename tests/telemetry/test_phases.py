"""Step phases (issue 17): the timeline holds every phase of every step as Chrome trace events, also from a run
that does not end cleanly; a phase past --stall-warning-s is reported with its step, what it waits for and since
when, in run.log and to the notifier."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from relax.telemetry.phases import TIMELINE_FILE, PhaseClock
from tests.support.runs import run_relax, tiny_train_args


def read_timeline(directory: Path) -> list[dict]:
    """The trace viewers accept the array without its closing bracket; json needs it."""
    text = (directory / TIMELINE_FILE).read_text().rstrip().rstrip(",")
    return json.loads(text + "\n]")


def _by_step(events: list[dict]) -> dict[int, set[str]]:
    steps: dict[int, set[str]] = {}
    for event in events:
        steps.setdefault(event["args"]["step"], set()).add(event["name"])
    return steps


def test_every_phase_of_every_step_is_on_the_timeline(tiny_workspace, tmp_path):
    timeline = tmp_path / "timeline"
    result = run_relax("train", *tiny_train_args(tiny_workspace, tmp_path / "run", "--num-rollout", "2",
                                                 "--timeline-dump-dir", str(timeline), "--colocate"))
    assert result.returncode == 0, result.stderr[-3000:]
    events = read_timeline(timeline)
    assert all(e["ph"] == "X" and e["dur"] >= 0 and e["ts"] >= 0 for e in events)
    steps = _by_step(events)
    assert steps[0] == {"eval"}
    for step in (1, 2):
        assert {"rollout", "train", "weight_sync", "memory"} <= steps[step], steps[step]
    assert {"eval", "checkpoint"} <= steps[2]
    rollout, train = (next(e for e in events if e["name"] == name and e["args"]["step"] == 1)
                      for name in ("rollout", "train"))
    assert rollout["ts"] + rollout["dur"] <= train["ts"]  # in order, on one clock


def test_the_async_trainers_waits_are_phases_too(tiny_workspace, tmp_path):
    timeline = tmp_path / "timeline"
    result = run_relax("train", *tiny_train_args(tiny_workspace, tmp_path / "run", "--num-rollout", "2",
                                                 "--fully-async", "--max-staleness", "1",
                                                 "--timeline-dump-dir", str(timeline)))
    assert result.returncode == 0, result.stderr[-3000:]
    waits = [e for e in read_timeline(timeline) if e["name"] == "wait"]
    assert {e["args"]["step"] for e in waits} >= {1, 2}
    assert any("data of rollout step" in e["args"]["detail"] for e in waits)


def test_a_stalled_phase_is_reported_with_its_step_and_what_it_waits_for(tiny_workspace, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_train_args(tiny_workspace, run_dir, "--num-rollout", "1", "--skip-eval-before-train",
                           "--stall-warning-s", "1")
    args[args.index("--custom-rm-path") + 1] = "tests.support.e2e_rewards:digit_fraction_slow_once"
    result = run_relax("train", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (run_dir / "run.log").read_text()
    assert "stalled: step 1 has been in rollout for" in log and "waiting for generation and rewards" in log
    assert "stalled:" in result.stderr  # a warning: on the console too


def test_stall_reports_repeat_at_each_multiple_and_reach_the_notifier(tmp_path):
    sent: list[tuple[str, str]] = []

    class Recorder:
        def send(self, event, body, failure=False):
            sent.append((event, body))
            return True

    clock = PhaseClock(tmp_path, stall_warning_s=0.2, notifier=Recorder())
    clock.start()
    try:
        with clock.phase("weight_sync", 7, "the weights to reach the engines"):
            time.sleep(0.75)
    finally:
        clock.stop()
    assert 2 <= len(sent) <= 4, sent  # at 0.2, 0.4, 0.6 s
    assert all(event == "stalled" and "step 7 has been in weight_sync" in body and "the weights to reach" in body
               for event, body in sent)
    (event,) = read_timeline(tmp_path)
    assert event["name"] == "weight_sync" and event["dur"] >= 700_000
    assert not [t for t in threading.enumerate() if t.name == "relax-stall-watchdog"]
