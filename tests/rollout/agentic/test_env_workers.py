"""Environments in worker processes (--env-workers, issue 17): an environment that crashes its process (os._exit,
a segfault, SIGKILL from outside) fails only the episodes of its worker, which is replaced; a leak under
--env-worker-memory-mb fails only its call; episodes in workers generate exactly what they generate in-process."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from relax.config import RelaxConfig
from relax.core.rollout_parts import MULTI_TURN_PATH
from relax.data.sample import SampleStatus
from relax.rollout.agentic import multi_turn
from relax.rollout.agentic.env_workers import EnvWorkerPool
from relax.rollout.generation.context import PerSampleGeneration
from tests.rollout.agentic.test_agentic_multi_turn import letter_ids, prompt_samples, sampling
from tests.support.runs import ROOT
from tests.support.waits import PROCESS_PATIENCE_S, wait_until_async

ENV_PATH = "tests.support.e2e_envs:build_env"


@pytest.fixture(autouse=True)
def importable_tests(monkeypatch):
    """Spawned workers import the environment module from this checkout."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def config(**overrides) -> RelaxConfig:
    return RelaxConfig(**{"rollout_interaction_env_path": ENV_PATH, "max_turns": 3, "rollout_max_response_len": 200,
                          "env_step_timeout": 30, **overrides})


def episodes(engine, tokenizer, samples, cfg, pool=None):
    generation = PerSampleGeneration(multi_turn.generate, MULTI_TURN_PATH, cfg, tokenizer, None, pool)
    return asyncio.run(asyncio.wait_for(generation.run(engine, samples, sampling(tokenizer)), PROCESS_PATIENCE_S))


def test_episodes_in_workers_equal_the_in_process_ones(engine, tokenizer):
    cfg = config()
    samples = prompt_samples(tokenizer, 4)
    at_home = episodes(engine, tokenizer, prompt_samples(tokenizer, 4), cfg)
    pool = EnvWorkerPool(ENV_PATH, cfg, tokenizer, workers=2)
    try:
        away = episodes(engine, tokenizer, samples, cfg, pool)
    finally:
        pool.close()
    for mine, theirs in zip(away, at_home, strict=True):
        assert mine.tokens == theirs.tokens and mine.loss_mask == theirs.loss_mask
        # The engine batches the turns as they come: the same tokens, log-probs to float rounding.
        assert mine.rollout_log_probs == pytest.approx(theirs.rollout_log_probs, abs=1e-5)
        assert mine.metadata["rollout_stop_reason"] == theirs.metadata["rollout_stop_reason"] == "env_done"
    pids = {trace["env_info"]["pid"] for s in away for trace in s.metadata["rollout_traces"] if trace.get("env_info")}
    assert len(pids) == 2 and os.getpid() not in pids  # built and stepped in the two workers
    assert pool.started == 2


@pytest.mark.parametrize("kind", ["exits", "segfaults"])
def test_an_environment_that_crashes_its_process_fails_only_its_workers_episodes(kind, engine, tokenizer):
    cfg = config(env_step_timeout=3600)  # far past the bounded wait: an end within it is the death's, not a timeout's
    pool = EnvWorkerPool(ENV_PATH, cfg, tokenizer, workers=2)
    try:
        samples = prompt_samples(tokenizer, 4)
        samples[0].metadata["env"] = kind  # the first episode goes to worker 1, the second to worker 2, ...
        results = episodes(engine, tokenizer, samples, cfg, pool)
        failed = [s for s in results if s.status is SampleStatus.FAILED]
        how = "exited with code 3" if kind == "exits" else "was killed by SIGSEGV"
        assert failed and all(how in s.metadata["error"] and "--env-workers" in s.metadata["error"] for s in failed)
        assert all(s.metadata["rollout_stop_reason"] == "env_error" and not any(s.loss_mask) for s in failed)
        # The crashing episode fails, and with it at most the other episode its worker held (episode 2, when its
        # environment was already built there: it depends on how far the engine had got); the rest finish.
        assert samples[0].index in {s.index for s in failed} <= {samples[0].index, samples[2].index}
        survivors = [s for s in results if s.status is not SampleStatus.FAILED]
        assert len(survivors) == 4 - len(failed)
        assert all(s.metadata["rollout_stop_reason"] == "env_done" for s in survivors)
        assert pool.deaths == 1

        again = episodes(engine, tokenizer, prompt_samples(tokenizer, 4), cfg, pool)  # a new worker in its place
        assert all(s.metadata["rollout_stop_reason"] == "env_done" for s in again)
        assert pool.started == 3
    finally:
        pool.close()


def test_a_worker_killed_from_outside_fails_its_episodes_at_once(engine, tokenizer, tmp_path):
    cfg = config(env_step_timeout=3600)  # far past the waits below: an end within them is not the timeout's
    pool = EnvWorkerPool(ENV_PATH, cfg, tokenizer, workers=1)
    pid_file = tmp_path / "worker.pid"
    samples = prompt_samples(tokenizer, 2, env="hangs", pid_file=str(pid_file))

    async def scenario():
        generation = PerSampleGeneration(multi_turn.generate, MULTI_TURN_PATH, cfg, tokenizer, None, pool)
        running = asyncio.ensure_future(generation.run(engine, samples, sampling(tokenizer)))
        await wait_until_async(pid_file.exists, PROCESS_PATIENCE_S, "the worker's pid file", interval_s=0.05)
        await asyncio.sleep(0.5)  # both episodes are in their hanging step
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        return await asyncio.wait_for(running, PROCESS_PATIENCE_S)  # well before --env-step-timeout

    try:
        results = asyncio.run(scenario())
    finally:
        pool.close()
    assert all(s.status is SampleStatus.FAILED and "was killed by SIGKILL" in s.metadata["error"] for s in results)


def test_calls_that_meet_a_dead_worker_before_its_reader_does_fail_naming_how_it_died(tokenizer):
    """A worker killed while its reader thread is slow to hear of it (here: its reap delayed by a second): calls sent
    before, during and after that moment each fail naming the death, never a bare broken pipe and never a hang."""
    cfg = config()
    pool = EnvWorkerPool(ENV_PATH, cfg, tokenizer, workers=1)

    async def scenario():
        envs = [await pool.open(sample) for sample in prompt_samples(tokenizer, 3)]
        worker = envs[0].worker
        process = worker.process
        reap = process.join

        def slow_reap(timeout=None):
            time.sleep(1.0)
            return reap(timeout)

        process.join = slow_reap  # the reader's verdict lags the death
        os.kill(process.pid, signal.SIGKILL)
        await wait_until_async(lambda: not process.is_alive(), PROCESS_PATIENCE_S, "the worker's death",
                               interval_s=0.01)
        outcomes = []
        for delay in (0.0, 0.3, 0.8, 1.5):  # before and after the reader's verdict
            await asyncio.sleep(delay)
            outcomes += await asyncio.wait_for(asyncio.gather(*(env.call("reset") for env in envs),
                                                              return_exceptions=True), PROCESS_PATIENCE_S)
        return outcomes

    try:
        outcomes = asyncio.run(scenario())
    finally:
        pool.close()
    assert len(outcomes) == 12
    for outcome in outcomes:
        assert isinstance(outcome, Exception) and "was killed by SIGKILL" in str(outcome), outcome
        assert "--env-workers" in str(outcome)
    assert pool.deaths == 1


def test_closing_the_pool_with_a_call_in_flight_on_an_ended_loop_raises_in_no_thread(tokenizer, monkeypatch):
    """A call left pending when its event loop ended (its caller timed out), then the pool closed: the reader settles
    what it holds on a loop that is gone, which must not raise in its thread."""
    import threading

    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda hook_args: raised.append(hook_args.exc_value))
    pool = EnvWorkerPool(ENV_PATH, config(), tokenizer, workers=1)

    async def scenario():
        env = await pool.open(prompt_samples(tokenizer, 1, env="hangs")[0])
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(env.call("step", "x")), 0.5)  # the call stays pending
        return env.worker

    worker = asyncio.run(scenario())
    assert worker.pending  # still held for a loop that has ended
    pool.close()
    time.sleep(0.5)
    reader = [t for t in threading.enumerate() if t.name == "relax-env-reader"]
    for thread in reader:
        thread.join(PROCESS_PATIENCE_S)
    assert not worker.pending and not raised


def test_a_leak_under_the_memory_cap_fails_only_its_call(engine, tokenizer):
    cfg = config(env_workers=1, env_worker_memory_mb=256)
    pool = EnvWorkerPool(ENV_PATH, cfg, tokenizer, workers=1, memory_mb=256)
    try:
        samples = prompt_samples(tokenizer, 3)
        samples[1].metadata["env"] = "leaks"
        results = episodes(engine, tokenizer, samples, cfg, pool)
    finally:
        pool.close()
    assert "MemoryError" in results[1].metadata["error"] and results[1].status is SampleStatus.FAILED
    assert [s.metadata["rollout_stop_reason"] for s in results] == ["env_done", "env_error", "env_done"]
    assert pool.deaths == 0  # the worker lives on


@pytest.mark.parametrize(("overrides", "message"), [
    ({"env_workers": 2, "rollout_interaction_env_path": None}, "--env-workers needs --rollout-interaction-env-path"),
    ({"env_worker_memory_mb": 256}, "--env-worker-memory-mb needs --env-workers"),
])
def test_env_worker_flags_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


def test_a_training_run_goes_on_when_environments_crash_their_workers(tiny_workspace, tmp_path, tokenizer):
    from relax.telemetry.metrics_file import read_metrics
    from tests.support.runs import run_relax, tiny_train_args

    letters = [str(i) for i in letter_ids(tokenizer)]
    run_dir = tmp_path / "run"
    result = run_relax("train", *tiny_train_args(
        tiny_workspace, run_dir, "--num-rollout", "3", "--skip-eval-before-train", "--rollout-interaction-env-path",
        "tests.support.e2e_envs:build_env_crashing_now_and_then", "--env-workers", "2", "--max-turns", "3",
        "--rollout-max-context-len", "64", "--rollout-stop-token-ids", *letters))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "rollout/failed_ratio" in row]
    assert len(rows) == 3
    for row in rows:  # the crashed workers' episodes are failed and counted; the others trained
        assert 0 < row["rollout/failed_ratio"] < 1 and row["rollout/stop_env_error_ratio"] > 0
        assert "train/loss" in row
    assert "environment worker" in (run_dir / "run.log").read_text()
