"""The quickstart model really learns under Relax's GRPO loop (a short run of the quickstart)."""

import pytest

from relax.telemetry.metrics_file import read_metrics
from tests.support.runs import ROOT, run_relax


@pytest.mark.slow
def test_grpo_raises_held_out_accuracy_on_the_quickstart_task(tmp_path):
    run_dir = tmp_path / "quickstart"
    result = run_relax("train", "--config", str(ROOT / "examples/quickstart/config.yaml"), "--num-rollout", "60",
                       "--eval-interval", "60", "--output-dir", str(run_dir), "--no-use-tensorboard",
                       "--save-interval", "1000")
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [row for row in read_metrics(run_dir / "metrics.jsonl") if "eval/accuracy" in row]
    first, last = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    assert [row["step"] for row in evals] == [0, 60]
    # Measured on the 2-core dev machine: 0.25 -> 0.415 after 60 steps; the bar leaves room for other CPUs.
    assert last - first >= 0.08, (first, last)
    assert "held-out accuracy: 0.250 before training" in result.stdout
