"""The staleness gate: how far rollout may run ahead of training, and which samples are too old.

Versions count optimizer updates: the engine starts at version 0 and training step ``s`` publishes
version ``s + 1`` (as the sync controller does). Rollout of step ``s`` may start only while
``s - trained_version <= max_staleness`` (upstream ``--max-staleness``; 0 means rollout of step ``s``
waits for the weights of step ``s - 1``, i.e. synchronous). On read, a sample is stale when the
oldest weight version that produced any of its tokens is below ``current_version - max_staleness``.
"""

from __future__ import annotations

import asyncio

from relax.data.sample import Sample


def oldest_weight_version(sample: Sample) -> int | None:
    """The oldest version that produced ``sample`` (per-token lists: the minimum); None if unknown."""
    version = sample.weight_version
    if isinstance(version, list):
        return min(version) if version else None
    return version


class StalenessGate:
    """Bounds the distance between the step being generated and the weights being trained."""

    def __init__(self, max_staleness: int = 0, trained_version: int = 0):
        if max_staleness < 0:
            raise ValueError(f"--max-staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness
        self._trained_version = trained_version
        self._changed: asyncio.Condition | None = None  # created on first use, inside the running loop

    @property
    def trained_version(self) -> int:
        return self._trained_version

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def may_start(self, step: int) -> bool:
        """Whether rollout of ``step`` is within ``max_staleness`` of the trained weights."""
        return step - self._trained_version <= self.max_staleness

    async def publish(self, version: int) -> None:
        """Record that the trainer finished ``version``; wakes rollout steps that were waiting for it."""
        if version <= self._trained_version:
            return
        condition = self._condition()
        async with condition:
            self._trained_version = version
            condition.notify_all()

    async def wait_for_slot(self, step: int, trained_version: int | None = None) -> None:
        """Block until rollout of ``step`` may start.

        ``trained_version``, when given, is the newest version the caller has seen (it only ever
        moves the gate forward). Callers bound the wait with ``asyncio.wait_for``.
        """
        if trained_version is not None:
            await self.publish(trained_version)
        condition = self._condition()
        async with condition:
            await condition.wait_for(lambda: self.may_start(step))

    def is_stale(self, sample: Sample, current_version: int | None = None) -> bool:
        """Whether ``sample`` is older than ``current_version - max_staleness`` (default: the trained version).

        Samples with no recorded version are never stale: nothing says how old they are.
        """
        current = self._trained_version if current_version is None else current_version
        oldest = oldest_weight_version(sample)
        return oldest is not None and oldest < current - self.max_staleness
