"""`DataPlane`: the interface between rollout (writer) and training (reader); see the package docstring."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Iterable

import torch

from relax.data.sample import Sample, SampleStatus
from relax.data_plane.ledger import GroupLedger
from relax.data_plane.staleness import StalenessGate

Group = list[Sample]
TRAIN_TASK = "train"  # the trainer's reading of a partition; a streaming role reads it under its own name


def partition_id(step: int) -> str:
    """One partition per rollout step, named as upstream names it."""
    return f"train_{step}"


def split_into_groups(samples: Iterable[Sample]) -> list[Group]:
    """Samples grouped by ``group_index``, groups in order of first appearance."""
    groups: dict[int, Group] = {}
    for sample in samples:
        groups.setdefault(sample.group_index, []).append(sample)
    return list(groups.values())


def count_samples(groups: Iterable[Group]) -> int:
    return sum(len(group) for group in groups)


class DataPlane(abc.ABC):
    """Partitions of GRPO groups, one per rollout step, written by rollout and streamed to training.

    Subclasses store and move groups (`_write_groups`, `_write_end`, `_read_groups`, `_take_unread`,
    `_drop_partition`); this class owns what must be identical in every implementation: group
    integrity, batching, the staleness check on read, the carry-over buffer and the accounting.
    """

    # Whether the trainer's stream can yield rows' keys (`relax.data_plane.rows.RowHandle`) instead of samples, for
    # trainers in other processes that read the samples themselves (`trainer_reads_rows`).
    passes_rows = False

    def __init__(self, gate: StalenessGate | None = None):
        self.gate = gate or StalenessGate(max_staleness=0)
        self.trainer_reads_rows = False
        self._ledger = GroupLedger()
        self._carry: list[tuple[int, Group]] = []  # (producing step, group), served first to the next stream
        self._open_steps: set[int] = set()
        self._written_group_indexes: dict[int, set[int]] = {}
        self._cleared_steps: set[int] = set()  # a streaming role stops reading a partition the trainer cleared

    # ---- writer side -------------------------------------------------------------------
    async def put(self, step: int, samples: list[Sample]) -> None:
        """Write whole groups into partition ``train_{step}``; a step may take several puts."""
        groups = split_into_groups(samples)
        if not groups:
            return
        indexes = self._check_groups_arrive_whole(step, groups)
        self._cleared_steps.discard(step)  # written again after a clear
        await self._write_groups(step, groups)
        self._written_group_indexes.setdefault(step, set()).update(indexes)
        self._open_steps.add(step)
        self._ledger.produced(step, len(groups))

    async def drop(self, step: int, samples: list[Sample], reason: str) -> None:
        """Record groups rollout produced for ``step`` but will not write (e.g. a dynamic filter)."""
        groups = split_into_groups(samples)
        self._ledger.produced(step, len(groups))
        self._ledger.dropped(step, reason, len(groups))

    async def mark_complete(self, step: int) -> None:
        """No more puts for ``step``: its stream ends once everything written has been read."""
        self._open_steps.add(step)
        await self._write_end(step, len(self._written_group_indexes.get(step, ())))

    def _check_groups_arrive_whole(self, step: int, groups: list[Group]) -> set[int]:
        """A group split over two puts could be read half-written; refuse it at the source."""
        indexes = {group[0].group_index for group in groups}
        repeated = self._written_group_indexes.get(step, set()) & indexes
        if repeated:
            raise ValueError(f"step {step}: groups {sorted(repeated)} were already written; "
                             "all samples of a group must arrive in one put")
        return indexes

    # ---- reader side -------------------------------------------------------------------
    async def stream(self, step: int, batch_size: int, max_groups: int | None = None,
                     needs: tuple[str, ...] = (), all_ready: bool = False) -> AsyncIterator[list[Sample]]:
        """Yield batches of whole groups of ``step`` as soon as ``batch_size`` samples are ready.

        ``needs``: stage fields (`write_fields`) a group must carry before the trainer reads it.

        A batch is the shortest run of groups holding at least ``batch_size`` samples (exactly
        ``batch_size`` when the group size divides it); with ``all_ready``, every group ready when it
        is handed over (at least ``batch_size`` samples): a reader that trains on each batch takes in
        one batch what landed while it trained, instead of several small ones. The tail is flushed when
        the partition is complete and drained. Groups carried over from earlier steps come first. With
        ``max_groups``, groups beyond that many go to the carry-over buffer for the next stream.
        Stale and failed groups are dropped and counted. Groups not yet yielded when the caller
        stops early return to the carry-over buffer, so nothing is lost.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self._open_steps.add(step)
        admitted: list[tuple[int, Group]] = []
        taken = 0

        def admit(origin: int, group: Group) -> None:
            nonlocal taken
            if self._drop_if_unusable(origin, group):
                return
            if max_groups is not None and taken >= max_groups:
                self._carry.append((origin, group))
                self._ledger.carried_over(origin)
                return
            taken += 1
            admitted.append((origin, group))
            if origin != step:
                self._ledger.served_from_carry(step)

        carried, self._carry = self._carry, []
        for origin, group in carried:
            admit(origin, group)
        try:
            while True:
                while (ready := count_samples(g for _, g in admitted)) >= batch_size:
                    yield self._hand_over(admitted, ready if all_ready else batch_size)
                new_groups = await self._read_groups(step, TRAIN_TASK, needs, ())
                if new_groups is None:
                    break
                for group in new_groups:
                    admit(step, group)
            if admitted:
                yield self._hand_over(admitted, batch_size)
        finally:
            for origin, group in admitted:  # the caller stopped early: keep what it did not get
                self._carry.append((origin, group))
                self._ledger.carried_over(origin)

    # ---- streaming roles ---------------------------------------------------------------
    async def stage_stream(self, step: int, stage: str, needs: tuple[str, ...] = (),
                           gives: tuple[str, ...] = ()) -> AsyncIterator[list[Group]]:
        """The groups of ``step`` for streaming role ``stage``, as they become ready: each group once, once it carries
        the fields in ``needs``; ends when the partition is complete and ``stage`` has seen every group. The role
        answers each yielded list with `write_fields` giving the fields in ``gives``. No accounting: a role reads
        beside the trainer, which alone consumes, drops and carries groups."""
        if not stage or stage == TRAIN_TASK:
            raise ValueError(f"a streaming role needs a name of its own, got {stage!r}")
        while step not in self._cleared_steps:
            groups = await self._read_groups(step, stage, needs, gives)
            if groups is None:
                return
            yield groups

    async def write_fields(self, step: int, groups: list[Group], fields: dict[str, list[torch.Tensor]]) -> None:
        """Attach per-sample ``fields`` (one tensor per sample of ``groups``, in order) to groups of ``step`` a
        streaming role read; they become readable for ``needs`` of later readers, and the samples' ``stage_fields``."""
        count = count_samples(groups)
        for name, values in fields.items():
            if len(values) != count:
                raise ValueError(f"field {name!r}: {len(values)} values for {count} samples")
        await self._write_fields(step, groups, fields)

    def _hand_over(self, admitted: list[tuple[int, Group]], batch_size: int) -> list[Sample]:
        """Pop the shortest prefix of groups with ``batch_size`` samples and count them consumed."""
        batch: list[Sample] = []
        while admitted and len(batch) < batch_size:
            origin, group = admitted.pop(0)
            batch.extend(group)
            self._ledger.consumed(origin)
        return batch

    def _drop_if_unusable(self, origin: int, group: Group) -> bool:
        """Drop a group that failed or holds a stale sample (GRPO needs the whole group, so all of it goes)."""
        if any(sample.status == SampleStatus.FAILED for sample in group):
            self._ledger.dropped(origin, "failed")
            return True
        if any(self.gate.is_stale(sample) for sample in group):
            self._ledger.dropped(origin, "stale")
            return True
        return False

    # ---- lifecycle and accounting ------------------------------------------------------
    async def clear(self, step: int) -> None:
        """Drop partition ``train_{step}`` after training; unread groups move to the carry-over buffer first."""
        for group in await self._take_unread(step):
            self._carry.append((step, group))
            self._ledger.carried_over(step)
        self._cleared_steps.add(step)
        await self._drop_partition(step)
        self._open_steps.discard(step)
        self._written_group_indexes.pop(step, None)

    def pending_steps(self) -> list[int]:
        """Steps written, marked complete or streamed, and not cleared yet, oldest first."""
        return sorted(self._open_steps)

    def carried_groups(self) -> int:
        """Groups waiting in the carry-over buffer for the next stream."""
        return len(self._carry)

    def accounting(self) -> dict[int, dict]:
        """Per producing step: produced / consumed / dropped-by-reason / carried / outstanding groups."""
        return self._ledger.report()

    async def close(self) -> None:
        """Release what the implementation started; the default has nothing to release."""

    # ---- implementation hooks ----------------------------------------------------------
    @abc.abstractmethod
    async def _write_groups(self, step: int, groups: list[Group]) -> None:
        """Store whole groups in partition ``step``, visible to the reader group by group."""

    @abc.abstractmethod
    async def _write_end(self, step: int, written_groups: int) -> None:
        """Mark partition ``step`` complete after ``written_groups`` groups were written."""

    @abc.abstractmethod
    async def _read_groups(self, step: int, task: str, needs: tuple[str, ...],
                           gives: tuple[str, ...]) -> list[Group] | None:
        """Wait for at least one group of ``step`` not read by ``task`` yet that carries the fields ``needs``, and
        take all such ones; None once complete and every group was read by ``task``. ``gives``: the fields
        ``task`` will write for what it reads (an implementation may pass its end-of-step marker on with them)."""

    @abc.abstractmethod
    async def _write_fields(self, step: int, groups: list[Group], fields: dict[str, list[torch.Tensor]]) -> None:
        """Store ``fields`` for the samples of ``groups`` (checked: one value per sample)."""

    @abc.abstractmethod
    async def _take_unread(self, step: int) -> list[Group]:
        """Take (without waiting) every group of ``step`` the trainer has not read, whatever fields it carries."""

    @abc.abstractmethod
    async def _drop_partition(self, step: int) -> None:
        """Free partition ``step``."""
