"""A save redraws the run's curves (they survive a crash), at most once per `PLOT_INTERVAL_S`; the run's end
(`Checkpointer.wait` after a background save, the tracker's close) is not throttled."""

from __future__ import annotations

import json

from relax.cli.args import parse_config
from relax.core.state import checkpointer
from relax.core.state.checkpointer import Checkpointer
from relax.telemetry.phases import PhaseClock
from tests.support.runs import tiny_train_args


def _write_metrics(run_dir, steps: int) -> None:
    rows = [{"step": step, "train/loss": 1.0 / step, "rollout/reward_mean": step / 10} for step in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_a_save_draws_the_curves_at_most_once_per_interval(tiny_workspace, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saver = Checkpointer(parse_config(tiny_train_args(tiny_workspace, run_dir)), roles=None, phases=PhaseClock())
    loss_plot = run_dir / "plots" / "loss.png"

    _write_metrics(run_dir, 1)
    saver._saved(1)  # the first save draws: a crash after it leaves the curves
    first = loss_plot.read_bytes()
    _write_metrics(run_dir, 5)
    saver._saved(2)  # within the interval: not redrawn
    assert loss_plot.read_bytes() == first

    monkeypatch.setattr(checkpointer, "PLOT_INTERVAL_S", 0.0)  # the interval has passed
    saver._saved(3)
    assert loss_plot.read_bytes() != first  # five points now
    assert saver.last.name == "iter_0000003"
