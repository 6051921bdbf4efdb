"""`TransferQueueDataPlane`: the data plane on the PyPI ``TransferQueue`` package (Ray actors + ZMQ).

Writer and reader may live in different processes of one Ray cluster: each creates its own
`TransferQueueDataPlane` attached to the same TransferQueue controller. The controller must have
been started with `WholeGroupSampler` and ``polling_mode`` (as `start_local_transfer_queue` does):
the reader polls for complete groups instead of blocking inside the controller (a blocking
``get_meta`` sleeps 5 s per retry and then raises; environment-notes §3 pitfall 3).

The end of a step is a marker row carrying the number of groups written, so a reader in another
process knows when the partition is drained. The accounting of an object covers what that object
wrote and read; a reader in another process learns the produced count from the marker.

Every call is bounded by the liveness of TransferQueue's actors. A put or get talks to a storage unit over ZMQ,
and a dead or stopped unit never answers: TransferQueue itself waits 200 s per attempt, three attempts, and a
reader polling an empty partition waits for ``--data-wait-timeout``. So while a call runs, and between polls,
`TransferQueueLiveness` asks Ray every `LIVENESS_INTERVAL_S` whether the controller and the storage units answer;
a dead one ends the call at once with `DataPlaneError` naming it, one silent for `UNANSWERED_LIMIT_S` likewise.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import torch

from relax.data.sample import Sample, SampleStatus
from relax.data_plane.base import TRAIN_TASK, DataPlane, Group, partition_id
from relax.data_plane.staleness import StalenessGate, oldest_weight_version
from relax.data_plane.tq_codec import (
    COLUMNS,
    decode_field,
    decode_rows,
    encode_fields,
    encode_rows,
    record_to_sample,
)
from relax.utils.errors import RunFault
from relax.utils.local_ray import set_local_ray_environment, start_local_ray

END_MARKER = "end_of_step"
# A column only the end marker's row has: a reader that needs stage fields (which the marker never gets) polls it.
END_COLUMN = "end_of_step_written_groups"
CONTROLLER_NAME, CONTROLLER_NAMESPACE = "TransferQueueController", "transfer_queue"
LIVENESS_INTERVAL_S = 2.0
UNANSWERED_LIMIT_S = 30.0
PING_TIMEOUT_S = 5.0
from relax.data_plane.rows import RowHandle


class DataPlaneError(RunFault):
    """TransferQueue cannot serve: one of its actors died or stopped answering (the message names it)."""


class TransferQueueLiveness:
    """Whether TransferQueue's controller and storage-unit actors answer Ray, from any process of the job."""

    def __init__(self, handles: dict[str, Any]) -> None:
        self.handles = handles  # `transfer_queue_actors`
        self._answered = dict.fromkeys(self.handles, time.monotonic())
        self._checked = 0.0

    async def failure(self, force: bool = False) -> str | None:
        """Why TransferQueue cannot serve, or None; probes at most every `LIVENESS_INTERVAL_S` unless forced."""
        import ray

        now = time.monotonic()
        if not force and now - self._checked < LIVENESS_INTERVAL_S:
            return None
        self._checked = now
        for name, handle in self.handles.items():
            try:
                await asyncio.wait_for(handle.__ray_ready__.remote(), PING_TIMEOUT_S)
                self._answered[name] = time.monotonic()
            except TimeoutError:
                silent = time.monotonic() - self._answered[name]
                if silent > UNANSWERED_LIMIT_S:
                    return f"{name} has not answered for {silent:.0f} s (stopped or hung)"
            except ray.exceptions.RayActorError as err:
                return f"{name} died ({str(err).splitlines()[0]})"
        return None


def start_local_transfer_queue(num_storage_units: int = 1, num_cpus: int = 4) -> None:
    """Start a local Ray bound to 127.0.0.1 (no dashboard) and a TransferQueue controller + storage units.

    The controller and each storage unit reserve one logical CPU, so Ray gets ``num_cpus`` logical
    CPUs regardless of the cores (a 2-CPU node would hang ``tq.init``: pitfall 1).
    """
    if num_cpus < num_storage_units + 1:
        raise ValueError(f"num_cpus={num_cpus} cannot hold a controller and {num_storage_units} storage units")
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    from relax.data_plane.tq_sampler import WholeGroupSampler

    set_local_ray_environment()
    if not ray.is_initialized():
        start_local_ray(num_cpus)
    conf = OmegaConf.create(
        {"controller": {"sampler": WholeGroupSampler(), "polling_mode": True},
         "backend": {"storage_backend": "SimpleStorage",
                     "SimpleStorage": {"num_data_storage_units": num_storage_units}}},
        flags={"allow_objects": True},
    )
    tq.init(conf)


def stop_local_transfer_queue() -> None:
    """Tear down TransferQueue and the local Ray started by `start_local_transfer_queue`."""
    import ray
    import transfer_queue as tq

    tq.close()
    ray.shutdown()


def attach_transfer_queue_client() -> Any:
    """A client of the running TransferQueue, after checking it was started the way this plane needs.

    ``tq.init()`` with no controller running would start one with the default sequential
    sampler, which splits groups; refuse that instead.
    """
    import ray
    import transfer_queue as tq

    from relax.data_plane.tq_sampler import WholeGroupSampler

    try:
        controller = ray.get_actor("TransferQueueController", namespace="transfer_queue")
    except ValueError:
        raise RuntimeError("no TransferQueue controller is running; call start_local_transfer_queue() "
                           "(or start one with WholeGroupSampler and polling_mode) first") from None
    conf = ray.get(controller.get_config.remote())
    if not (isinstance(conf.controller.sampler, WholeGroupSampler) and conf.controller.polling_mode):
        raise RuntimeError("the running TransferQueue controller was not started with WholeGroupSampler "
                           "and polling_mode=True; see start_local_transfer_queue()")
    tq.init()  # attaches this process's client to the running controller
    return tq.get_client()


def transfer_queue_actors() -> dict[str, Any]:
    """The running TransferQueue's controller and storage-unit actors, by the names errors and `relax health`
    give them ("TransferQueue controller", "TransferQueue storage unit <actor name>")."""
    import ray

    controller = ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    conf = ray.get(controller.get_config.remote())
    backend = conf.backend[conf.backend.storage_backend]
    actors = {"TransferQueue controller": controller}
    for name in (backend.get("zmq_info") or {}):
        try:
            actors[f"TransferQueue storage unit {name}"] = ray.get_actor(name)
        except ValueError:  # named in another job's namespace: not reachable from here, not watched
            continue
    return actors


class TransferQueueDataPlane(DataPlane):
    """Partitions ``train_{step}`` in TransferQueue; one row per sample, columns from `tq_codec`.

    ``task_name`` is the consumer task whose consumption TransferQueue tracks (upstream:
    ``actor_train``); ``poll_interval_s`` is how long the reader sleeps when nothing new is ready.
    With ``trainer_reads_rows`` the trainer's stream yields `RowHandle`s instead of samples (no payload is read
    here; groups carried past their partition's clear are read whole first, as the rows go with the partition).
    """

    passes_rows = True

    def __init__(self, gate: StalenessGate | None = None, *, task_name: str = "actor_train",
                 poll_interval_s: float = 0.05, client: Any = None):
        super().__init__(gate)
        self._client = client if client is not None else attach_transfer_queue_client()
        self._liveness = TransferQueueLiveness(transfer_queue_actors()) if client is None else None
        self.task_name = task_name
        self.poll_interval_s = poll_interval_s
        self._read_so_far: dict[int, dict[str, int]] = {}  # groups read per step, per reader task
        self._rows_of: dict[int, Any] = {}  # id(group) -> its rows (BatchMeta), for a streaming role's write-back
        self._expected: dict[int, int] = {}  # groups written per step, known from the end marker

    async def _bounded(self, call, what: str, step: int | None = None):
        """Await TransferQueue ``call``, ended early with `DataPlaneError` when TransferQueue cannot answer."""
        task = asyncio.ensure_future(call)
        if self._liveness is None:
            return await task
        while True:
            done, _ = await asyncio.wait({task}, timeout=LIVENESS_INTERVAL_S)
            if done:
                return task.result()
            reason = await self._liveness.failure(force=True)
            if reason is not None:
                task.cancel()
                of_step = f" of step {step + 1}" if step is not None else ""
                raise DataPlaneError(f"{reason}: the data plane's {what}{of_step} cannot complete")

    async def _check_alive(self, step: int) -> None:
        """Between polls: a reader waiting on an empty partition learns of a dead TransferQueue too."""
        if self._liveness is not None:
            reason = await self._liveness.failure()
            if reason is not None:
                raise DataPlaneError(f"{reason}: the data plane cannot deliver step {step + 1}")

    # ---- writer side -------------------------------------------------------------------
    async def _insert_rows(self, step: int, samples: list[Sample], custom_meta: list[dict],
                           extra_records: list[dict] | None = None) -> Any:
        """Allocate rows in ``train_{step}``, tag them with ``custom_meta`` and write them; returns their rows."""
        meta = await self._bounded(self._client.async_get_meta(data_fields=COLUMNS, batch_size=len(samples),
                                                               partition_id=partition_id(step), mode="insert"),
                                   "row allocation", step)
        meta.update_custom_meta(custom_meta)
        await self._bounded(self._client.async_put(encode_rows(samples, extra_records), metadata=meta), "write", step)
        return meta

    async def _write_groups(self, step: int, groups: list[Group]) -> None:
        samples, custom_meta = [], []
        for group in groups:
            key = uuid.uuid4().hex
            samples.extend(group)
            # what a reader of rows (`RowHandle`) decides on without reading the payload
            custom_meta.extend({"group_key": key, "group_size": len(group), "index": sample.index,
                                "group_index": sample.group_index, "status": sample.status.value,
                                "oldest_version": oldest_weight_version(sample)} for sample in group)
        await self._insert_rows(step, samples, custom_meta)

    async def _write_end(self, step: int, written_groups: int) -> None:
        row = await self._insert_rows(step, [Sample()], [{"group_key": f"end:{uuid.uuid4().hex}", "group_size": 1}],
                                      [{END_MARKER: True, "written_groups": written_groups}])
        await self._put_fields(row, {END_COLUMN: [torch.tensor([float(written_groups)])]}, step)

    # ---- reader side -------------------------------------------------------------------
    def _task(self, task: str) -> str:
        """TransferQueue's consumer task of reader ``task``: the trainer's is ``task_name``, a streaming role's is
        named under it (the same in every process of a run)."""
        return self.task_name if task == TRAIN_TASK else f"{self.task_name}/{task}"

    def _decoded(self, step: int, data: Any, needs: tuple[str, ...]) -> list[Sample | None]:
        """The samples of rows ``data`` with the stage fields ``needs`` (None for an end marker, whose count of
        written groups is noted)."""
        stage_columns = {name: decode_field(data[name]) for name in needs}
        samples: list[Sample | None] = []
        for row, record in enumerate(decode_rows(data)):
            if record.get(END_MARKER):
                self._expected[step] = record["written_groups"]
                self._ledger.produced_at_least(step, record["written_groups"])
                samples.append(None)
                continue
            sample = record_to_sample(record)
            sample.stage_fields = {name: values[row] for name, values in stage_columns.items()}
            samples.append(sample)
        return samples

    async def _row_groups(self, step: int, meta: Any) -> dict[str, list[RowHandle]]:
        """The groups of ``meta``'s rows as `RowHandle`s, from the rows' metadata; only an end marker's row is read."""
        groups: dict[str, list[RowHandle]] = {}
        for row, custom in enumerate(meta.get_all_custom_meta()):
            if custom["group_key"].startswith("end:"):
                marker = meta.select_samples([row]).select_fields(COLUMNS)
                self._decoded(step, await self._bounded(self._client.async_get_data(marker), "read", step), ())
                continue
            groups.setdefault(custom["group_key"], []).append(RowHandle(
                custom["index"], custom["group_index"], SampleStatus(custom["status"]), custom["oldest_version"],
                meta, row))
        return groups

    async def samples_of(self, handles: list[RowHandle], needs: tuple[str, ...] = ()) -> list[Sample]:
        """The samples behind ``handles``, with the stage fields ``needs``, in order (read by the process that
        trains on them, any process of the run)."""
        from transfer_queue.metadata import BatchMeta

        if not handles:
            return []
        # one selection per poll the handles came from (a selection copies its poll's metadata: not one per row)
        by_poll: dict[int, tuple[Any, list[int]]] = {}
        for handle in handles:
            by_poll.setdefault(id(handle.fetched), (handle.fetched, []))[1].append(handle.row)
        rows = BatchMeta.concat([meta.select_samples(positions) for meta, positions in by_poll.values()])
        data = await self._bounded(self._client.async_get_data(rows.select_fields([*COLUMNS, *needs])), "read")
        read = self._decoded(-1, data, needs)
        position = {(poll, row): i for i, (poll, row) in enumerate(
            (poll, row) for poll, (_, positions) in by_poll.items() for row in positions)}
        return [read[position[(id(handle.fetched), handle.row)]] for handle in handles]

    async def _fetch_ready_groups(self, step: int, task: str = TRAIN_TASK, needs: tuple[str, ...] = (),
                                  gives: tuple[str, ...] = (), whole: bool = False) -> list[Group]:
        """Every complete group of ``step`` ready now for ``task`` (with the fields ``needs``), marked consumed for
        it; never waits. ``gives``: remember the groups' rows for the role's `write_fields`. The trainer's groups
        are `RowHandle`s with ``trainer_reads_rows`` unless ``whole``."""
        meta = await self._bounded(self._client.async_get_meta(data_fields=[*COLUMNS, *needs], batch_size=1,
                                                               partition_id=partition_id(step), mode="fetch",
                                                               task_name=self._task(task)), "poll", step)
        if meta.size == 0:
            return []
        rows: dict[str, list[int]] = {}
        if task == TRAIN_TASK and self.trainer_reads_rows and not whole:
            groups = await self._row_groups(step, meta)
        else:
            data = await self._bounded(self._client.async_get_data(meta), "read", step)
            groups = {}
            for row, (sample, custom) in enumerate(zip(self._decoded(step, data, needs), meta.get_all_custom_meta(),
                                                       strict=True)):
                if sample is not None:
                    groups.setdefault(custom["group_key"], []).append(sample)
                    rows.setdefault(custom["group_key"], []).append(row)
        if gives:  # the rows a role will write its fields back to
            for key, group in groups.items():
                self._rows_of[id(group)] = meta.select_samples(rows[key])
        read = self._read_so_far.setdefault(step, {})
        read[task] = read.get(task, 0) + len(groups)
        return list(groups.values())

    async def _poll_end(self, step: int, task: str) -> None:
        """Learn how many groups ``step`` has from its end marker's own column (a reader whose ``needs`` the
        marker's row never carries does not see the marker in its polls)."""
        meta = await self._bounded(self._client.async_get_meta(data_fields=[END_COLUMN], batch_size=1,
                                                               partition_id=partition_id(step), mode="fetch",
                                                               task_name=f"{self._task(task)}/end"), "poll", step)
        if meta.size:
            data = await self._bounded(self._client.async_get_data(meta), "read", step)
            written = int(decode_field(data[END_COLUMN])[0][0])
            self._expected[step] = written
            self._ledger.produced_at_least(step, written)

    async def _write_fields(self, step: int, groups: list[Group], fields: dict[str, list[torch.Tensor]]) -> None:
        from transfer_queue.metadata import BatchMeta

        try:
            metas = [self._rows_of.pop(id(group)) for group in groups]
        except KeyError:
            raise KeyError(f"step {step}: a group written back was not read by a streaming role of this "
                           "plane") from None
        await self._put_fields(BatchMeta.concat(metas), fields, step)

    async def _put_fields(self, rows: Any, fields: dict[str, list[torch.Tensor]], step: int) -> None:
        await self._bounded(self._client.async_put(encode_fields(fields), metadata=rows), "field write", step)

    def _drained(self, step: int, task: str) -> bool:
        expected = self._expected.get(step)
        return expected is not None and self._read_so_far.get(step, {}).get(task, 0) >= expected

    async def _read_groups(self, step: int, task: str, needs: tuple[str, ...],
                           gives: tuple[str, ...]) -> list[Group] | None:
        while True:
            groups = await self._fetch_ready_groups(step, task, needs, gives)
            if groups:
                return groups
            if task != TRAIN_TASK and step in self._cleared_steps:
                return None
            if step not in self._expected and needs:
                await self._poll_end(step, task)
            if self._drained(step, task):
                return None
            await self._check_alive(step)
            await asyncio.sleep(self.poll_interval_s)

    async def _take_unread(self, step: int) -> list[Group]:
        # without ``needs``: also groups a role has not reached; whole: they outlive the partition in the carry buffer
        return await self._fetch_ready_groups(step, whole=True)

    async def _drop_partition(self, step: int) -> None:
        await self._read_carried_rows(step)
        await self._bounded(self._client.async_clear_partition(partition_id(step)), "partition clear", step)
        self._read_so_far.pop(step, None)
        self._expected.pop(step, None)

    async def _read_carried_rows(self, step: int) -> None:
        """Carried groups of ``step`` still held as rows are read whole before the partition (their rows) goes."""
        for position, (origin, group) in enumerate(self._carry):
            if origin == step and any(isinstance(item, RowHandle) for item in group):
                # without stage fields, as any group taken unread: the step that trains it computes them
                self._carry[position] = (origin, await self.samples_of(group))

    async def partition_ids(self) -> list[str]:
        """The partitions TransferQueue holds now (for checks and tests)."""
        return list(await self._bounded(self._client.async_get_partition_list(), "partition list"))
