"""Custom rewards in worker processes (issue 17, --custom-rm-workers): a reward that leaks memory, kills its own
process or never returns costs only that sample's reward (0, counted) and its worker, never the trainer; the
other samples score as in threads."""

from __future__ import annotations

import asyncio
import os
import resource

import pytest

from relax.data.sample import Sample
from relax.rollout.rewards.compute import RewardComputer
from relax.telemetry.metrics_file import read_metrics
from tests.support.runs import run_relax, tiny_train_args


def _samples(count: int) -> list[Sample]:
    return [Sample(index=i, tokens=[1, 2, 3], response_length=1, response=f"{i} apples 12 and {i * 7}",
                   group_index=i) for i in range(count)]


def _score(computer: RewardComputer, samples: list[Sample]) -> list[float]:
    asyncio.run(computer.score(samples))
    return [s.reward for s in samples]


def test_a_leaking_a_crashing_and_a_hung_reward_each_cost_only_their_sample(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    threads = RewardComputer(custom_rm_path="tests.support.e2e_rewards:digit_fraction")
    expected = _score(threads, _samples(8))
    workers = RewardComputer(custom_rm_path="tests.support.e2e_rewards:misbehaves_on_some_rows", custom_workers=2,
                             worker_memory_mb=1024, timeout_s=20)
    try:
        rewards = _score(workers, _samples(8))
        assert rewards[1] == rewards[2] == rewards[3] == 0.0
        assert [r for i, r in enumerate(rewards) if i not in (1, 2, 3)] == \
            [r for i, r in enumerate(expected) if i not in (1, 2, 3)]
        metrics = workers.pop_metrics()
        assert metrics == {"reward/num_errors": 3, "reward/num_timeouts": 1}
        messages = " | ".join(workers.error_counts)
        assert "MemoryError" in messages and "worker process died" in messages and "--reward-timeout" in messages
        assert _score(workers, _samples(1)) == expected[:1]  # the pool goes on with replaced workers
    finally:
        workers.close()
    # the 4 GiB were refused in the worker, not allocated here
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 1 << 20  # KiB: under 1 GiB


@pytest.mark.parametrize("kwargs, message", [
    ({"custom_workers": 2, "rm_type": "math"}, "synchronous --custom-rm-path"),
    ({"custom_rm_path": "tests.support.e2e_rewards:hangs", "custom_workers": 2}, "async one"),
    ({"custom_rm_path": "tests.support.e2e_rewards:digit_fraction", "worker_memory_mb": 512}, "--custom-rm-workers"),
])
def test_worker_settings_that_cannot_act_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RewardComputer(**kwargs)


def test_a_run_with_reward_workers_logs_what_a_run_with_threads_does(tiny_workspace, tmp_path):
    rows = {}
    for name, extra in (("threads", []), ("workers", ["--custom-rm-workers", "2", "--reward-worker-memory-mb",
                                                      "2048"])):
        result = run_relax("train", *tiny_train_args(tiny_workspace, tmp_path / name, "--num-rollout", "2", *extra))
        assert result.returncode == 0, result.stderr[-3000:]
        rows[name] = read_metrics(tmp_path / name / "metrics.jsonl")
    for mine, theirs in zip(rows["workers"], rows["threads"]):
        for key, value in theirs.items():
            if not key.startswith("perf/"):
                assert mine[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (mine["step"], key)
