"""The Prometheus endpoint (issue 17): a running training answers /metrics on 127.0.0.1 with its last step's
metrics, the restart count and, behind a router, each engine's health."""

from __future__ import annotations

import signal
import time

import httpx

from relax.telemetry.metrics_service import MetricsService, metric_name
from tests.support.http_servers import free_port
from tests.support.runs import popen_relax, tiny_train_args
from tests.support.waits import PROCESS_PATIENCE_S


def _scrape(port: int) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_a_running_training_is_scraped(tiny_workspace, tmp_path):
    port = free_port()
    args = tiny_train_args(tiny_workspace, tmp_path / "run", "--num-rollout", "200", "--use-metrics-service",
                           "--metrics-service-port", str(port))
    process = popen_relax("train", *args)
    try:
        deadline, values = time.monotonic() + 120, {}
        while time.monotonic() < deadline and values.get("relax_step", 0) < 2:
            try:
                values = _scrape(port)
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        assert values.get("relax_step", 0) >= 2, values
        assert values["relax_global_restarts"] == 0
        assert 0 <= values["relax_rollout_reward_mean"] <= 1 and "relax_train_loss" in values
        assert "relax_perf_step_s" in values
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=PROCESS_PATIENCE_S)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-2000:]


def test_engine_health_behind_a_router_is_exposed():
    port = free_port()
    engines = [{"engine": "http://127.0.0.1:1", "healthy": True, "outstanding": 3, "weight_version": 4},
               {"engine": "http://127.0.0.1:2", "healthy": False, "outstanding": 0, "weight_version": 2}]
    service = MetricsService(port, restarts=1, engine_stats=lambda: engines).start()
    try:
        service.update(5, {"rollout/reward_mean": 0.25, "eval/held out/accuracy": 0.5})
        values = _scrape(port)
    finally:
        service.close()
    assert values["relax_step"] == 5 and values["relax_global_restarts"] == 1
    assert values["relax_rollout_reward_mean"] == 0.25 and values[metric_name("eval/held out/accuracy")] == 0.5
    assert values['relax_engine_healthy{engine="http://127.0.0.1:1"}'] == 1
    assert values['relax_engine_healthy{engine="http://127.0.0.1:2"}'] == 0
    assert values['relax_engine_outstanding_requests{engine="http://127.0.0.1:1"}'] == 3
