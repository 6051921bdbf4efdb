"""The training loops under Ray placement: the same controllers, with the weight push going over
the configured transport between processes and, in the async modes, TransferQueue as the data
plane (the rollout process writes each step's groups; the controller streams them). In the async modes over
disk the weights are a versioned service: the actor publishes, the rollout's engines follow (no push, no wait)."""

from __future__ import annotations

import asyncio
import time

from relax.core.async_controller import AsyncController
from relax.core.controller import SyncController
from relax.core.streamed_training import ChunkReport, chunk_fields
from relax.core.streaming_roles import REF_LOG_PROBS
from relax.data_plane import StalenessGate
from relax.data_plane.tq_plane import RowHandle

PRODUCER_ERROR_GRACE_S = 5.0


class RaySyncController(SyncController):
    """Colocated sync mode with roles in Ray processes: the controller hands batches between roles
    directly (no data plane); weights go actor -> rollout over broadcast or disk."""

    async def sync_weights(self, version: int) -> dict[str, float]:
        return await self.roles.service.sync_weights(version)


class RayAsyncController(AsyncController, RaySyncController):
    """``--fully-async`` / ``--hybrid`` with roles in Ray processes over `TransferQueueDataPlane`."""

    def __init__(self, cfg, roles, tracker, plane=None):
        if plane is None:
            from relax.data_plane.tq_plane import TransferQueueDataPlane

            plane = TransferQueueDataPlane(StalenessGate(cfg.max_staleness))
        super().__init__(cfg, roles, tracker, plane)
        # Over disk, weights are a versioned service: the actor publishes each version and the step goes on; the
        # rollout's engines load the newest between generations (with --partial-rollout a push must land inside
        # the generation in flight, so it stays a push).
        self.pull_weights = cfg.resolved_weight_sync_transport == "disk" and not cfg.partial_rollout
        self._following = False

    async def sync_weights(self, version: int) -> dict[str, float]:
        if not self.pull_weights:
            return await super().sync_weights(version)
        service = self.roles.service
        metrics = await service.publish_weights(version)
        if not self._following:  # after the first publish: a resumed run's engines start on the version it resumed
            await self.roles.rollout.follow_published_weights(str(service.weight_root), service.weight_run)
            await self.roles.rollout.catch_up_with_published_weights()
            self._following = True
        metrics["perf/weight_push_wait_s"] = 0.0  # nothing waits for the generation in flight
        await self.gate.publish(version)
        return metrics

    async def _run(self):
        last = await super()._run()
        if self.pull_weights:  # the run ends with its engines serving its final weights
            await self.roles.rollout.catch_up_with_published_weights()
        return last

    async def _choose_reading(self) -> None:
        """Training as the data arrives, the controller reads rows' keys and the actor's processes read the samples
        from TransferQueue (the payloads never pass through here), unless the chunks need the reference computed in
        the step (a reference over several ranks does not stream)."""
        await super()._choose_reading()
        self.plane.trainer_reads_rows = self._streams_training and (
            self.roles.reference is None or REF_LOG_PROBS in self._streamed_fields)

    async def _train_chunk(self, rollout_id: int, batch: list, expected: int, last: bool) -> ChunkReport:
        if not self.plane.trainer_reads_rows:
            return await super()._train_chunk(rollout_id, batch, expected, last)
        rows = [item for item in batch if isinstance(item, RowHandle)]
        # groups carried past their partition's end were read whole: their fields are computed here
        samples = [item for item in batch if not isinstance(item, RowHandle)]
        fields = await chunk_fields(samples, self.roles.advantages, self.cfg.use_tis, self.roles.reference) \
            if samples else {}
        return await self.roles.actor.train_chunk_rows(rollout_id, rows, samples, fields, expected, last,
                                                       self._streamed_fields, self.cfg.dump_samples)

    async def _generate_into_plane(self, step: int) -> tuple[dict[str, float], dict[str, int]]:
        """The rollout process writes the groups into TransferQueue itself (samples never pass through here)."""
        return await self.roles.rollout.generate_into_plane(step)

    async def _end_failed_step(self, step: int) -> None:
        """Nothing to do: the rollout process writes the end-of-step marker also when generation fails."""

    async def _check_rollout_of(self, step: int, arrived: int) -> None:
        """As in-process; a step that arrives empty may be a failed generation whose error reaches
        this process just after the end marker: wait briefly for it, so it is raised, not skipped."""
        if not arrived:
            deadline = time.monotonic() + PRODUCER_ERROR_GRACE_S
            while self._producer_error is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        await super()._check_rollout_of(step, arrived)
