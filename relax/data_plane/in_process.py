"""`InProcessDataPlane`: partitions as asyncio-guarded lists, for one process with no Ray.

Used by the embedded placement on one machine and on the GPU box (which has no Ray). Writer and
reader share the object, so the accounting sees both sides.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from relax.data_plane.base import TRAIN_TASK, DataPlane, Group
from relax.data_plane.staleness import StalenessGate


@dataclass
class _Entry:
    group: Group
    fields: set[str] = field(default_factory=set)  # stage fields written for it
    read_by: set[str] = field(default_factory=set)  # tasks that have taken it


@dataclass
class _Partition:
    entries: list[_Entry] = field(default_factory=list)
    complete: bool = False
    dropped: bool = False  # cleared by the trainer: a streaming role still waiting on it is done with it
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def ready_for(self, task: str, needs: tuple[str, ...]) -> list[_Entry]:
        return [e for e in self.entries if task not in e.read_by and e.fields.issuperset(needs)]

    def drained_for(self, task: str) -> bool:
        return self.dropped or (self.complete and all(task in e.read_by for e in self.entries))


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
            partition.entries.extend(_Entry(group) for group in groups)
            partition.changed.notify_all()

    async def _write_end(self, step: int, written_groups: int) -> None:
        partition = self._partition(step)
        async with partition.changed:
            partition.complete = True
            partition.changed.notify_all()

    async def _read_groups(self, step: int, task: str, needs: tuple[str, ...],
                           gives: tuple[str, ...]) -> list[Group] | None:
        if task != TRAIN_TASK and step in self._cleared_steps:
            return None
        partition = self._partition(step)
        async with partition.changed:
            await partition.changed.wait_for(lambda: partition.ready_for(task, needs) or partition.drained_for(task))
            entries = partition.ready_for(task, needs)
            for entry in entries:
                entry.read_by.add(task)
        return [entry.group for entry in entries] or None

    async def _write_fields(self, step: int, groups: list[Group], fields: dict[str, list[torch.Tensor]]) -> None:
        partition = self._partition(step)
        async with partition.changed:
            by_group = {id(entry.group): entry for entry in partition.entries}
            position = 0
            for group in groups:
                entry = by_group.get(id(group))
                if entry is None:
                    raise KeyError(f"step {step}: a group written back was not read from this partition")
                for sample in group:
                    for name, values in fields.items():
                        sample.stage_fields[name] = values[position]
                    position += 1
                entry.fields.update(fields)
            partition.changed.notify_all()

    async def _take_unread(self, step: int) -> list[Group]:
        partition = self._partitions.get(step)
        if partition is None:
            return []
        unread = [entry for entry in partition.entries if TRAIN_TASK not in entry.read_by]
        for entry in unread:
            entry.read_by.add(TRAIN_TASK)
        return [entry.group for entry in unread]

    async def _drop_partition(self, step: int) -> None:
        partition = self._partitions.pop(step, None)
        if partition is not None:
            async with partition.changed:
                partition.dropped = True
                partition.changed.notify_all()
