"""Rollout engines as a Ray Serve deployment (`--rollout-serve-replicas`; issue 19): real Ray, real Serve, real
signals. A fully-async training runs on a Serve deployment of one engine; the scaling API takes it to three replicas
(Serve starts them, each loads the current weights before Serve routes to it), a replica is SIGKILLed and Serve
replaces it while training goes on, and the API takes it back to one (Serve drains the two that leave). Every step
is trained once with all its groups."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator

import httpx
import pytest

from relax.config import ConfigError
from relax.distributed.process_group import free_loopback_port
from relax.telemetry.metrics_file import read_metrics
from tests.support.runs import popen_relax, run_relax, tiny_train_args
from tests.support.waits import PROCESS_PATIENCE_S, wait_until

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.xdist_group("ray-serve")

TOKEN = "serve-scale-secret"
STEPS = 24


def _replicas(url: str) -> list[dict]:
    engines = httpx.get(f"{url}/engines", timeout=30).json()["models"]["default"]["engines"]
    return [e for e in engines if e["status"] == "serve_replica"]


def _wait(condition, train, what: str):
    return wait_until(condition, PROCESS_PATIENCE_S, what, process=train, interval_s=0.2)


def _scale(url: str, direction: str, count: int) -> dict:
    bound = ["--start-timeout", str(PROCESS_PATIENCE_S)] if direction == "out" else []  # replicas start on a busy machine
    done = run_relax("scale", direction, "--url", url, "--num-replicas", str(count), "--api-key", TOKEN, *bound)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_serve_replicas_scale_1_3_1_and_a_killed_one_is_replaced_while_training_goes_on(tiny_workspace, tmp_path):
    port, out, hold = free_loopback_port(), tmp_path / "run", tmp_path / "hold"
    args = tiny_train_args(tiny_workspace, out, "--fully-async", "--max-staleness", "1", "--num-rollout", str(STEPS),
                           "--skip-eval-before-train", "--dump-samples", "0", "--rollout-serve-replicas", "1",
                           "--rollout-health-check-interval", "1", "--rollout-api-port", str(port),
                           "--rollout-api-key", TOKEN, "--reward-timeout", "300")
    url = f"http://127.0.0.1:{port}"
    with held_training(args, hold) as train:
        _wait(lambda: _up(url), train, "the scaling API")
        first = _replicas(url)
        assert len(first) == 1 and first[0]["is_healthy"]

        grown = _scale(url, "out", 3)
        assert grown["status"] == "ACTIVE" and len(grown["engine_ids"]) == 2, grown
        three = _replicas(url)
        assert len(three) == 3 and all(r["is_healthy"] for r in three) and train.poll() is None
        _run_steps(out, hold, train, 4, "steps on three replicas")

        victim = three[-1]
        os.kill(victim["pid"], signal.SIGKILL)
        replaced = _wait(lambda: _replaced(url, victim["engine_id"]), train, "Serve's replacement of the killed replica")
        assert len(replaced) == 3 and victim["engine_id"] not in {r["engine_id"] for r in replaced}
        _run_steps(out, hold, train, 2, "steps after the restart")

        shrunk = _scale(url, "in", 1)
        assert shrunk["status"] == "COMPLETED" and len(shrunk["removed_engines"]) == 2, shrunk
        assert len(_replicas(url)) == 1 and train.poll() is None
        rejected = httpx.post(f"{url}/scale_in", json={"num_replicas": 0},
                              headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert rejected.status_code == 400 and "initial replicas" in rejected.text  # the first replica is protected
        stderr = finish_held_training(train, hold)
    assert_every_step_trained_once(out, STEPS)
    assert TOKEN not in stderr


@contextlib.contextmanager
def held_training(args: list[str], hold) -> Iterator[subprocess.Popen]:
    """`relax train args` in a subprocess whose rewards wait while the file ``hold`` exists (so the run cannot end
    before the test is done with it); killed if the block leaves it running."""
    args = list(args)
    args[args.index("--custom-rm-path") + 1] = "tests.support.e2e_rewards:digit_fraction_held"
    hold.touch()
    train = popen_relax("train", *args, env={"RELAX_CHAOS_HOLD": str(hold)})
    try:
        yield train
    finally:
        hold.unlink(missing_ok=True)
        if train.poll() is None:
            train.kill()
            train.wait(30)


def finish_held_training(train: subprocess.Popen, hold) -> str:
    """Let the held run finish; its stderr (it must have succeeded)."""
    hold.unlink()
    _, stderr = train.communicate(timeout=600)
    assert train.returncode == 0, stderr[-3000:]
    return stderr


def assert_every_step_trained_once(out, steps: int) -> None:
    rows = [row for row in read_metrics(out / "metrics.jsonl") if "data/produced_groups" in row]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))  # every step trained once
    assert all(row["data/produced_groups"] == row["data/consumed_groups"] == 4 for row in rows)
    assert all(row["data/dropped_failed_groups"] == 0 for row in rows)
    assert all(row["perf/rollout_version_lag"] <= 1 for row in rows)  # the engines serve the trainer's weights


def _run_steps(out, hold, train, count: int, what: str) -> None:
    """Let the held run train ``count`` more steps, then hold it again."""
    target = _trained_steps(out) + count
    hold.unlink()
    try:
        _wait(lambda: _trained_steps(out) >= target, train, what)
    finally:
        hold.touch()


def _up(url: str) -> bool:
    return httpx.get(f"{url}/engines", timeout=5).status_code == 200


def _trained_steps(out) -> int:
    path = out / "metrics.jsonl"
    return sum(1 for row in read_metrics(path) if "train/loss" in row) if path.exists() else 0


def _replaced(url: str, killed: str) -> list[dict] | None:
    replicas = _replicas(url)
    running = [r for r in replicas if r["is_healthy"]]
    if len(running) == len(replicas) == 3 and killed not in {r["engine_id"] for r in replicas}:
        return replicas
    return None


@pytest.mark.parametrize(("extra", "message"), [
    (["--colocate"], "drop --colocate"),
    (["--rollout-external", "--rollout-external-engine-addrs", "http://127.0.0.1:9"], "external servers join"),
])
def test_serve_replicas_refuse_what_they_cannot_do(tiny_workspace, tmp_path, extra, message):
    from relax.cli.args import parse_config

    with pytest.raises((ConfigError, SystemExit, ValueError)) as raised:
        parse_config(tiny_train_args(tiny_workspace, tmp_path / "run", "--rollout-serve-replicas", "2", *extra))
    assert message in str(raised.value)


def test_gpus_per_engine_needs_serve_replicas(tiny_workspace, tmp_path):
    from relax.cli.args import parse_config

    with pytest.raises((ConfigError, SystemExit, ValueError)) as raised:
        parse_config(tiny_train_args(tiny_workspace, tmp_path / "run", "--rollout-num-gpus-per-engine", "0.5"))
    assert "--rollout-num-gpus-per-engine needs --rollout-serve-replicas" in str(raised.value)


def test_a_replica_decodes_each_call_with_one_version_and_loads_new_ones_between_calls(tiny_workspace, tmp_path):
    """The replica's admission (without Serve around it: a real engine, real published weights): a call that
    wants version 1 while a version-0 call is decoding waits for it, the load happens between them, and each
    call's tokens all come from the version it was sent with."""
    import asyncio

    import torch

    from relax.backends.inference.base import GenerationRequest, SamplingParams
    from relax.backends.inference.embedded import EmbeddedEngine
    from relax.core.engines.serve_deployment import EngineReplica
    from relax.distributed.weight_disk import DiskPublisher, DiskReceiver

    engine = EmbeddedEngine.from_pretrained(str(tiny_workspace / "model"))
    replica = object.__new__(EngineReplica)  # its state without Serve's replica context
    replica.engine, replica.weights = engine, DiskReceiver(tmp_path / "weights", engine)
    replica._calls, replica._loading, replica._turn = 0, False, asyncio.Condition()
    moved = [(name, p.detach() + 0.05) for name, p in engine.model.named_parameters()]
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True)

    async def scenario():
        first = asyncio.create_task(replica.generate(
            [GenerationRequest(f"g0-i{i}-0", [1, 2, 3], sampling) for i in range(4)], 0))
        await asyncio.sleep(0)  # admitted with version 0
        await DiskPublisher(tmp_path / "weights").publish([moved], 1)
        second = await replica.generate([GenerationRequest("g1-i0-0", [1, 2, 3], sampling)], 1)
        return await first, second

    first, second = asyncio.run(scenario())
    assert all(o.weight_version == 0 and set(o.output_weight_versions or [0]) == {0} for o in first)
    assert second[0].weight_version == 1 and set(second[0].output_weight_versions or [1]) == {1}
    assert torch.equal(dict(engine.model.named_parameters())[moved[0][0]], moved[0][1])


def test_an_empty_call_reaches_no_replica(tmp_path):
    import asyncio

    from relax.core.engines.serve_deployment import ServeEngine

    assert asyncio.run(ServeEngine(None, tmp_path).generate([])) == []  # no deployment is touched


def test_replicas_the_local_ray_cannot_hold_are_refused_before_any_wait():
    from relax.core.engines.serve_deployment import shortfall

    cpu_only = {"CPU": 8.0, "memory": 1e10}
    assert shortfall({"num_cpus": 1}, 8, cpu_only) == {}
    assert shortfall({"num_cpus": 1}, 9, cpu_only) == {"num_cpus": 9}
    assert shortfall({"num_gpus": 1, "num_cpus": 1}, 1, cpu_only) == {"num_gpus": 1}  # no GPU at all
    one_gpu = {**cpu_only, "GPU": 1.0}
    assert shortfall({"num_gpus": 0.5, "num_cpus": 1}, 2, one_gpu) == {}  # two halves share it
    assert shortfall({"num_gpus": 0.3, "num_cpus": 1}, 3, one_gpu) == {}  # 0.9 in float arithmetic
    assert shortfall({"num_gpus": 0.5, "num_cpus": 1}, 3, one_gpu) == {"num_gpus": 1.5}


def test_a_slow_start_is_reported_with_serves_replica_states_and_message():
    from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger, ReplicaState
    from ray.serve.schema import ApplicationStatus, ApplicationStatusOverview, DeploymentStatusOverview

    from relax.core.engines.serve_deployment import DEPLOYMENT_NAME, replica_progress

    waiting = "Deployment 'EngineReplica' has 1 replica that has taken more than 30s to be scheduled."
    deployment = DeploymentStatusOverview(DeploymentStatus.UPDATING, DeploymentStatusTrigger.CONFIG_UPDATE_STARTED,
                                          {ReplicaState.STARTING: 2, ReplicaState.RUNNING: 1}, waiting)
    application = ApplicationStatusOverview(ApplicationStatus.DEPLOYING, "", 0.0, {DEPLOYMENT_NAME: deployment})
    assert replica_progress(application) == f"2 STARTING, 1 RUNNING; {waiting}"
    assert replica_progress(None) == "the deployment is not created yet"
