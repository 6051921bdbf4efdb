"""Elastic scale-out and scale-in of rollout engines: the operations, their states and rules.

Upstream's semantics (relax-upstream.md §5), kept here:
- Scale-out: ``PENDING → CREATING`` (ray_native: an absolute target count of engines) or ``CONNECTING`` (external:
  engine URLs) ``→ HEALTH_CHECKING → WEIGHT_SYNCING → READY → ACTIVE``, or ``FAILED`` / ``CANCELLED``. A new engine
  gets the current weights *before* it joins the router, so it never serves training traffic with old weights
  (upstream registers it first and syncs later; we close that window). Failure policy ``rollback_all`` (default:
  remove every engine this operation added) or ``keep_partial``.
- Scale-in: ``PENDING → DRAINING → REMOVING → COMPLETED`` or ``FAILED``; a target count (the engines that remain) or
  URLs; the initial engines are protected (a target below their count is ``REJECTED``); scaled-out engines leave
  last-in-first-out; draining waits ``timeout_secs`` for in-flight requests (``force`` skips the wait), after which
  the engine leaves the router and finishes what it holds (upstream aborts them; here no request is lost); ``dry_run`` reports the selection without removing anything. Removals that succeeded stay removed.
- One operation at a time (a second one while another runs is a conflict, HTTP 409); a request that changes
  nothing (the target already met, the URLs already serving) is ``NOOP``; one that breaks a rule is ``REJECTED``
  (terminal: it never blocks the next one). Requests are idempotent by ``request_id``: the same id with the same
  kind and body returns the existing operation; the same id with another kind or body is a conflict.
- The manager may be called from any thread (the API serves from its own): operations run on the engines' event
  loop (``loop``), so the API answers at once even while that loop is busy, and cancelling is a request the
  operation honours at its next await (it rolls back, then ends ``CANCELLED``). ``timeout_secs`` is kept from the
  API's side: an operation still running at its deadline is ``FAILED`` then, even while the engines' loop is busy
  with a training step, and rolls back when that loop is free.
- A request is checked whole before anything starts (400 naming the field): every engine URL an http(s) URL with a
  host, no URL twice, a ``model_name`` the service serves, a ``request_id`` that can be polled (letters, digits and
  ``._:-``), a scale-in URL that names a serving engine.
- Engine URLs may carry credentials or a token; every answer and log shows them redacted (`relax.utils.urls`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import itertools
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from relax.backends.inference.base import InferenceEngine
from relax.backends.inference.router import EngineRouter, engine_name
from relax.utils.urls import parse_http_url, redact_url, redact_urls_in


class ScaleStatus(str, enum.Enum):
    PENDING = "PENDING"
    CREATING = "CREATING"
    CONNECTING = "CONNECTING"
    HEALTH_CHECKING = "HEALTH_CHECKING"
    WEIGHT_SYNCING = "WEIGHT_SYNCING"
    READY = "READY"
    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"
    REMOVING = "REMOVING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    NOOP = "NOOP"
    REJECTED = "REJECTED"


TERMINAL = {ScaleStatus.ACTIVE, ScaleStatus.COMPLETED, ScaleStatus.FAILED, ScaleStatus.CANCELLED, ScaleStatus.NOOP,
            ScaleStatus.REJECTED}


class ScaleConflictError(RuntimeError):
    """Another scale operation is running (HTTP 409)."""


class ScaleRejectedError(ValueError):
    """The request breaks a rule (HTTP 400); ``param`` names the field at fault when one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# ---- request / response bodies (upstream's schemas) ------------------------------------------------------------
# Bounds of a request body: a schema bound on top of --scale-out-max-engines, and the longest wait a request may ask.
MAX_REPLICAS = 1024
MAX_TIMEOUT_S = 86400.0
DEFAULT_MAX_ENGINES = 32  # upstream's autoscaler ceiling
REPLICA_START_TIMEOUT_S = 300.0  # a deployment's new replicas: Ray processes that import torch and load a model
RequestId = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$",
                  description="idempotency key (letters, digits and ._:-, so that it can be polled at "
                  "/scale_out/{request_id}): the same id with the same body returns the same operation")
DEFAULT_MODEL = "default"


def _engine_url(value: str) -> str:
    parse_http_url(value)  # ValueError says what is wrong without echoing the URL (it may hold a secret)
    return value.rstrip("/")


EngineURL = Annotated[str, AfterValidator(_engine_url)]


def _no_repeats(urls: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    for index, url in enumerate(urls):
        if url in seen:
            raise ValueError(f"URL {index} repeats URL {seen[url]}")
        seen[url] = index
    return urls


class _ScaleBody(BaseModel):
    # Strict: "2" is not a count and "yes" is not a boolean; an unknown field is a typo, not an option.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class ScaleOutRequest(_ScaleBody):
    model_name: str = Field(DEFAULT_MODEL, max_length=256)
    num_replicas: int = Field(0, ge=0, le=MAX_REPLICAS, description="ray_native: the total number of engines wanted")
    engine_urls: list[EngineURL] = Field(default_factory=list, max_length=MAX_REPLICAS,
                                         description="external: engines to connect (http(s) URLs, each once)")
    timeout_secs: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    request_id: str | None = RequestId

    _distinct = field_validator("engine_urls")(_no_repeats)


class ScaleInRequest(_ScaleBody):
    model_name: str = Field(DEFAULT_MODEL, max_length=256)
    num_replicas: int | None = Field(None, ge=0, le=MAX_REPLICAS,
                                     description="engines that remain (wins over engine_urls)")
    engine_urls: list[EngineURL] = Field(default_factory=list, max_length=MAX_REPLICAS)
    force: bool = False
    timeout_secs: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    dry_run: bool = False
    request_id: str | None = RequestId

    _distinct = field_validator("engine_urls")(_no_repeats)


class ScaleOperation(BaseModel):
    request_id: str
    kind: Literal["scale_out", "scale_in"]
    status: ScaleStatus
    model_name: str = "default"
    num_replicas: int | None = None
    engine_urls: list[str] = Field(default_factory=list)
    engine_ids: list[str] = Field(default_factory=list)  # scale-out: engines added
    selected_engines: list[str] = Field(default_factory=list)  # scale-in: engines chosen for removal
    removed_engines: list[str] = Field(default_factory=list)
    failed_engines: list[str] = Field(default_factory=list)
    weight_version: int | None = None
    error_message: str | None = None
    message: str = ""
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)


# ---- engines ----------------------------------------------------------------------------------------------------
@dataclass
class EngineRecord:
    engine_id: str
    engine: InferenceEngine
    url: str | None = None
    initial: bool = False
    added_at: float = field(default_factory=time.monotonic)


# Creates one engine for ray_native scale-out (e.g. an embedded engine or a new Ray process); returns (engine, url).
EngineFactory = Callable[[], Awaitable[tuple[InferenceEngine, str | None]]]
# Connects to an external engine URL.
EngineConnector = Callable[[str], Awaitable[InferenceEngine]]
# The trainer's current weights: (version, named tensors in HF naming).
WeightSource = Callable[[], tuple[int, Iterable[tuple[str, torch.Tensor]]]]


class ReplicaPool(Protocol):
    """Engines that are replicas of one deployment (`relax.core.engines.serve_deployment.EngineDeployment`): ray_native
    scaling sets their count and the deployment creates, health-checks, drains and removes them; a replica loads
    the newest published weights before the deployment routes to it."""

    def target(self) -> int: ...

    async def scale_to(self, count: int) -> None: ...

    async def wait_running(self, count: int, timeout_s: float) -> list[str]: ...

    async def replicas(self) -> list[dict[str, Any]]: ...


class ScaleManager:
    """Runs scale operations against an `EngineRouter`, one at a time.

    ``loop`` is the event loop the router's engines run on (default: the loop of the first scale call);
    ``max_engines`` caps a scale-out's target (each engine may be a whole model in memory). With ``replicas``
    (the engines are a Serve deployment) ray_native ``num_replicas`` counts that deployment's replicas and the
    deployment creates and removes them; ``engine_urls`` still add and remove external engines in the router.
    """

    def __init__(self, router: EngineRouter, weights: WeightSource, factory: EngineFactory | None = None,
                 connector: EngineConnector | None = None, failure_policy: str = "rollback_all",
                 drain_timeout_s: float = 60.0, health_timeout_s: float = 30.0,
                 max_engines: int = DEFAULT_MAX_ENGINES, loop: asyncio.AbstractEventLoop | None = None,
                 replicas: ReplicaPool | None = None, model_names: Iterable[str] = (DEFAULT_MODEL,)):
        if failure_policy not in ("rollback_all", "keep_partial"):
            raise ValueError(f"failure_policy must be rollback_all or keep_partial, got {failure_policy!r}")
        self.loop = loop
        self.max_engines = max_engines
        self.model_names = tuple(model_names)
        self._lock = threading.Lock()  # the API's thread registers operations, the engines' loop moves them
        self._bodies: dict[str, tuple[str, dict[str, Any]]] = {}  # request_id -> (kind, body): idempotency
        self.router = router
        self.weights = weights
        self.factory = factory
        self.connector = connector
        self.failure_policy = failure_policy
        self.drain_timeout_s = drain_timeout_s
        self.health_timeout_s = health_timeout_s
        self._engine_counter = itertools.count(0)
        self.engines: list[EngineRecord] = [
            EngineRecord(self._engine_id(e), e, url=getattr(e, "base_url", None), initial=True) for e in router.engines
        ]
        self.operations: dict[str, ScaleOperation] = {}
        self._tasks: dict[str, concurrent.futures.Future] = {}
        self._expired: set[str] = set()  # operations FAILED by their deadline (`_expire`), rolled back later
        self._counter = itertools.count(1)
        self.replicas = replicas
        self.initial_replicas = replicas.target() if replicas is not None else 0
        self._replica_table: list[dict[str, Any]] = []  # the deployment's replicas at the last operation's end
        self._replicas_before: dict[str, int] = {}  # running replica scale-outs: the count to roll back to

    # ---- queries ----------------------------------------------------------------------------------------------
    def get(self, request_id: str) -> ScaleOperation:
        try:
            return self.operations[request_id]
        except KeyError:
            raise KeyError(f"no scale operation {request_id!r}") from None

    def list(self, kind: str, status: str | None = None) -> list[ScaleOperation]:
        return [op for op in self.operations.values() if op.kind == kind and (status is None or op.status == status)]

    def engine_table(self) -> list[dict]:
        # The router names engines by base URL (or repr for in-process ones), not by our engine ids.
        healthy = {s["engine"]: s["healthy"] for s in self.router.stats()}
        # A Serve deployment is listed as its replicas
        table = [{"engine_id": r.engine_id, "url": r.url and redact_url(r.url),
                  "status": "initial" if r.initial else "scaled_out",
                  "is_healthy": healthy.get(engine_name(r.engine), False), "weight_version": r.engine.weight_version}
                 for r in self.engines if self.replicas is None or getattr(r.engine, "deployment", None) is not self.replicas]
        version = self.router.weight_version
        return table + [{"engine_id": f"serve-replica-{r['replica_id']}", "url": None, "status": "serve_replica",
                         "is_healthy": r["state"] == "RUNNING", "weight_version": version, "state": r["state"],
                         "pid": r.get("pid")}
                        for r in self._replica_table]

    async def refresh_replicas(self) -> None:
        """Read the deployment's replicas (for `engine_table`); call it on the engines' loop."""
        if self.replicas is not None:
            self._replica_table = await self.replicas.replicas()

    def _engine_id(self, engine: InferenceEngine) -> str:
        url = getattr(engine, "base_url", None)
        return redact_url(url.rstrip("/")) if url else f"embedded-{next(self._engine_counter)}"

    def _running(self) -> ScaleOperation | None:
        return next((op for op in self.operations.values() if op.status not in TERMINAL), None)

    def _new(self, kind: str, request: ScaleOutRequest | ScaleInRequest, **fields) -> ScaleOperation:
        op = ScaleOperation(request_id=request.request_id or f"{kind}-{next(self._counter)}-{uuid.uuid4().hex[:8]}",
                            kind=kind, status=ScaleStatus.PENDING, **fields)
        self.operations[op.request_id] = op
        self._bodies[op.request_id] = (kind, request.model_dump(exclude={"request_id"}))
        return op

    def _replay(self, kind: str, request: ScaleOutRequest | ScaleInRequest) -> ScaleOperation | None:
        """The operation an earlier request with this ``request_id`` started, if it was the same request;
        a conflict if the id was used for another kind or body."""
        if request.request_id is None or request.request_id not in self._bodies:
            return None
        if self._bodies[request.request_id] != (kind, request.model_dump(exclude={"request_id"})):
            raise ScaleConflictError(f"request_id {request.request_id!r} was already used for a different "
                                     f"{self._bodies[request.request_id][0]} request; use a new request_id")
        return self.operations[request.request_id]

    def _check_idle(self) -> None:
        running = self._running()
        if running is not None:
            raise ScaleConflictError(f"scale operation {running.request_id} is still running")

    def _reject(self, op: ScaleOperation, message: str) -> ScaleOperation:
        self._move(op, ScaleStatus.REJECTED, error_message=message)
        return op

    def _start(self, op: ScaleOperation, runner: Awaitable[None], timeout_s: float) -> None:
        """Run the operation on the engines' loop; the API's thread only registers it, and keeps its deadline
        (`_expire`), which holds even while that loop is busy."""
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        task = asyncio.run_coroutine_threadsafe(self._guard(op, runner, timeout_s), self.loop)
        self._tasks[op.request_id] = task
        deadline = threading.Timer(timeout_s, self._expire, args=(op, timeout_s))
        deadline.daemon = True
        deadline.start()
        task.add_done_callback(lambda _: deadline.cancel())

    def _expire(self, op: ScaleOperation, timeout_s: float) -> None:
        """The deadline passed with the operation unfinished: FAILED now; it rolls back on the engines' loop."""
        with self._lock:
            if op.status in TERMINAL:
                return
            self._expired.add(op.request_id)
            self._move(op, ScaleStatus.FAILED, error_message=f"TimeoutError: not done within timeout_secs "
                       f"{timeout_s:g} s; what it added is removed")
        self._tasks[op.request_id].cancel()

    def _check_request(self, request: ScaleOutRequest | ScaleInRequest) -> None:
        """Refuse (400 naming the field) what can be known wrong before anything starts."""
        if request.model_name not in self.model_names:
            raise ScaleRejectedError(f"model_name {request.model_name!r}: this service scales "
                                     f"{', '.join(map(repr, self.model_names))}", "model_name")

    @staticmethod
    def _move(op: ScaleOperation, status: ScaleStatus, **fields) -> None:
        op.status = status
        op.updated_at = time.time()
        for name, value in fields.items():
            setattr(op, name, value)

    async def wait(self, request_id: str, timeout_s: float = 300.0) -> ScaleOperation:
        """Wait until the operation reaches a terminal state (bounded; TimeoutError past it)."""
        op = self.get(request_id)
        deadline = time.monotonic() + timeout_s
        while op.status not in TERMINAL:
            if time.monotonic() > deadline:
                raise TimeoutError(f"scale operation {request_id} is still {op.status.value} after {timeout_s} s")
            await asyncio.sleep(0.01)
        return op

    # ---- scale out --------------------------------------------------------------------------------------------
    def scale_out(self, request: ScaleOutRequest) -> ScaleOperation:
        with self._lock:
            self._check_request(request)
            replayed = self._replay("scale_out", request)
            if replayed is not None:
                return replayed  # idempotent retry
            self._check_idle()
            if request.num_replicas > 0 and self.replicas is not None:
                op = self._new("scale_out", request, model_name=request.model_name, num_replicas=request.num_replicas)
                current = self.replicas.target()
                if request.num_replicas <= current:
                    self._move(op, ScaleStatus.NOOP, message=f"{current} replicas already serve")
                    return op
                if request.num_replicas > self.max_engines:
                    return self._reject(op, f"num_replicas {request.num_replicas} is above the limit of "
                                            f"{self.max_engines} engines (--scale-out-max-engines)")
                # A replica is a new process loading a model: bounded by the request's timeout_secs, else generously
                timeout_s = request.timeout_secs or REPLICA_START_TIMEOUT_S
                self._start(op, self._grow_replicas(op, current, request.num_replicas, timeout_s), timeout_s)
                return op
            elif request.num_replicas > 0:
                op = self._new("scale_out", request, model_name=request.model_name, num_replicas=request.num_replicas)
                missing = request.num_replicas - len(self.engines)
                if missing <= 0:
                    self._move(op, ScaleStatus.NOOP, message=f"{len(self.engines)} engines already serve")
                    return op
                if request.num_replicas > self.max_engines:
                    return self._reject(op, f"num_replicas {request.num_replicas} is above the limit of "
                                            f"{self.max_engines} engines (--scale-out-max-engines)")
                if self.factory is None:
                    return self._reject(op, "this service cannot create engines (ray_native); pass engine_urls")
                runner = self._create_engines(op, missing)
            else:
                known = {redact_url(r.url) for r in self.engines if r.url}
                urls = list(request.engine_urls)
                new_urls = [u for u in urls if redact_url(u) not in known]
                op = self._new("scale_out", request, model_name=request.model_name,
                               engine_urls=[redact_url(u) for u in urls])
                if not urls:
                    return self._reject(op, "give num_replicas > 0 or engine_urls")
                if not new_urls:
                    self._move(op, ScaleStatus.NOOP, message="every URL already serves")
                    return op
                if len(self.engines) + len(new_urls) > self.max_engines:
                    return self._reject(op, f"{len(new_urls)} more engines would exceed the limit of "
                                            f"{self.max_engines} (--scale-out-max-engines)")
                if self.connector is None:
                    return self._reject(op, "this service cannot connect external engines")
                runner = self._connect_engines(op, new_urls)
            self._start(op, runner, request.timeout_secs or max(self.health_timeout_s * 4, 60.0))
            return op

    async def _grow_replicas(self, op: ScaleOperation, current: int, target: int, timeout_s: float) -> None:
        self._replicas_before[op.request_id] = current
        before = {r["replica_id"] for r in await self.replicas.replicas()}
        op.weight_version = self.router.weight_version
        self._move(op, ScaleStatus.CREATING)
        await self.replicas.scale_to(target)
        self._move(op, ScaleStatus.HEALTH_CHECKING)  # a replica runs once its constructor and health check passed
        running = await self.replicas.wait_running(target, timeout_s)
        op.engine_ids = [f"serve-replica-{rid}" for rid in running if rid not in before]
        # Each new replica loaded the newest published version in its constructor, before Serve routed to it.
        self._move(op, ScaleStatus.WEIGHT_SYNCING)
        self._move(op, ScaleStatus.READY)
        await self.refresh_replicas()
        self._replicas_before.pop(op.request_id, None)
        self._move(op, ScaleStatus.ACTIVE, message=f"{target - current} replicas added ({target} serve)")

    async def _shrink_replicas(self, op: ScaleOperation, target: int, drain_s: float) -> None:
        """Serve stops sending the leaving replicas calls and lets them finish the ones they hold (its graceful
        shutdown, up to --scale-in-drain-timeout); nothing they hold is lost."""
        before = {r["replica_id"] for r in await self.replicas.replicas()}
        self._move(op, ScaleStatus.DRAINING)
        await self.replicas.scale_to(target)
        self._move(op, ScaleStatus.REMOVING)
        running = await self.replicas.wait_running(target, drain_s + max(self.health_timeout_s, 30.0))
        op.removed_engines = [f"serve-replica-{rid}" for rid in sorted(before - set(running))]
        await self.refresh_replicas()
        self._move(op, ScaleStatus.COMPLETED, message=f"{target} replicas serve")

    async def _create_engines(self, op: ScaleOperation, count: int) -> None:
        self._move(op, ScaleStatus.CREATING)
        created = [await self.factory() for _ in range(count)]
        await self._bring_up(op, [(engine, url) for engine, url in created])

    async def _connect_engines(self, op: ScaleOperation, urls: list[str]) -> None:
        self._move(op, ScaleStatus.CONNECTING)
        await self._bring_up(op, [(await self.connector(url), url) for url in urls])

    async def _bring_up(self, op: ScaleOperation, engines: list[tuple[InferenceEngine, str | None]]) -> None:
        records = [EngineRecord(self._engine_id(engine), engine, url=url) for engine, url in engines]
        op.engine_ids = [r.engine_id for r in records]
        self._move(op, ScaleStatus.HEALTH_CHECKING)
        for engine, _ in engines:
            await asyncio.wait_for(engine.health(), self.health_timeout_s)
        self._move(op, ScaleStatus.WEIGHT_SYNCING)
        version, named_tensors = self.weights()
        tensors = list(named_tensors)
        for engine, _ in engines:
            await engine.update_weights(tensors, version)
        self._move(op, ScaleStatus.READY, weight_version=version)
        for record in records:  # only now: no training request meets old weights
            await self.router.add_engine(record.engine)
            self.engines.append(record)
            latest, named_tensors = self.weights()
            if record.engine.weight_version != latest:  # a training update landed while it was syncing
                await record.engine.update_weights(list(named_tensors), latest)
        self._move(op, ScaleStatus.ACTIVE, message=f"{len(engines)} engines added at weight version {version}")

    async def _guard(self, op: ScaleOperation, runner: Awaitable[None], timeout_s: float) -> None:
        try:
            try:
                await asyncio.wait_for(runner, timeout_s)
            except TimeoutError:
                raise TimeoutError(f"not done within timeout_secs {timeout_s:g} s") from None
        except asyncio.CancelledError:
            await self._rollback(op)
            if op.request_id not in self._expired:  # FAILED already when its deadline passed (`_expire`)
                self._move(op, ScaleStatus.CANCELLED, message="cancelled; engines added by it were removed")
            raise
        except Exception as err:  # noqa: BLE001 - every failure becomes the operation's FAILED state
            if op.kind == "scale_out" and self.failure_policy == "rollback_all":
                await self._rollback(op)
            if op.request_id not in self._expired:
                self._move(op, ScaleStatus.FAILED, error_message=redact_urls_in(f"{type(err).__name__}: {err}"))

    async def _rollback(self, op: ScaleOperation) -> None:
        if op.request_id in self._replicas_before:  # a replica scale-out: back to the count before it
            await self.replicas.scale_to(self._replicas_before.pop(op.request_id))
        for record in [r for r in self.engines if r.engine_id in op.engine_ids and not r.initial]:
            await self.router.remove_engine(record.engine, drain=False)
            self.engines.remove(record)

    def cancel(self, request_id: str) -> ScaleOperation:
        """Ask a running operation to stop; it rolls back and ends CANCELLED at its next await on the engines'
        loop (at once when it has not started)."""
        with self._lock:
            op = self.get(request_id)
            if op.status in TERMINAL:
                raise ScaleRejectedError(f"{request_id} is already {op.status.value}")
            task = self._tasks.get(request_id)
            if task is None or not task.cancel():  # never started, or finished this instant
                if op.status not in TERMINAL:
                    self._move(op, ScaleStatus.CANCELLED, message="cancelled before it started")
                return op
            op.message = "cancelling: engines added by it are being removed"
            return op

    # ---- scale in ---------------------------------------------------------------------------------------------
    def scale_in(self, request: ScaleInRequest) -> ScaleOperation:
        with self._lock:
            self._check_request(request)
            if request.num_replicas is None:
                serving = {redact_url(r.url) for r in self.engines if r.url}
                for index, url in enumerate(request.engine_urls):
                    if redact_url(url) not in serving:
                        raise ScaleRejectedError(f"engine_urls.{index}: no engine with this URL serves (GET /engines "
                                                 "lists them)", f"engine_urls.{index}")
            replayed = self._replay("scale_in", request)
            if replayed is not None:
                return replayed
            self._check_idle()
            op = self._new("scale_in", request, model_name=request.model_name, num_replicas=request.num_replicas,
                           engine_urls=[redact_url(u) for u in request.engine_urls])
            removable = sorted((r for r in self.engines if not r.initial), key=lambda r: r.added_at, reverse=True)
            initial = len(self.engines) - len(removable)
            if request.num_replicas is not None and self.replicas is not None:
                current = self.replicas.target()
                if request.num_replicas < self.initial_replicas:
                    return self._reject(op, f"target {request.num_replicas} is below the {self.initial_replicas} "
                                            "initial replicas, which are protected")
                if request.num_replicas >= current:
                    self._move(op, ScaleStatus.NOOP, message=f"{current} replicas serve: nothing to remove")
                    return op
                if request.dry_run:
                    self._move(op, ScaleStatus.NOOP, message=f"dry run: would remove {current - request.num_replicas} "
                                                             "replicas (Serve chooses which)")
                    return op
                drain = 0.0 if request.force else (request.timeout_secs or self.drain_timeout_s)
                self._start(op, self._shrink_replicas(op, request.num_replicas, drain),
                            drain + max(self.health_timeout_s, 30.0) * 2)
                return op
            if request.num_replicas is not None:
                if request.num_replicas < initial:
                    return self._reject(op, f"target {request.num_replicas} is below the {initial} initial engines, "
                                            "which are protected")
                selected = removable[: max(len(self.engines) - request.num_replicas, 0)]  # last in, first out
            elif request.engine_urls:
                wanted = {redact_url(u) for u in request.engine_urls}
                protected = [redact_url(r.url) for r in self.engines if r.initial and r.url and redact_url(r.url) in wanted]
                if protected:
                    return self._reject(op, f"initial engines are protected: {protected}")
                selected = [r for r in removable if r.url and redact_url(r.url) in wanted]
            else:
                return self._reject(op, "give num_replicas or engine_urls")
            op.selected_engines = [r.engine_id for r in selected]
            if not selected:
                self._move(op, ScaleStatus.NOOP, message="nothing to remove")
                return op
            if request.dry_run:
                self._move(op, ScaleStatus.NOOP, message=f"dry run: would remove {op.selected_engines}")
                return op
            drain = 0.0 if request.force else (request.timeout_secs or self.drain_timeout_s)
            self._start(op, self._remove(op, selected, drain), drain + max(self.health_timeout_s, 30.0))
            return op

    async def _remove(self, op: ScaleOperation, selected: list[EngineRecord], drain_s: float) -> None:
        self._move(op, ScaleStatus.DRAINING)
        for record in selected:
            try:
                # Stop routing to it and wait for its requests up to the drain timeout; past it the engine leaves
                # the router anyway and finishes what it holds (those requests still return: nothing is lost).
                try:
                    await self.router.remove_engine(record.engine, drain=drain_s > 0, timeout_s=drain_s)
                except TimeoutError:
                    await self.router.remove_engine(record.engine, drain=False)
                self._move(op, ScaleStatus.REMOVING)
                self.engines.remove(record)
                op.removed_engines.append(record.engine_id)
            except Exception as err:  # noqa: BLE001 - partial success: report and go on
                op.failed_engines.append(redact_urls_in(f"{record.engine_id}: {err}"))
        if op.failed_engines and not op.removed_engines:
            raise RuntimeError(f"no engine could be removed: {op.failed_engines}")
        self._move(op, ScaleStatus.COMPLETED, message=f"removed {op.removed_engines}")
