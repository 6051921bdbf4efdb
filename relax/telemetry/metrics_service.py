"""A Prometheus endpoint for a running training (``--use-metrics-service``, ``--metrics-service-port``).

``GET http://127.0.0.1:<port>/metrics`` (prometheus_client's exposition, on 127.0.0.1 only) gives the last logged
step and every metric of it as ``relax_<name>`` (``rollout/reward_mean`` -> ``relax_rollout_reward_mean``), the
number of global restarts so far, and per rollout engine behind a router whether it is healthy, its in-flight
requests, its weight version and its relaunches, and under ``--use-health-check`` each role's health and heartbeat age. Values are
read when scraped, so nothing is pushed anywhere.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, make_asgi_app
from prometheus_client.core import GaugeMetricFamily

from relax.utils.http_server import HTTPLimits, ThreadedServer

_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(key: str) -> str:
    return "relax_" + _INVALID.sub("_", key).strip("_")


class _RunCollector:
    def __init__(self, service: MetricsService) -> None:
        self.service = service

    def collect(self):
        service = self.service
        with service.lock:
            step, metrics = service.step, dict(service.metrics)
        yield GaugeMetricFamily("relax_step", "The last logged training step.", value=step)
        yield GaugeMetricFamily("relax_global_restarts", "Restarts by --max-global-restart so far.",
                                value=service.restarts)
        for key, value in sorted(metrics.items()):
            yield GaugeMetricFamily(metric_name(key), f"{key} at the last logged step.", value=value)
        engines = service.engine_stats() if service.engine_stats else []
        if engines:
            healthy = GaugeMetricFamily("relax_engine_healthy", "1 when the engine is routed to.", labels=["engine"])
            outstanding = GaugeMetricFamily("relax_engine_outstanding_requests", "Requests in flight.",
                                            labels=["engine"])
            version = GaugeMetricFamily("relax_engine_weight_version", "The weight version it serves.",
                                        labels=["engine"])
            relaunches = GaugeMetricFamily("relax_engine_relaunches", "Relaunches of the engine so far "
                                           "(--use-fault-tolerance).", labels=["engine"])
            for engine in engines:
                name = str(engine["engine"])
                healthy.add_metric([name], float(engine["healthy"] and not engine.get("draining", False)))
                outstanding.add_metric([name], float(engine.get("outstanding", 0)))
                version.add_metric([name], float(engine.get("weight_version", 0)))
                relaunches.add_metric([name], float(engine.get("relaunches", 0)))
            yield from (healthy, outstanding, version, relaunches)
        roles = service.role_health() if service.role_health else {}
        if roles:
            healthy = GaugeMetricFamily("relax_role_healthy", "1 while the role's process is alive and beating "
                                        "(--use-health-check).", labels=["role"])
            age = GaugeMetricFamily("relax_role_heartbeat_age_s", "Seconds since the role's last heartbeat or answer.",
                                    labels=["role"])
            now = time.time()
            for name, health in roles.items():
                healthy.add_metric([name], float(health["healthy"]))
                if health.get("last_heartbeat") is not None:
                    age.add_metric([name], now - health["last_heartbeat"])
            yield from (healthy, age)


class MetricsService:
    def __init__(self, port: int, restarts: int = 0,
                 engine_stats: Callable[[], list[dict[str, Any]]] | None = None,
                 http_limits: HTTPLimits | None = None) -> None:
        self.port = port
        self.http_limits = http_limits
        self.restarts = restarts
        self.engine_stats = engine_stats
        self.role_health: Callable[[], dict[str, dict]] | None = None  # `HealthMonitor.snapshot`
        self.lock = threading.Lock()
        self.step = 0
        self.metrics: dict[str, float] = {}
        self.registry = CollectorRegistry()
        self.registry.register(_RunCollector(self))
        self._server = None

    def start(self) -> MetricsService:
        # uvicorn with the bounds of every Relax server (prometheus_client's own server keeps a thread per connection,
        # with no read deadline and no connection limit); OSError when the port is taken.
        self._server = ThreadedServer(make_asgi_app(self.registry), "127.0.0.1", self.port, name="relax-metrics",
                                      limits=self.http_limits, where="--metrics-service-port")
        try:
            self._server.start()
        except RuntimeError as error:
            self._server = None
            raise OSError(f"cannot listen on 127.0.0.1:{self.port} ({error})") from None
        self.port = self._server.port  # port 0: the one the OS chose
        return self

    def update(self, step: int, metrics: dict[str, float]) -> None:
        with self.lock:
            self.step = step
            self.metrics = {key: float(value) for key, value in metrics.items()}

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
