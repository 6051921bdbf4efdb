"""The learning comparison's figures (`benchmarks/modes_learning_gpu.py`): paired by seed, judged against their spread."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.modes_learning_gpu import ROOT, first_reach, report, runs_by_seed

FLAGS = {"sync": [], "overlapped": ["--colocate-async"]}


def _args(eval_size: int = 400) -> argparse.Namespace:
    return argparse.Namespace(model_label="m", steps=100, eval_interval=50, eval_size=eval_size,
                              config=ROOT / "examples" / "quickstart" / "config.yaml")


def _run(final: float, seconds_per_step: float, start: float = 0.1) -> dict:
    curve = [{"step": 0, "seconds": 0.0, "accuracy": start},
             {"step": 50, "seconds": 50 * seconds_per_step, "accuracy": (start + final) / 2},
             {"step": 100, "seconds": 100 * seconds_per_step, "accuracy": final}]
    return {"curve": curve, "steps_done": 100, "train_s": 100 * seconds_per_step}


def test_the_difference_is_paired_by_seed_and_judged_against_the_seeds_spread():
    results = {"sync": {"1": _run(0.50, 1.0), "2": _run(0.70, 1.0), "3": _run(0.60, 1.0)},
               "overlapped": {"1": _run(0.52, 0.5), "2": _run(0.69, 0.5), "3": _run(0.62, 0.5)}}
    summary = report(results, _args(), "cpu", FLAGS)
    assert summary["seeds"] == ["1", "2", "3"]
    assert summary["sync_accuracy_after"] == pytest.approx(0.6)
    assert summary["overlapped_accuracy_per_seed"] == [0.52, 0.69, 0.62]
    # paired differences 0.02, -0.01, 0.02: mean 0.01, SE = sd / sqrt(3), far below the seeds' own spread (0.1)
    differences = [0.02, -0.01, 0.02]
    mean = sum(differences) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / 2)
    assert summary["overlapped_accuracy_minus_sync"] == pytest.approx(mean, abs=1e-4)
    assert summary["overlapped_accuracy_minus_sync_se"] == pytest.approx(sd / math.sqrt(3), abs=1e-4)
    assert summary["overlapped_within_two_se_of_sync"] is True
    assert summary["overlapped_steps_per_s_speedup"] == pytest.approx(2.0)
    assert summary["overlapped_time_to_target_speedup"] == pytest.approx(2.0, rel=0.05)


def test_one_seed_falls_back_to_the_binomial_errors_and_an_unpaired_mode_has_no_difference():
    summary = report({"sync": {"7": _run(0.5, 1.0)}, "overlapped": {"8": _run(0.9, 1.0)}}, _args(100), "cpu", FLAGS)
    assert "overlapped_accuracy_minus_sync" not in summary
    summary = report({"sync": {"7": _run(0.5, 1.0)}, "overlapped": {"7": _run(0.9, 1.0)}}, _args(100), "cpu", FLAGS)
    assert summary["overlapped_accuracy_minus_sync_se"] == pytest.approx(math.hypot(0.05, 0.03), abs=1e-4)
    assert summary["overlapped_within_two_se_of_sync"] is False  # 0.4 apart is not noise


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0.05, 0.95), st.floats(0.05, 0.95)), min_size=1, max_size=5))
def test_the_figures_hold_for_any_runs(pairs):
    """Means between the extremes, a non-negative standard error, and the verdict its own definition."""
    results = {"sync": {str(i): _run(a, 1.0) for i, (a, _) in enumerate(pairs)},
               "overlapped": {str(i): _run(b, 0.8) for i, (_, b) in enumerate(pairs)}}
    summary = report(results, _args(), "cpu", FLAGS)
    for mode, column in (("sync", 0), ("overlapped", 1)):
        finals = [pair[column] for pair in pairs]
        assert min(finals) - 1e-4 <= summary[f"{mode}_accuracy_after"] <= max(finals) + 1e-4
    difference, se = summary["overlapped_accuracy_minus_sync"], summary["overlapped_accuracy_minus_sync_se"]
    assert se >= 0
    if abs(abs(difference) - 2 * se) > 1e-3:  # the rounded figures decide as the exact ones did, off the boundary
        assert summary["overlapped_within_two_se_of_sync"] == (abs(difference) <= 2 * se)


def test_result_files_of_one_run_per_mode_still_plot(tmp_path: Path):
    """Files written before --seeds ({mode: run}) read as one unnamed seed, so --replot still draws them."""
    from benchmarks.modes_learning_gpu import plot

    old = {"sync": _run(0.5, 1.0), "overlapped": _run(0.55, 1.0)}
    assert runs_by_seed(old) == {"sync": {"": old["sync"]}, "overlapped": {"": old["overlapped"]}}
    plot({"runs": old, "modes": {"sync": "sync", "overlapped": "--colocate-async"}, "model": "m", "device": "cpu"},
         tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert first_reach(old["sync"]["curve"], 0.3) == 50.0
