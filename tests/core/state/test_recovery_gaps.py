"""Issue 28, items 14-16: recovery that never trains on wrong weights, a run that ends well ends healthy, and the
fallbacks that did not fall back.

- a resumed run's engines follow only the versions the resumed run publishes, whatever a dead run left behind;
- the health monitor judges no process after the training loop has ended (the teardown is not a fault);
- a checkpoint without its manifest and with an unreadable trainer state is skipped for an older intact one;
- a run killed before its first checkpoint resumes with ``--load`` (from its first step, its run.log kept), and the
  supervisor's restart does the same instead of deleting run.log with ``--overwrite``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from relax.core.state import checkpoint
from relax.core.state.health import HealthMonitor
from relax.core.state.supervisor import child_argv
from relax.distributed.weight_disk import DiskFollower, DiskPublisher
from relax.telemetry.metrics_file import read_metrics
from tests.support.runs import run_relax, tiny_train_args


class _Engine:
    """Holds named tensors like an engine; versions and the publisher it last loaded."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.weight_version = 0
        self.weight_run: str | None = None

    async def pause(self, owner=None) -> None: ...

    async def resume(self, owner=None) -> None: ...

    async def update_weights(self, named_tensors, version: int) -> None:
        self.weights = {name: tensor.clone() for name, tensor in named_tensors}
        self.weight_version = version


def _weights(tag: float) -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.full((2,), tag))]


@settings(max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck),
                    phases=(Phase.explicit, Phase.generate))  # no shrinking: each case is a real server call
@given(dead=st.lists(st.integers(1, 9), min_size=1, max_size=4, unique=True), resumed=st.integers(0, 8),
       served_by_dead=st.booleans())
def test_a_resumed_run_serves_only_its_own_versions(tmp_path_factory, dead, resumed, served_by_dead):
    """A dead run left versions (some newer than the resumed one) under the root, and the engine may still serve
    one of them: the follower of the resumed run loads the version it published, then each later one it
    publishes, and never one of the dead run's."""
    root = tmp_path_factory.mktemp("sync")
    for version in sorted(dead):
        asyncio.run(DiskPublisher(root, fsync=False, keep_last=9, run="dead").publish([_weights(100 + version)],
                                                                                      version))
    engine = _Engine()
    if served_by_dead:
        engine.weights, engine.weight_version, engine.weight_run = dict(_weights(100 + max(dead))), max(dead), "dead"
    follower = DiskFollower(root, engine, asyncio.Lock(), run="alive")
    alive = DiskPublisher(root, fsync=False, keep_last=9, run="alive")
    for version in (resumed, resumed + 1, resumed + 2):
        asyncio.run(alive.publish([_weights(version)], version))
        asyncio.run(follower.catch_up())
        assert engine.weight_version == version and engine.weight_run == "alive"
        assert torch.equal(engine.weights["w"], torch.full((2,), float(version)))


def test_followed_weights_publish_before_the_engines_follow(tmp_path):
    """The order that closes the race of item 14: the first publish of a (resumed) run removes a dead run's newer
    versions and names this run; only then do the engines start following it, once; later versions only publish."""
    import asyncio
    from types import SimpleNamespace

    pytest.importorskip("ray")
    from relax.core.placement.ray import RayFollowedWeights

    calls = []

    class Service:
        weight_root, weight_run = tmp_path / "weights", "alive"

        async def publish_weights(self, version):
            calls.append(("publish", version))
            return {"weights/published_version": version}

    class Rollout:
        async def follow_published_weights(self, root, run):
            calls.append(("follow", run))

        async def catch_up_with_published_weights(self):
            calls.append(("catch_up",))

    weights = RayFollowedWeights(Service(), SimpleNamespace(rollout=Rollout()))

    async def two_versions_then_finish():
        assert await weights.push(5) == {"weights/published_version": 5}
        await weights.push(6)
        await weights.finish()

    asyncio.run(two_versions_then_finish())
    assert calls == [("publish", 5), ("follow", "alive"), ("catch_up",), ("publish", 6), ("catch_up",)]


# ---- item 15: a run that ends well ends healthy --------------------------------------------------------------------
def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _beat(run_dir: Path, role: str, pid: int) -> None:
    (run_dir / "health").mkdir(parents=True, exist_ok=True)
    import socket

    (run_dir / "health" / f"{role}.json").write_text(json.dumps({"role": role, "pid": pid,
                                                                 "host": socket.gethostname(),
                                                                 "time": time.time()}))


@pytest.mark.parametrize("ended", [False, True])
def test_processes_gone_after_the_loop_ended_are_no_fault(tmp_path, ended):
    monitor = HealthMonitor(tmp_path, ["actor", "rollout"], heartbeat_timeout_s=30, interval_s=3600)
    monitor.start()
    try:
        async def loop() -> str:
            return "done"

        if ended:
            assert asyncio.run(monitor.guard(loop())) == "done"
        _beat(tmp_path, "actor", _dead_pid())  # the role's process is gone (the teardown, or a crash)
        _beat(tmp_path, "rollout", os.getpid())
        monitor.check()
        state = json.loads((tmp_path / "health.json").read_text())
        if ended:
            assert monitor.fatal is None and state["fatal"] is None
            assert all(role["healthy"] for role in state["roles"].values())
        else:
            assert monitor.fatal is not None and "actor" in monitor.fatal
    finally:
        monitor._stop.set()  # no verdict timer: end the watch as a finished run would
        monitor.stop()


# ---- item 16: fallbacks -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["unreadable", "not json", "empty", "a list"])
def test_no_manifest_and_an_unreadable_trainer_state_falls_back(tmp_path, damage):
    older = checkpoint.iteration_dir(tmp_path, 1)
    older.mkdir(parents=True)
    (older / "model_optim").mkdir()
    (older / "trainer_state.json").write_text(json.dumps({"step": 1}))  # a checkpoint from before manifests
    (older / "lr_scheduler.pt").write_bytes(b"s")
    newer = checkpoint.iteration_dir(tmp_path, 2)
    (newer / "model_optim").mkdir(parents=True)
    (newer / "lr_scheduler.pt").write_bytes(b"s")
    state = newer / "trainer_state.json"
    if damage == "unreadable":
        state.mkdir()
    else:
        state.write_text({"not json": "{\"step\": 2", "empty": "", "a list": "[2]"}[damage])
    selected = checkpoint.select_checkpoint(tmp_path, needs_optimizer=True)
    assert selected.step == 1 and any("trainer_state.json" in problem or "manifest" in problem
                                      for problem in selected.skipped)


def test_a_restart_resumes_in_place_and_keeps_run_log(tmp_path):
    argv = ["--output-dir", str(tmp_path), "--overwrite", "--load", "elsewhere"]
    assert child_argv(argv, tmp_path / "checkpoints", 0) == argv
    again = child_argv(argv, tmp_path / "checkpoints", 1)
    assert "--overwrite" not in again and again[-2:] == ["--load", str(tmp_path / "checkpoints")]


def test_a_run_killed_before_its_first_checkpoint_resumes_with_load(tiny_workspace, tmp_path):
    out = tmp_path / "run"
    args = tiny_train_args(tiny_workspace, out, "--num-rollout", "3", "--skip-eval-before-train", "--dump-samples",
                           "0", "--no-use-tensorboard", "--custom-rm-path",
                           "tests.support.e2e_rewards:digit_fraction_then_die_once")
    env = {"RELAX_TEST_DIE_MARKER": str(tmp_path / "died"), "RELAX_TEST_DIE_AT_CALL": "20"}
    killed = run_relax("train", *args, env=env)
    assert killed.returncode != 0 and (tmp_path / "died").exists()
    assert not (out / "checkpoints" / checkpoint.LATEST_FILE).exists()
    log_before = (out / "run.log").read_text()
    plain = run_relax("train", *args, env=env)
    assert plain.returncode == 2 and f"--load {out}" in plain.stderr  # the advice it gives ...
    resumed = run_relax("train", *args, "--load", str(out), env=env)  # ... works
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (out / "run.log").read_text().startswith(log_before)  # the first attempt's log is kept
    assert "holds no checkpoint yet" in (out / "run.log").read_text()
    steps = [row["step"] for row in read_metrics(out / "metrics.jsonl") if "train/loss" in row]
    assert steps == [1, 2, 3]
