"""`EngineRouter`: one `InferenceEngine` in front of N engines (HTTP adapters or in-process engines).

- **Least outstanding requests**: a new request group goes to the routable engine with the fewest requests in
  flight (ties: the engine that got work least recently).
- **Sticky groups**: requests sharing a group key go to one engine, so a server can share their prefill. The
  key is the ``g<group>-`` prefix of the request id that `relax.rollout.generation.generate` gives the samples
  of one prompt (``g3-i12-0`` is group ``3``); other ids are groups of their own.
- **Health**: a request that fails with a connection error, a timeout or HTTP 5xx marks its engine down and
  is retried on another engine (``max_retries`` times), so no request is lost when an engine dies. An engine
  with requests in flight is health-checked every ``health_check_interval_s``; one that stops answering (hung,
  SIGSTOPped) is given up on after ``health_check_max_failures`` checks and its whole groups go elsewhere. A down
  engine is probed again (``health()``) after ``retry_down_after_s`` and routed to once it answers (after
  catching up to the router's weight version when it can load it from disk).
- **Relaunch** (``relaunch_limit`` > 0; ``--use-fault-tolerance``): an engine this run started (one with a
  ``relaunch()`` method: `relax serve` or vLLM processes) that is marked down is killed and started again in the
  background, at most ``relaunch_limit`` times, then brought to the router's weight version before it gets work.
  While a relaunch runs, a call with no other engine waits for it instead of failing after ``wait_for_engine_s``.
- **Fan-out**: `update_weights`, `pause`, `resume` and `abort` go to every engine; the router's
  `weight_version` is the minimum over the engines it routes to.
- **Elastic**: `add_engine` and `remove_engine(drain=True)` (stop routing to it, wait for its in-flight
  requests, drop it) change the set at runtime.

Requests keep the order of the call; seeds shared by several requests are made distinct first (see
`relax.backends.inference.remote.sglang.distinct_seeds`), so the samples do not depend on the routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from relax.backends.inference.base import (
    PAUSE_OPERATOR,
    GenerationOutput,
    GenerationRequest,
    InferenceEngine,
    OutputCallback,
    OutputReporter,
    positions_by_group,
)
from relax.backends.inference.remote.broadcast import BroadcastWeightTransport
from relax.backends.inference.remote.sglang import distinct_seeds
from relax.distributed.weight_sync import bucketize

logger = logging.getLogger(__name__)

MAX_STICKY_GROUPS = 100_000
DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024  # one collective per bucket; bounds the flat copy it needs


class NoEngineAvailableError(RuntimeError):
    """Every engine is down (or removed) and none came back within the wait."""


class EngineUnresponsiveError(RuntimeError):
    """An engine with requests in flight stopped answering its health checks (hung, stopped, partitioned)."""

    retryable = True


def is_retryable(error: BaseException) -> bool:
    """Failures of the engine, not of the request: another engine may serve it."""
    retryable = getattr(error, "retryable", None)
    if retryable is not None:
        return bool(retryable)
    return isinstance(error, (ConnectionError, TimeoutError, OSError))


def engine_name(engine: InferenceEngine) -> str:
    return getattr(engine, "base_url", None) or repr(engine)


@dataclass(eq=False)
class _Slot:
    engine: InferenceEngine
    outstanding: int = 0
    healthy: bool = True
    draining: bool = False
    down_since: float = 0.0
    last_error: str = ""
    last_assigned: float = 0.0
    in_flight: set[str] = field(default_factory=set)
    served: int = 0  # requests completed here
    relaunches: int = 0  # relaunches started
    relaunching: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return engine_name(self.engine)


class EngineRouter(InferenceEngine):
    def __init__(self, engines: Sequence[InferenceEngine], max_retries: int = 3, retry_down_after_s: float = 5.0,
                 wait_for_engine_s: float = 30.0, health_timeout_s: float = 10.0,
                 weight_transport: BroadcastWeightTransport | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, health_check_interval_s: float | None = None,
                 health_check_timeout_s: float = 30.0, health_check_max_failures: int = 2,
                 relaunch_limit: int = 0) -> None:
        self._slots: list[_Slot] = []
        for engine in engines:
            self._slots.append(_Slot(engine))
        self.max_retries = max_retries
        self.retry_down_after_s = retry_down_after_s
        self.wait_for_engine_s = wait_for_engine_s
        self.health_timeout_s = health_timeout_s
        self.bucket_bytes = bucket_bytes
        # While an engine has requests in flight it is health-checked every interval; after max_failures checks in a
        # row fail, its requests are taken back and sent to another engine (None: only failed calls count).
        self.health_check_interval_s = health_check_interval_s
        self.health_check_timeout_s = health_check_timeout_s
        self.health_check_max_failures = health_check_max_failures
        # Relaunches per engine that can relaunch itself (0: never; a down engine is only probed again).
        self.relaunch_limit = relaunch_limit
        self._sticky: OrderedDict[str, _Slot] = OrderedDict()
        self._version: int | None = None  # the last version pushed by update_weights
        # Pushes versions to every (HTTP) engine over one broadcast group instead of through the disk.
        self.weight_transport = weight_transport

    # ---------------------------------------------------------------------------- engine set

    @property
    def engines(self) -> list[InferenceEngine]:
        return [slot.engine for slot in self._slots]

    def stats(self) -> list[dict[str, Any]]:
        return [{"engine": slot.name, "healthy": slot.healthy, "draining": slot.draining,
                 "outstanding": slot.outstanding, "served": slot.served, "weight_version": slot.engine.weight_version,
                 "relaunches": slot.relaunches, "relaunching": slot.relaunching is not None,
                 "pid": getattr(slot.engine, "server_pid", None),  # of a server this run started
                 "last_error": slot.last_error} for slot in self._slots]

    async def add_engine(self, engine: InferenceEngine) -> None:
        """Route to ``engine`` from now on, after bringing it to the router's weight version when it can load
        the newest version from disk (an engine behind can otherwise not be routed to until the next update)."""
        slot = _Slot(engine)
        self._slots.append(slot)
        await self._probe(slot)

    async def remove_engine(self, engine: InferenceEngine | str, drain: bool = True, timeout_s: float = 60.0) -> None:
        """Stop routing new work to ``engine`` (the object or its base URL); with ``drain``, wait until its
        in-flight requests finished (TimeoutError after ``timeout_s``, leaving it draining: call again with
        ``drain=False`` to drop it anyway), then drop it."""
        slot = self._find(engine)
        slot.draining = True
        for key in [key for key, value in self._sticky.items() if value is slot]:
            del self._sticky[key]
        if drain:
            deadline = time.monotonic() + timeout_s
            while slot.outstanding:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"remove_engine {slot.name}: {slot.outstanding} requests still in flight "
                                       f"after {timeout_s} s")
                await asyncio.sleep(0.01)
        self._slots.remove(slot)
        self._cancel_relaunch(slot)

    def _find(self, engine: InferenceEngine | str) -> _Slot:
        for slot in self._slots:
            if slot.engine is engine or (isinstance(engine, str) and slot.name.rstrip("/") == engine.rstrip("/")):
                return slot
        raise KeyError(f"engine {engine!r} is not in the router (engines: {[s.name for s in self._slots]})")

    # ---------------------------------------------------------------------------- routing

    def _routable(self, exclude: set[int] = frozenset()) -> list[_Slot]:
        return [s for s in self._slots if s.healthy and not s.draining and id(s) not in exclude and self._current(s)]

    def _current(self, slot: _Slot) -> bool:
        return self._version is None or slot.engine.weight_version >= self._version

    async def _pick(self, key: str, exclude: set[int]) -> _Slot:
        """The engine for the requests of group ``key``; waits (bounded) while none is routable."""
        deadline = time.monotonic() + self.wait_for_engine_s
        while True:
            sticky = self._sticky.get(key)
            if sticky is not None and sticky in self._routable(exclude):
                self._sticky.move_to_end(key)
                return sticky
            await self._probe_due()
            candidates = self._routable(exclude) or self._routable()
            if candidates:
                slot = min(candidates, key=lambda s: (s.outstanding, s.last_assigned))
                slot.last_assigned = time.monotonic()
                self._sticky[key] = slot
                while len(self._sticky) > MAX_STICKY_GROUPS:
                    self._sticky.popitem(last=False)
                return slot
            if time.monotonic() > deadline and not self._relaunching():
                raise NoEngineAvailableError(
                    f"no engine can serve requests after {self.wait_for_engine_s} s: "
                    + "; ".join(f"{s.name}: {'draining' if s.draining else 'behind the weights' if s.healthy else 'down'}"
                                f"{' (' + s.last_error + ')' if s.last_error else ''}" for s in self._slots)
                    if self._slots else "the router has no engines")
            await asyncio.sleep(min(0.2, self.retry_down_after_s))

    async def _probe_due(self) -> None:
        now = time.monotonic()
        due = [s for s in self._slots if (not s.healthy or not self._current(s)) and s.relaunching is None
               and now - s.down_since >= self.retry_down_after_s]
        if due:
            await asyncio.gather(*(self._probe(slot) for slot in due))

    async def _probe(self, slot: _Slot, relaunched: bool = False) -> bool:
        """Health-check one engine; a healthy engine behind the router's version loads it when it can."""
        if slot.relaunching is not None and not relaunched:
            return False  # the relaunch probes it when the new process is up
        try:
            await asyncio.wait_for(slot.engine.health(), self.health_timeout_s)
            if self._version is not None and slot.engine.weight_version < self._version:
                load = getattr(slot.engine, "load_weights", None)
                if load is not None:
                    await self._watched(slot, load(self._version))
        except Exception as error:  # noqa: BLE001 - any failure keeps it out of rotation
            if relaunched:  # the relaunch reports it; a failure here must not start another from inside it
                slot.last_error = f"{type(error).__name__}: {error}"[:300]
                return False
            self._mark_down(slot, error)
            return False
        if not slot.healthy and not relaunched:
            logger.warning("engine %s is back", slot.name)
        slot.healthy, slot.last_error = True, ""
        if not self._current(slot):  # cannot catch up by itself: probe again later, not on every pick
            slot.down_since = time.monotonic()
            slot.last_error = f"serves weight version {slot.engine.weight_version}, behind {self._version}"
        return True

    def _mark_down(self, slot: _Slot, error: BaseException) -> None:
        if slot.healthy:
            logger.warning("engine %s is down: %s", slot.name, error)
        slot.healthy = False
        slot.down_since = time.monotonic()
        slot.last_error = f"{type(error).__name__}: {error}"[:300]
        self._maybe_relaunch(slot)

    # ---------------------------------------------------------------------------- relaunch

    def _relaunching(self) -> bool:
        return any(slot.relaunching is not None for slot in self._slots)

    def _maybe_relaunch(self, slot: _Slot) -> None:
        relaunch = getattr(slot.engine, "relaunch", None)
        if relaunch is None or slot.relaunching is not None or slot.draining or slot not in self._slots:
            return
        if slot.relaunches >= self.relaunch_limit:
            if self.relaunch_limit:
                logger.error("engine %s is down and was relaunched %d times already (the limit): it stays down",
                             slot.name, slot.relaunches)
            return
        slot.relaunches += 1
        slot.relaunching = asyncio.get_running_loop().create_task(self._relaunch(slot, relaunch))

    async def _relaunch(self, slot: _Slot, relaunch) -> None:
        """Kill and restart the engine, then probe it: the probe loads the router's weight version into it, so
        it serves nothing older than the other engines."""
        started = time.monotonic()
        logger.warning("relaunching engine %s (%d/%d): %s", slot.name, slot.relaunches, self.relaunch_limit,
                       slot.last_error)
        try:
            await relaunch()
            back = await self._probe(slot, relaunched=True)
            for _ in range(3):  # a newer version published while it loaded the last one: load that too
                if not back or self._current(slot):
                    break
                back = await self._probe(slot, relaunched=True)
        except Exception as error:  # noqa: BLE001 - a failed relaunch leaves it down; the next failure retries
            back = False
            slot.last_error = f"relaunch failed: {type(error).__name__}: {error}"[:300]
        finally:
            slot.relaunching = None
        if back and self._current(slot):
            logger.warning("engine %s relaunched in %.1f s, serving weight version %d", slot.name,
                           time.monotonic() - started, slot.engine.weight_version)
        else:
            logger.error("engine %s: relaunch %d did not bring it back: %s", slot.name, slot.relaunches,
                         slot.last_error)
            slot.healthy, slot.down_since = False, time.monotonic()

    def _cancel_relaunch(self, slot: _Slot) -> None:
        if slot.relaunching is not None:
            slot.relaunching.cancel()
            slot.relaunching = None

    # ---------------------------------------------------------------------------- InferenceEngine

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        """Place each request group on an engine, send every engine its requests in one call (so an embedded
        engine decodes them as one batch and shares the group's prefill), and retry the groups of an engine
        that fails on the others, at most ``max_retries`` times: no request is lost while one engine lives."""
        return await self.generate_streaming(requests, None)

    async def generate_streaming(self, requests: Sequence[GenerationRequest],
                                 on_output: OutputCallback | None) -> list[GenerationOutput]:
        """`generate`, reporting each request when its engine reports it (each engine's own `generate_streaming`)."""
        report = OutputReporter(len(requests), on_output)
        requests = distinct_seeds(requests)
        groups = positions_by_group(requests)
        outputs: list[GenerationOutput | None] = [None] * len(requests)
        tried: dict[str, set[int]] = {key: set() for key in groups}
        pending = list(groups.items())
        for attempt in range(self.max_retries + 1):
            placed: dict[int, tuple[_Slot, list[tuple[str, list[int]]]]] = {}
            for key, positions in pending:  # one after the other: each pick sees the load placed before it
                slot = await self._pick(key, tried[key])
                slot.outstanding += len(positions)
                placed.setdefault(id(slot), (slot, []))[1].append((key, positions))
            batches = list(placed.values())
            results = await asyncio.gather(*(self._run_batch(slot, items, requests, report)
                                             for slot, items in batches), return_exceptions=True)
            pending = []
            for (slot, items), result in zip(batches, results):
                if isinstance(result, BaseException):
                    if not is_retryable(result) or attempt == self.max_retries:
                        raise result
                    self._mark_down(slot, result)
                    logger.warning("%d requests failed on %s (%s); retrying them on another engine (%d/%d)",
                                   sum(len(p) for _, p in items), slot.name, result, attempt + 1, self.max_retries)
                    for key, positions in items:
                        tried[key].add(id(slot))
                        pending.append((key, positions))
                else:
                    for position, output in result:
                        outputs[position] = output
            if not pending:
                break
        return report.finish(outputs)

    async def _run_batch(self, slot: _Slot, items: list[tuple[str, list[int]]], requests: Sequence[GenerationRequest],
                         report: OutputReporter) -> list[tuple[int, GenerationOutput]]:
        """One engine call for the groups placed on ``slot`` (already counted in its ``outstanding``)."""
        positions = [position for _, group in items for position in group]
        batch = [requests[position] for position in positions]
        ids = {request.request_id for request in batch}
        slot.in_flight.update(ids)
        try:
            outputs = await self._watched(slot, slot.engine.generate_streaming(
                batch, lambda index, output: report(positions[index], output)))
            slot.served += len(batch)
            return list(zip(positions, outputs))
        finally:
            slot.in_flight.difference_update(ids)
            slot.outstanding -= len(batch)

    async def _watched(self, slot: _Slot, call):
        """``call`` on ``slot``'s engine (a generation, a weight load, a pause), health-checked while it runs: an
        engine that stops answering (a stopped process, a hung server: the call would otherwise wait out its HTTP
        timeout) is given up on after ``health_check_max_failures`` failed checks in a row, with
        `EngineUnresponsiveError` (retried elsewhere)."""
        task = asyncio.ensure_future(call)
        if self.health_check_interval_s is None:
            return await task
        failures, started = 0, time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.health_check_interval_s)
                if done:
                    return task.result()
                try:
                    await asyncio.wait_for(slot.engine.health(), self.health_check_timeout_s)
                    failures = 0
                except Exception as error:  # noqa: BLE001 - any failed check counts
                    failures += 1
                    logger.warning("engine %s failed health check %d/%d with a call in flight: %s", slot.name,
                                   failures, self.health_check_max_failures, f"{type(error).__name__}: {error}"[:200])
                    if failures >= self.health_check_max_failures:
                        raise EngineUnresponsiveError(
                            f"{slot.name} stopped answering health checks ({failures} in a row, every "
                            f"{self.health_check_interval_s} s, {self.health_check_timeout_s} s each) after "
                            f"{time.monotonic() - started:.1f} s with a call in flight") from None
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def abort(self, request_ids: Sequence[str]) -> None:
        ids = set(request_ids)
        targets = [(slot, sorted(ids & slot.in_flight)) for slot in self._slots]
        await asyncio.gather(*(slot.engine.abort(names) for slot, names in targets if names))

    async def pause(self, owner: str = PAUSE_OPERATOR) -> None:
        await self._fan_out("pause", owner)

    async def resume(self, owner: str = PAUSE_OPERATOR) -> None:
        await self._fan_out("resume", owner)

    async def _fan_out(self, method: str, *args) -> None:
        slots = [s for s in self._slots if s.healthy and s.relaunching is None]
        results = await asyncio.gather(*(self._watched(s, getattr(s.engine, method)(*args)) for s in slots),
                                       return_exceptions=True)
        for slot, result in zip(slots, results):
            if isinstance(result, BaseException):
                if not is_retryable(result):
                    raise result
                self._mark_down(slot, result)

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Every engine serves ``version`` afterwards, or is marked down (it catches up from disk when it comes
        back, or stays out of rotation until the next update). Engines that write to one ``weights_dir`` share
        one published copy. Raises when no engine took the update."""
        tensors = list(named_tensors)
        # An engine being relaunched catches up when it is back (its probe loads the newest version).
        slots = [slot for slot in self._slots if slot.relaunching is None]
        if self.weight_transport is not None:
            await self.weight_transport.update([slot.engine for slot in slots],
                                               list(bucketize(tensors, self.bucket_bytes)), version)
            self._version = version if self._version is None else max(self._version, version)
            return
        by_dir: dict[str, list[_Slot]] = {}
        direct: list[_Slot] = []
        for slot in self._slots:  # relaunching ones too: they load the version from disk when they are back
            directory = getattr(slot.engine, "weights_dir", None)
            if directory is not None and hasattr(slot.engine, "publish_weights"):
                by_dir.setdefault(str(directory), []).append(slot)
            else:
                direct.append(slot)
        for sharing in by_dir.values():
            await sharing[0].engine.publish_weights(tensors, version)  # type: ignore[attr-defined]

        async def load(slot: _Slot) -> None:
            if slot in direct:
                await slot.engine.update_weights(iter(tensors), version)
            else:
                await slot.engine.load_weights(version)  # type: ignore[attr-defined]

        # Watched like a generation: a stopped engine would otherwise hold the update for the whole weights timeout.
        results = await asyncio.gather(*(self._watched(slot, load(slot)) for slot in slots), return_exceptions=True)
        failures = []
        for slot, result in zip(slots, results):
            if isinstance(result, BaseException):
                if not is_retryable(result):
                    raise result
                self._mark_down(slot, result)
                failures.append(f"{slot.name}: {result}")
        # From now on engines behind this version get no work until they load it (on their next health probe).
        self._version = version if self._version is None else max(self._version, version)
        # An engine that was being relaunched when the update began loads the published version when it is back:
        # while one is still relaunching, or came back during the update, the version is not lost.
        catching_up = [slot for slot in self._slots if slot not in slots and slot not in direct
                       and (slot.relaunching is not None or slot.healthy)]
        if slots and len(failures) == len(slots) and not self._relaunching() and not catching_up:
            raise NoEngineAvailableError(f"weight version {version} reached no engine: " + "; ".join(failures))

    async def health(self) -> dict[str, Any]:
        """Probe every engine; raises when none can serve."""
        await asyncio.gather(*(self._probe(slot) for slot in self._slots))
        engines = self.stats()
        if not self._routable():
            raise NoEngineAvailableError("no engine can serve requests: " + "; ".join(
                f"{e['engine']}: {e['last_error'] or ('draining' if e['draining'] else 'behind the weights')}"
                for e in engines))
        return {"status": "ok", "weight_version": self.weight_version, "engines": engines}

    @property
    def weight_version(self) -> int:
        """The oldest version among the engines requests are routed to (all engines when none is)."""
        slots = [s for s in self._slots if s.healthy and not s.draining] or self._slots
        return min((s.engine.weight_version for s in slots), default=0)

    async def aclose(self) -> None:
        for slot in self._slots:
            self._cancel_relaunch(slot)
            close = getattr(slot.engine, "aclose", None)
            if close is not None:
                await close()
