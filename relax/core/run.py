"""The composition root of a training run: the one place a run is put together.

`train` places the roles (in this process, or in Ray processes: `relax.core.placement`), opens the tracker and the
monitors (health checks, the metrics endpoint, the scaling API), runs the loop of the run's mode
(`relax.core.loops`) under the graceful-stop handler, and tears everything down in the reverse order, whatever
ended the run. It returns what happened (`RunResult`); `relax train` (`relax.cli.train`) prints it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax.config import ConfigError, RelaxConfig, flag
from relax.core.engines.scaling_service import scaling_api
from relax.core.loops import loop_class
from relax.core.placement import place_roles
from relax.core.state.health import HealthMonitor
from relax.core.state.run_dir import remove_if_unused
from relax.core.state.supervisor import RESTARTS_ENV
from relax.telemetry.metrics_file import METRICS_FILE, read_metrics
from relax.telemetry.metrics_service import MetricsService
from relax.telemetry.notify import Notifier
from relax.telemetry.tracking import NullTracker, Tracker
from relax.utils import interrupts
from relax.utils.heap import freeze_long_lived_objects

logger = logging.getLogger("relax")


@dataclass
class RunResult:
    """How a training run ended (`train`)."""

    exit_code: int = 0
    last: dict[str, float] = field(default_factory=dict)  # the last step's metrics
    stopped_after_step: int | None = None  # a signal stopped it after this step (checkpoint saved)
    signal_name: str | None = None
    last_checkpoint: Path | None = None


def train(cfg: RelaxConfig, run_dir: Path, primary: bool, created: bool, notifier: Notifier,
          announce: Callable[[], None] = lambda: None) -> RunResult:
    """Run the training ``cfg`` describes into ``run_dir`` (prepared by the caller); ``announce`` is called once the
    roles are up (a start that fails before has printed and left nothing: the directory is removed if this start
    created it). ``primary`` is rank 0 under torchrun: it alone writes the run directory and serves the monitors."""
    try:
        placement = place_roles(cfg)
    except BaseException:
        if primary:
            remove_if_unused(run_dir, created)
        raise
    roles = placement.roles
    freeze_long_lived_objects()  # the models, engines and data live as long as the run
    if primary:
        announce()
    notifier.started(str(run_dir), roles.total_steps, resumed=bool(cfg.load))
    monitor = None
    try:
        metrics_service = start_metrics_service(cfg, roles) if primary else None
        tracker = Tracker(run_dir, use_tensorboard=cfg.use_tensorboard, use_wandb=cfg.use_wandb,
                          wandb_project=cfg.wandb_project, config=cfg.shareable_settings()[0],
                          clearml_project=cfg.clearml_project if cfg.use_clearml else None,
                          metrics_service=metrics_service) if primary else NullTracker()
        with tracker:
            loop = loop_class(cfg)(cfg, placement, tracker)
            loop.phases.notifier = notifier  # stall reports reach --notify-urls too
            if cfg.use_health_check and primary:
                monitor = start_health_monitor(cfg, run_dir, placement, loop, notifier)
                if metrics_service is not None:
                    metrics_service.role_health = monitor.snapshot
            interrupts.raise_if_received()  # a Ctrl-C of the start-up that a library swallowed
            with loop.graceful_stop.installed():
                training = _with_scaling_api(loop, cfg, roles)
                last = asyncio.run(monitor.guard(training) if monitor is not None else training)
    finally:
        if monitor is not None:
            monitor.detach_actors()
        placement.close()
        if monitor is not None:  # after the teardown: until then a fatal verdict still bounds it (FATAL_GRACE_S)
            monitor.stop()
    stop = loop.graceful_stop
    if stop.stopped_after_step is not None:
        name = signal.Signals(stop.signal_number).name
        notifier.stopped(str(run_dir), stop.stopped_after_step, name)
        return RunResult(stop.exit_code, {}, stop.stopped_after_step, name, loop.last_checkpoint)
    if primary:
        notifier.finished(str(run_dir), roles.total_steps, last)
    return RunResult(0, last, last_checkpoint=loop.last_checkpoint)


async def _with_scaling_api(loop, cfg: RelaxConfig, roles) -> dict[str, float]:
    """The training loop, with the engines' scaling API served beside it when --rollout-api-port is set."""
    async with scaling_api(cfg, roles):
        return await loop.run()


def start_metrics_service(cfg: RelaxConfig, roles) -> MetricsService | None:
    """--use-metrics-service: the Prometheus endpoint, with the engines' health when a router fronts them."""
    if not cfg.use_metrics_service:
        return None
    try:
        return MetricsService(cfg.metrics_service_port, restarts=int(os.environ.get(RESTARTS_ENV, "0")),
                              engine_stats=engine_stats_of(roles)).start()
    except OSError as err:
        raise ConfigError(f"{flag('metrics_service_port')} {cfg.metrics_service_port}: cannot listen on "
                          f"127.0.0.1 ({err.strerror or err})") from None


def engine_stats_of(roles) -> Callable[[], list[dict[str, Any]]] | None:
    """The router's per-engine state (`EngineRouter.stats`) when the rollout's engines are in this process."""
    stats = getattr(getattr(roles.rollout, "engine", None), "stats", None)
    return stats if callable(stats) else None


def start_health_monitor(cfg: RelaxConfig, run_dir: Path, placement, loop, notifier: Notifier) -> HealthMonitor:
    """--use-health-check: heartbeats of the roles in processes of their own, the data plane's actors, the loop's
    phase."""
    return HealthMonitor(run_dir, placement.beating_roles(), cfg.heartbeat_timeout_s,
                         actors=placement.watched_actors(), phase_of=loop.phases.current, notifier=notifier,
                         restarts=int(os.environ.get(RESTARTS_ENV, "0")),
                         engine_stats=engine_stats_of(placement.roles), end_process=placement.end_process).start()


def first_eval_accuracy(run_dir: Path) -> float | None:
    """The held-out accuracy of the run's first evaluation (before training), if it had one."""
    for row in read_metrics(run_dir / METRICS_FILE):
        if row.get("eval/accuracy") is not None:
            return row["eval/accuracy"]
    return None


def reward_failures(run_dir: Path) -> tuple[int, int]:
    """(samples whose reward failed, samples scored) over the run's rollout steps."""
    rows = [row for row in read_metrics(run_dir / METRICS_FILE) if "rollout/num_samples" in row]
    return (sum(int(row.get("reward/num_errors", 0)) for row in rows),
            sum(int(row["rollout/num_samples"]) for row in rows))
