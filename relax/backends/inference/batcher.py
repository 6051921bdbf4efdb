"""Merge the generation requests of concurrent callers into few `InferenceEngine.generate` calls.

Callers are the HTTP handlers of `relax serve` and the per-sample generate functions of a rollout
(multi-turn episodes, agents). Each caller submits a *job* (its requests) and awaits its outputs.
A dispatcher task takes the first waiting job, keeps collecting jobs for ``window_s`` seconds,
then starts ``engine.generate`` calls for everything collected (each as its own task, so the next
window opens at once; the embedded engine interleaves the steps of concurrent calls on the same
loop; on the embedded engine's core they join one running batch). A job is answered as soon as its
own requests finish (the engine's `generate_streaming`), not when the whole call ends: `relax serve`
returns a short response, or a GRPO group, while the call's longer ones still decode. The embedded engine's Hugging Face
path gives the requests that share a sampling ``seed`` one generator seeded with it, so a job is
merged only with jobs whose seeds differ from its own: its samples then do not depend on its
neighbours (for a job of several requests, as long as the engine's ``max_batch_size`` does not split
the merged call). Jobs that share a seed go to separate engine calls; unseeded requests merge
freely. (The core keys each request's noise by its own seed and position, so merging never matters
there.)

Aborts reach a request wherever it is: queued requests finish at once with ``"abort"`` and no
tokens; requests inside the engine are aborted there. A caller that is cancelled while it waits (its HTTP client
went away) has its requests aborted: nobody waits for their tokens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from relax.backends.inference.base import GenerationOutput, GenerationRequest, InferenceEngine
from relax.utils.aio import cancel_and_wait

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    requests: list[GenerationRequest]
    future: asyncio.Future
    seeds: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.seeds = frozenset(r.sampling_params.seed for r in self.requests if r.sampling_params.seed is not None)


class RequestBatcher:
    """Batches jobs for ``engine``; must be started (`start`) on the loop that serves the requests."""

    def __init__(self, engine: InferenceEngine, window_s: float = 0.005) -> None:
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        self.engine = engine
        self.window_s = window_s
        self.engine_calls = 0  # engine.generate calls made
        self.batched_requests = 0  # requests passed to those calls
        self._queue: asyncio.Queue[_Job] | None = None
        self._dispatcher: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        self._pending_ids: set[str] = set()  # queued, not yet inside the engine
        self._engine_ids: set[str] = set()  # inside the engine
        self._aborted_pending: set[str] = set()
        self._aborts: set[asyncio.Task] = set()  # aborts of cancelled callers' requests, until they end

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._dispatcher = asyncio.create_task(self._dispatch_forever())

    async def stop(self) -> None:
        for task in [task for task in (self._dispatcher, *self._running) if task is not None]:
            await cancel_and_wait(task)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def stats(self) -> dict[str, int]:
        return {"engine_calls": self.engine_calls, "batched_requests": self.batched_requests,
                "queued_requests": len(self._pending_ids)}

    async def close_session(self, session_id: str) -> None:
        """The engine's `close_session`, where it has one (in-process engines keep a session's K/V)."""
        close = getattr(self.engine, "close_session", None)
        if close is not None:
            await close(session_id)

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        """Outputs of ``requests`` in order, generated together with other concurrent jobs."""
        if self._queue is None:
            raise RuntimeError("RequestBatcher.start() was not called")
        check = getattr(self.engine, "check_requests", None)  # any engine-like object may be batched
        if check is not None:
            check(requests)  # a bad request fails its caller only, not the batch it would join
        job = _Job(list(requests), asyncio.get_running_loop().create_future())
        self._pending_ids.update(request.request_id for request in job.requests)
        self._queue.put_nowait(job)
        try:
            return await job.future
        except asyncio.CancelledError:
            # Nobody waits for these outputs any more (a client went away, a handler was cancelled by a graceful
            # stop): the requests are aborted wherever they are, not decoded to their end. A task of its own: an
            # await here would be cancelled too.
            task = asyncio.get_running_loop().create_task(self.abort([r.request_id for r in job.requests]))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
            raise

    async def abort(self, request_ids: Sequence[str] | None) -> None:
        """Abort the named requests (None: every queued and running request)."""
        if request_ids is None:
            request_ids = [*self._pending_ids, *self._engine_ids]
        self._aborted_pending.update(rid for rid in request_ids if rid in self._pending_ids)
        await self.engine.abort(list(request_ids))

    async def _dispatch_forever(self) -> None:
        assert self._queue is not None
        while True:
            jobs = [await self._queue.get()]
            if self.window_s > 0:
                await asyncio.sleep(self.window_s)
            while not self._queue.empty():
                jobs.append(self._queue.get_nowait())
            for group in _calls_without_shared_seeds(jobs):
                task = asyncio.create_task(self._run(group))
                self._running.add(task)
                task.add_done_callback(self._running.discard)

    async def _run(self, jobs: list[_Job]) -> None:
        # No await between the abort check and engine.generate registering the ids as in flight,
        # so an abort lands either here or in the engine.
        requests, outputs_by_position = [], {}
        for job in jobs:
            for request in job.requests:
                self._pending_ids.discard(request.request_id)
                if request.request_id in self._aborted_pending:
                    self._aborted_pending.discard(request.request_id)
                    outputs_by_position[id(request)] = GenerationOutput(
                        request.request_id, [], [], "abort", self.engine.weight_version)
                else:
                    requests.append(request)
        ids = [request.request_id for request in requests]
        self._engine_ids.update(ids)
        job_of = {id(request): job for job in jobs for request in job.requests}
        missing = {id(job): sum(id(r) not in outputs_by_position for r in job.requests) for job in jobs}

        def reported(position: int, output: GenerationOutput) -> None:
            """A job's caller gets its outputs as soon as its last request finishes, not at the end of the call."""
            request = requests[position]
            if id(request) in outputs_by_position:  # reported already: the first report stands
                return
            outputs_by_position[id(request)] = output
            job = job_of[id(request)]
            missing[id(job)] -= 1
            if not missing[id(job)] and not job.future.done():
                job.future.set_result([outputs_by_position[id(r)] for r in job.requests])

        try:
            if requests:
                self.engine_calls += 1
                self.batched_requests += len(requests)
                streaming = getattr(self.engine, "generate_streaming", None)  # any engine-like object may be batched
                if streaming is not None:
                    await streaming(requests, reported)
                else:
                    for position, output in enumerate(await self.engine.generate(requests)):
                        reported(position, output)
        except Exception as error:
            logger.exception("engine.generate failed for a batch of %d requests", len(requests))
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(error)
            return
        finally:
            self._engine_ids.difference_update(ids)
        for job in jobs:
            if not job.future.done():
                job.future.set_result([outputs_by_position[id(request)] for request in job.requests])


def _calls_without_shared_seeds(jobs: list[_Job]) -> list[list[_Job]]:
    """Split ``jobs`` (in order) into as few engine calls as possible such that no seed is used by
    two jobs of one call."""
    calls: list[tuple[list[_Job], set[int]]] = []
    for job in jobs:
        call = next((c for c in calls if not job.seeds & c[1]), None)
        if call is None:
            call = ([], set())
            calls.append(call)
        call[0].append(job)
        call[1].update(job.seeds)
    return [call_jobs for call_jobs, _ in calls]
