"""Rollout engines as a Ray Serve deployment (``--rollout-serve-replicas N``).

Each Serve replica is one embedded engine (built as the in-process engine is) in a Ray process of its own, so the
mechanisms around engines are Serve's, not ours:

- **Routing**: the rollout sends one call per replica (whole prompt groups each) through a `DeploymentHandle`;
  Serve's router places each on a replica by queue length, and a replica decodes a call as one batch.
- **Health and restarts**: Serve calls each replica's ``check_health`` every ``--rollout-health-check-interval``
  seconds and replaces a replica that fails it or dies; a call that was on a dead replica is sent again and Serve
  routes it to a live one (`ServeEngine.generate`), so no group is lost.
- **Scaling**: the replica count is the deployment's target (Serve's external-scaler API, the one behind the Ray
  dashboard's ``.../deployments/{name}/scale`` endpoint); the scaling REST API's ray_native ``num_replicas`` sets
  it (`EngineDeployment` is the `ReplicaPool` of `relax.rollout.scaling.ScaleManager`). Scale-in is Serve's graceful
  shutdown: a replica leaving gets no new calls and finishes the ones it holds (up to ``--scale-in-drain-timeout``).
- **Weights**: the trainer publishes each version once as safetensors under the rollout weights directory
  (`ServeEngine.publish_weights`, the disk transport shared with external engines); every call carries the version
  it wants and a replica loads it between calls (after the calls in flight, before the call that wants it: every
  call is decoded by one version, so a weight push does not wait for the generation in flight), and a replica Serve
  starts (scale-out, restart) loads the newest published version in its constructor, before Serve routes to it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from relax.backends.inference.base import (
    PAUSE_OPERATOR,
    GenerationOutput,
    GenerationRequest,
    InferenceEngine,
    OutputCallback,
    OutputReporter,
    PauseHolds,
    positions_by_group,
)
from relax.backends.inference.remote.sglang import distinct_seeds
from relax.config import RelaxConfig, flag
from relax.core.engines.embedded import build_engine
from relax.core.preflight import check_model_path
from relax.core.run_settings import resolve_device, resolve_dtype
from relax.distributed.weight_disk import DiskPublisher, DiskReceiver, complete_versions
from relax.utils.local_ray import start_local_ray

logger = logging.getLogger("relax")

APP_NAME = "relax_rollout_engines"
DEPLOYMENT_NAME = "EngineReplica"
RAY_CPUS = 8  # logical CPUs of a Ray this module starts: replicas and Serve's controller, whatever the cores
MAX_CALL_RETRIES = 3  # a call that met a dying replica is sent again this many times
KEEP_VERSIONS = 3  # a replica loading version v while v+1 and v+2 are published still finds v
# The deployment's first replicas: Ray processes that import torch and load a model, which from network storage or
# on a busy machine takes minutes. A hang guard, not an estimate: progress is logged every START_REPORT_S, and a
# replica the cluster cannot hold is refused before the wait (`_check_fits`).
START_TIMEOUT_S = 1800.0
START_REPORT_S = 60.0
RAY_RESOURCE_NAMES = {"num_cpus": "CPU", "num_gpus": "GPU"}  # ray_actor_options' names -> the cluster's


class EngineReplica:
    """One Serve replica: an embedded engine serving the newest weight version published under ``weights_dir``."""

    async def __init__(self, cfg: RelaxConfig, weights_dir: str) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from ray import serve
        from transformers import AutoTokenizer

        device = resolve_device(cfg)
        if device.type == "cpu":
            torch.set_num_threads(1)  # replicas share the machine's cores
        model_path = check_model_path(cfg)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = build_engine(model_path, AutoTokenizer.from_pretrained(model_path), cfg, device,
                                   resolve_dtype(cfg, device))
        self.weights = DiskReceiver(weights_dir, self.engine)
        # Every call is decoded by one weight version: a load waits for the calls in flight, and calls wait for it
        self._calls = 0
        self._loading = False
        self._turn = asyncio.Condition()
        newest = self.weights.latest_version()
        if newest is not None:  # started while a training runs (scale-out, a restart): serve its weights first
            await self._load(newest)

    async def _load(self, version: int) -> None:
        newer = [v for v in complete_versions(self.weights.root) if v >= version]
        await self.weights.apply(newer[-1] if newer else version)

    async def _admit(self, version: int) -> None:
        """Count a call in once the replica serves ``version`` or newer; the first call that wants a newer version
        loads it, after the calls in flight (older weights) have finished."""
        async with self._turn:
            while True:
                if self._loading:
                    await self._turn.wait()
                elif self.engine.weight_version >= version:
                    self._calls += 1
                    return
                else:
                    self._loading = True
                    try:
                        await self._turn.wait_for(lambda: self._calls == 0)
                        await self._load(version)
                    finally:
                        self._loading = False
                        self._turn.notify_all()

    async def generate(self, requests: list[GenerationRequest], version: int) -> list[GenerationOutput]:
        await self._admit(version)
        try:
            return await self.engine.generate(requests)
        finally:
            async with self._turn:
                self._calls -= 1
                self._turn.notify_all()

    async def check_health(self) -> None:
        """Serve's periodic probe: raising (or not answering in time) gets this replica replaced."""
        await self.engine.health()

    async def describe(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "pid": os.getpid(), "weight_version": self.engine.weight_version}


def _replica_environment() -> dict[str, str]:
    """Replicas import `relax` and dotted-path plugins as this process does, one thread each."""
    paths = [os.getcwd(), *(p for p in sys.path if p and os.path.isdir(p))]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "TOKENIZERS_PARALLELISM": "false"}


class EngineDeployment:
    """The Serve application of the rollout engines: starts it (and a local Ray bound to 127.0.0.1 when none runs),
    sets its replica count, lists its replicas, and tears it down."""

    def __init__(self, cfg: RelaxConfig, weights_dir: Path) -> None:
        import ray
        from ray import serve

        self.started_ray = False
        if not ray.is_initialized():
            start_local_ray(max(RAY_CPUS, cfg.rollout_serve_replicas + 2),
                            runtime_env={"env_vars": _replica_environment()})
            self.started_ray = True
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its per-call INFO lines would flood stderr
        serve.start(proxy_location="Disabled")  # the controller is the only caller: no HTTP proxy
        use_gpu = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        resources = {"num_gpus": cfg.rollout_num_gpus_per_engine, "num_cpus": 1} if use_gpu else {"num_cpus": 1}
        deployment = serve.deployment(
            EngineReplica, name=DEPLOYMENT_NAME, ray_actor_options=resources,
            max_ongoing_requests=max(64, cfg.rollout_batch_size * 2),
            health_check_period_s=cfg.rollout_health_check_interval,
            health_check_timeout_s=cfg.rollout_health_check_timeout,
            graceful_shutdown_timeout_s=cfg.scale_in_drain_timeout, graceful_shutdown_wait_loop_s=0.2,
        )
        started = time.perf_counter()
        try:
            if self.started_ray:  # a cluster of this machine's resources only: what does not fit now never will
                self._check_fits(resources, cfg.rollout_serve_replicas)
            self.handle = serve._run(deployment.options(num_replicas=cfg.rollout_serve_replicas).bind(
                cfg, str(weights_dir)), name=APP_NAME, route_prefix=None, external_scaler_enabled=True,
                _blocking=False)
            self._target = cfg.rollout_serve_replicas
            self._wait_started(resources, START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("rollout engines: Ray Serve deployment %s/%s with %d replica(s) up in %.1f s", APP_NAME,
                    DEPLOYMENT_NAME, self._target, time.perf_counter() - started)

    @staticmethod
    def _check_fits(resources: dict[str, float], replicas: int) -> None:
        import ray

        cluster = ray.cluster_resources()
        short = shortfall(resources, replicas, cluster)
        if short:
            raise RuntimeError(
                f"{flag('rollout_serve_replicas')}: {replicas} replica(s) of {resources} each need {short}, more than "
                f"the local Ray has ({cluster}); {flag('rollout_num_gpus_per_engine')} sets a replica's GPUs")

    def _wait_started(self, resources: dict[str, float], timeout_s: float) -> None:
        """Until the application runs; a failed deployment raises naming the cause, and so does one not running
        within ``timeout_s`` (a replica a joined cluster cannot place waits for ever). Logs where the replicas
        stand every `START_REPORT_S`."""
        import ray
        from ray import serve
        from ray.serve.schema import ApplicationStatus

        started = time.monotonic()
        reported = started
        while True:
            application = serve.status().applications.get(APP_NAME)
            status = getattr(application, "status", None)
            if status == ApplicationStatus.RUNNING:
                return
            if status == ApplicationStatus.DEPLOY_FAILED:
                raise RuntimeError(f"{flag('rollout_serve_replicas')}: the rollout engines' Serve deployment failed: "
                                   f"{application.message}")
            now = time.monotonic()
            if now - started > timeout_s:
                raise RuntimeError(
                    f"{flag('rollout_serve_replicas')}: {self._target} replica(s) of {resources} each did not start "
                    f"within {timeout_s:g} s ({replica_progress(application)}; the cluster has "
                    f"{ray.cluster_resources()}; {flag('rollout_num_gpus_per_engine')} sets a replica's GPUs)")
            if now - reported >= START_REPORT_S:
                reported = now
                logger.info("rollout engines: %d replica(s) starting for %.0f s (%s)", self._target, now - started,
                            replica_progress(application))
            time.sleep(0.2)

    # ---- ReplicaPool (relax.rollout.scaling) -------------------------------------------------------------------
    def target(self) -> int:
        return self._target

    async def scale_to(self, count: int) -> None:
        from ray.serve._private.common import DeploymentID

        await self._controller().update_deployment_replicas.remote(
            DeploymentID(name=DEPLOYMENT_NAME, app_name=APP_NAME), count)
        self._target = count

    async def wait_running(self, count: int, timeout_s: float) -> list[str]:
        """The ids of the running replicas once exactly ``count`` run and none starts or stops."""
        deadline = time.monotonic() + timeout_s
        while True:
            replicas = await self.replicas()
            running = [r["replica_id"] for r in replicas if r["state"] == "RUNNING"]
            if len(running) == count == len(replicas):
                return running
            if time.monotonic() > deadline:
                states = ", ".join(f"{r['replica_id']} {r['state']}" for r in replicas) or "none"
                raise TimeoutError(f"{count} running replicas wanted after {timeout_s:g} s; Serve has: {states}")
            await asyncio.sleep(0.2)

    async def replicas(self) -> list[dict[str, Any]]:
        details = await self._controller().get_serve_instance_details.remote()
        deployment = details.get("applications", {}).get(APP_NAME, {}).get("deployments", {}).get(DEPLOYMENT_NAME, {})
        return [{"replica_id": r["replica_id"], "state": r["state"], "pid": r.get("pid")}
                for r in deployment.get("replicas", [])]

    @staticmethod
    def _controller():
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)

    def shutdown(self) -> None:
        import ray
        from ray import serve

        if self.started_ray:  # the replicas and Serve's controller end with the Ray this process started
            ray.shutdown()
        elif ray.is_initialized():
            serve.delete(APP_NAME)


def shortfall(resources: dict[str, float], replicas: int, cluster: dict[str, float]) -> dict[str, float]:
    """What ``replicas`` replicas of ``resources`` (`ray_actor_options` names) need beyond ``cluster`` (Ray's
    `cluster_resources`): their total of each resource the cluster has too little of."""
    return {name: amount * replicas for name, amount in resources.items()
            if amount * replicas > cluster.get(RAY_RESOURCE_NAMES[name], 0.0) + 1e-9}


def replica_progress(application: Any) -> str:
    """Serve's word on the deployment's replicas: their states and its message."""
    deployment = getattr(application, "deployments", {}).get(DEPLOYMENT_NAME)
    if deployment is None:
        return "the deployment is not created yet"
    states = ", ".join(f"{count} {getattr(state, 'value', state)}"
                       for state, count in deployment.replica_states.items()) or "no replicas"
    return f"{states}; {deployment.message}" if deployment.message else states


def _is_replica_loss(error: BaseException) -> bool:
    """A call that failed because its replica died or left (Serve routes the next try to a live one)."""
    import ray

    return isinstance(error, ray.exceptions.RayActorError | ray.exceptions.ActorUnavailableError)


class ServeEngine(InferenceEngine):
    """`InferenceEngine` over the deployment: one call per replica (whole prompt groups), the version it wants in
    every call.

    ``weights_dir`` / `publish_weights` / `load_weights` are the disk transport of `EngineRouter` (the trainer's
    tensors are written once, shared with external engines of the same directory)."""

    # Each call is decoded by the one version it names (the replica loads a new version between calls): a weight
    # push needs not wait for the generation in flight to keep every sample on one version.
    calls_keep_their_version = True

    def __init__(self, deployment: EngineDeployment, weights_dir: Path) -> None:
        self.deployment = deployment
        self.weights_dir = Path(weights_dir)
        self._version = 0
        self._holds = PauseHolds()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._in_flight: dict[str, Any] = {}  # request id -> the DeploymentResponse carrying it

    @property
    def base_url(self) -> str:  # how the router and the scaling API name this engine
        return f"serve://{APP_NAME}/{DEPLOYMENT_NAME}"

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        return await self.generate_streaming(requests, None)

    async def generate_streaming(self, requests: Sequence[GenerationRequest],
                                 on_output: OutputCallback | None) -> list[GenerationOutput]:
        """`generate`, reporting the requests of each replica's call when that call returns."""
        if not requests:  # nothing to route (a step whose groups were all taken from the carry-over, say)
            return []
        report = OutputReporter(len(requests), on_output)
        await self._resumed.wait()
        requests = distinct_seeds(requests)
        groups = positions_by_group(requests)
        # One call per replica, whole groups each (a replica decodes a call as one batch; many small calls would
        # each pay Serve's routing and decode apart); Serve's router spreads the calls over the replicas.
        calls = max(1, min(len(groups), self.deployment.target()))
        chunks: list[list[int]] = [[] for _ in range(calls)]
        for index, positions in enumerate(groups.values()):
            chunks[index % calls].extend(positions)
        outputs: list[GenerationOutput | None] = [None] * len(requests)

        async def run_call(positions: list[int]) -> None:
            batch = [requests[p] for p in positions]
            for attempt in range(MAX_CALL_RETRIES + 1):
                response = self.deployment.handle.generate.remote(batch, self._version)
                for request in batch:
                    self._in_flight[request.request_id] = response
                try:
                    results = await response
                    break
                except Exception as error:
                    if not _is_replica_loss(error) or attempt == MAX_CALL_RETRIES:
                        raise
                    logger.warning("a rollout engine replica was lost with %d requests (%s); sending them again "
                                   "(%d/%d)", len(batch), type(error).__name__, attempt + 1, MAX_CALL_RETRIES)
                finally:
                    for request in batch:
                        self._in_flight.pop(request.request_id, None)
            for position, output in zip(positions, results):
                outputs[position] = output
                report(position, output)

        await asyncio.gather(*(run_call(positions) for positions in chunks))
        return report.finish(outputs)

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Cancel the calls carrying these requests (Serve cancels them on their replica)."""
        for response in {id(r): r for rid in request_ids if (r := self._in_flight.get(rid)) is not None}.values():
            response.cancel()

    async def pause(self, owner: str = PAUSE_OPERATOR) -> None:
        if self._holds.hold(owner):
            self._resumed.clear()

    async def resume(self, owner: str = PAUSE_OPERATOR) -> None:
        if self._holds.release(owner) and not self._holds:
            self._resumed.set()

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await self.publish_weights(named_tensors, version)
        await self.load_weights(version)

    async def publish_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await DiskPublisher(self.weights_dir, keep_last=KEEP_VERSIONS).publish([list(named_tensors)], version)

    async def load_weights(self, version: int | None = None) -> int:
        """From now on every call asks for ``version`` (default: the newest published); replicas load it on their
        next call."""
        versions = complete_versions(self.weights_dir)
        if version is None:
            if not versions:
                raise FileNotFoundError(f"no complete weight version under {self.weights_dir}")
            version = versions[-1]
        elif version not in versions:
            raise FileNotFoundError(f"weight version {version} is not published under {self.weights_dir}")
        self._version = version
        return version

    async def health(self) -> dict[str, Any]:
        """One replica's report (Serve checks every replica itself)."""
        return {"status": "ok", **await self.deployment.handle.describe.remote(), "url": self.base_url}

    @property
    def weight_version(self) -> int:
        return self._version

    async def aclose(self) -> None:
        await asyncio.to_thread(self.deployment.shutdown)
