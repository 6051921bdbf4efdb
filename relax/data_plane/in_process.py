"""`InProcessDataPlane`: partitions as asyncio-guarded lists, for one process with no Ray.

Used by the embedded placement on one machine and on the GPU box (which has no Ray). Writer and
reader share the object, so the accounting sees both sides.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from relax.data_plane.base import DataPlane, Group
from relax.data_plane.staleness import StalenessGate


@dataclass
class _Partition:
    unread: list[Group] = field(default_factory=list)
    complete: bool = False
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)


class InProcessDataPlane(DataPlane):
    def __init__(self, gate: StalenessGate | None = None):
        super().__init__(gate)
        self._partitions: dict[int, _Partition] = {}

    def _partition(self, step: int) -> _Partition:
        """The partition of ``step``, created by whichever side (writer or reader) comes first."""
        if step not in self._partitions:
            self._partitions[step] = _Partition()
        return self._partitions[step]

    def has_partition(self, step: int) -> bool:
        return step in self._partitions

    async def _write_groups(self, step: int, groups: list[Group]) -> None:
        partition = self._partition(step)
        async with partition.changed:
            if partition.complete:
                raise RuntimeError(f"step {step} was marked complete; no more puts")
            partition.unread.extend(groups)
            partition.changed.notify_all()

    async def _write_end(self, step: int, written_groups: int) -> None:
        partition = self._partition(step)
        async with partition.changed:
            partition.complete = True
            partition.changed.notify_all()

    async def _read_groups(self, step: int) -> list[Group] | None:
        partition = self._partition(step)
        async with partition.changed:
            await partition.changed.wait_for(lambda: partition.unread or partition.complete)
            groups, partition.unread = partition.unread, []
        return groups or None

    async def _take_unread(self, step: int) -> list[Group]:
        partition = self._partitions.get(step)
        if partition is None:
            return []
        groups, partition.unread = partition.unread, []
        return groups

    async def _drop_partition(self, step: int) -> None:
        self._partitions.pop(step, None)
