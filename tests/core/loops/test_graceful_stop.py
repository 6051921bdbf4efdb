"""SIGTERM / SIGINT stop `relax train` at a step boundary with a checkpoint; --load continues without losing or
repeating a sample. Real `relax train` processes and real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from relax.telemetry.metrics_file import read_metrics
from tests.support.runs import ROOT, popen_relax, run_relax, tiny_train_args
from tests.support.waits import PROCESS_PATIENCE_S, wait_until

# Enough steps that the signal, sent once step 1 is in metrics.jsonl (polled every 0.1 s; a tiny step takes tens
# of milliseconds), lands well before the last step, which ends the run normally whatever the signal.
STEPS = 40
PROMPTS_PER_STEP = 4  # tiny_train_args' --rollout-batch-size


def train_until_signalled(args: list[str], run_dir: Path, signal_number: int, after_step: int = 1,
                          timeout_s: float = PROCESS_PATIENCE_S) -> subprocess.CompletedProcess:
    """Start `relax train`, send ``signal_number`` once ``after_step`` is in metrics.jsonl, wait for the exit."""
    process = popen_relax("train", *args)
    try:
        wait_until(lambda: any(row.get("step", 0) >= after_step and "train/loss" in row
                               for row in read_metrics(run_dir / "metrics.jsonl")),
                   timeout_s, f"step {after_step} to be trained", process=process, interval_s=0.1)
        process.send_signal(signal_number)
        stdout, stderr = process.communicate(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def trained_steps(run_dir: Path) -> list[int]:
    return [row["step"] for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row]


@pytest.mark.parametrize("mode", [[], ["--fully-async", "--max-staleness", "1"], ["--colocate-async"]],
                         ids=["sync", "fully-async", "colocate-async"])
def test_sigterm_checkpoints_and_load_continues(mode, tiny_workspace, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_train_args(tiny_workspace, run_dir, "--num-rollout", str(STEPS), "--save-interval", "100",
                           "--skip-eval-before-train", *mode)
    stopped = train_until_signalled(args, run_dir, signal.SIGTERM)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    steps = trained_steps(run_dir)
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and last < STEPS
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == str(last)
    # The data cursor is the trained steps' prompts, even where the fully-async producer had run ahead.
    state = json.loads(next((checkpoints / f"iter_{last:07d}").glob("trainer_state.json")).read_text())
    assert state["consumed_prompts"] == last * PROMPTS_PER_STEP
    assert f"--load {checkpoints}" in stopped.stderr

    resumed = run_relax("train", *args, "--load", str(run_dir), timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert trained_steps(run_dir) == list(range(1, STEPS + 1))  # every step once: none lost, none repeated


def test_a_second_signal_stops_at_once(tmp_path):
    script = (
        "import os, signal, time\n"
        "from relax.core.loops.graceful_stop import GracefulStop\n"
        "stop = GracefulStop()\n"
        "with stop.installed():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.1)\n"
        "    assert stop.requested and stop.exit_code == 143\n"
        "    print('first signal: stop requested', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "print('not reached')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert result.stdout == "first signal: stop requested\n"
    assert result.returncode == -signal.SIGTERM
