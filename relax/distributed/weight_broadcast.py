"""Weight sync transport 2: torch.distributed broadcast over a dedicated group (see `weight_sync`).

The group holds the trainer (rank 0, the broadcast source) and N engine processes (ranks 1..N). It
is its own process group built on its own TCP store, not a subgroup of the training world: the
trainer may already be in an FSDP world that the engines are no part of, and ``dist.new_group``
would need every rank of that world. gloo on CPU, NCCL on GPU.

Wire protocol for one version (every message a broadcast from rank 0):

1. an int64 tensor ``[n]``: the length of the manifest JSON;
2. a uint8 tensor of ``n`` bytes: the `Manifest` (version, meta, per bucket the names, shapes
   and dtypes in order);
3. per bucket, per dtype in order of first appearance in the bucket: one flat contiguous buffer
   holding that bucket's tensors of that dtype back to back. Receivers allocate it from the
   manifest and hand out views of it, so a bucket costs one collective per dtype (usually one).

Sending the manifest first means the trainer materialises the buckets before sending: they are
casts or gathers of the parameters that the sync needs anyway, but all of them are alive at once.
Every collective has the group's timeout, so a lost peer raises instead of hanging.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from relax.distributed.process_group import tcp_store
from relax.distributed.weight_sync import (
    Manifest,
    NamedTensors,
    SyncMetrics,
    TensorSpec,
    WeightSyncError,
    WeightTarget,
    apply_to_engine,
    check_manifest,
    engine_weight_specs,
)

TRAINER_RANK = 0
STORE_PREFIX = "relax_weight_sync"


class WeightSyncGroup:
    """A process group of 1 trainer + N engines used only for weight sync.

    Every process calls `init` with the same ``host:port`` (the TCP store the trainer hosts) and
    ``world_size``; the trainer is rank 0. ``timeout_s`` bounds the rendezvous and every collective.
    """

    def __init__(self, group: Any, store: dist.Store, rank: int, world_size: int, device: torch.device,
                 timeout: timedelta) -> None:
        self.group = group
        self.store = store  # kept alive: the group talks through it during setup
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout = timeout

    @classmethod
    def init(cls, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
             timeout_s: float = 120.0, device: torch.device | None = None) -> WeightSyncGroup:
        if world_size < 2:
            raise ValueError(f"a weight-sync group needs the trainer and at least one engine, got world_size {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"weight-sync rank {rank} is outside world_size {world_size}")
        timeout = timedelta(seconds=timeout_s)
        store = tcp_store(host, port, world_size, is_master=rank == TRAINER_RANK, timeout=timeout)
        prefixed = dist.PrefixStore(STORE_PREFIX, store)
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            # Bind the interface of `host` (127.0.0.1 in tests), not whatever the hostname resolves to.
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            group = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
            device = torch.device("cpu")
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            device = device or torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(f"weight-sync backend must be 'gloo' or 'nccl', got {backend!r}")
        return cls(group, store, rank, world_size, device, timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """In-place broadcast from the trainer; blocks until done or the group's timeout."""
        self.group.broadcast(tensor, TRAINER_RANK, self.timeout).wait()

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError:  # already torn down by a failed peer
                pass


def dtype_groups(specs: Iterable[TensorSpec]) -> list[tuple[str, list[TensorSpec]]]:
    """Specs grouped by dtype, groups in order of first appearance, tensors in bucket order: the
    layout both sides derive from the manifest."""
    groups: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        groups.setdefault(spec.dtype, []).append(spec)
    return list(groups.items())


# ----------------------------------------------------------------------------- trainer


class BroadcastPublisher:
    """The trainer's end: rank 0 of a `WeightSyncGroup`."""

    transport = "broadcast"

    def __init__(self, group: WeightSyncGroup) -> None:
        if group.rank != TRAINER_RANK:
            raise ValueError(f"the publisher must be rank {TRAINER_RANK} of the weight-sync group, got {group.rank}")
        self.group = group

    async def publish(
        self, buckets: Iterable[NamedTensors], version: int, meta: dict[str, Any] | None = None
    ) -> SyncMetrics:
        """Send the manifest, then every bucket; returns once every receiver has every byte
        (blocking this thread meanwhile: the trainer has nothing else to do during a sync)."""
        started = time.perf_counter()
        buckets = [list(bucket) for bucket in buckets]
        manifest = Manifest.from_buckets(version, buckets, meta)
        self._send_manifest(manifest)
        for bucket in buckets:
            self._send_bucket(bucket)
        return SyncMetrics(self.transport, version, time.perf_counter() - started, manifest.nbytes, len(buckets))

    def _send_manifest(self, manifest: Manifest) -> None:
        payload = torch.frombuffer(bytearray(manifest.to_json().encode()), dtype=torch.uint8)
        self.group.broadcast(torch.tensor([payload.numel()], dtype=torch.int64, device=self.group.device))
        self.group.broadcast(payload.to(self.group.device))

    def _send_bucket(self, bucket: NamedTensors) -> None:
        tensors = dict(bucket)
        for _, specs in dtype_groups(TensorSpec.of(name, tensor) for name, tensor in bucket):
            flat = torch.cat([tensors[spec.name].detach().reshape(-1).to(self.group.device) for spec in specs])
            self.group.broadcast(flat)


# ----------------------------------------------------------------------------- engines


class BroadcastReceiver:
    """An engine process's end: ranks 1..N of a `WeightSyncGroup`, feeding one engine."""

    transport = "broadcast"

    def __init__(self, group: WeightSyncGroup, engine: WeightTarget) -> None:
        if group.rank == TRAINER_RANK:
            raise ValueError(f"rank {TRAINER_RANK} of the weight-sync group is the trainer, not a receiver")
        self.group = group
        self.engine = engine

    async def receive(self, expected_version: int | None = None) -> SyncMetrics:
        """Wait for the next version and apply it (see the contract in `weight_sync`).

        The wait for the manifest runs in a worker thread so the engine keeps serving until the
        trainer publishes; buckets are received on the loop thread while the engine is paused.
        Raises `WeightSyncError` when the manifest is rejected (after draining the version's
        buckets, so the group stays in step) and the engine keeps its previous version.
        """
        manifest = await asyncio.to_thread(self._receive_manifest)
        started = time.perf_counter()
        stream = _BucketStream(self.group, manifest)
        try:
            check_manifest(manifest, expected_version, engine_weight_specs(self.engine), self.engine.weight_version)
            await apply_to_engine(self.engine, manifest.version, stream)
        except BaseException:
            stream.drain()
            raise
        return SyncMetrics(self.transport, manifest.version, time.perf_counter() - started,
                           manifest.nbytes, len(manifest.buckets))

    def _receive_manifest(self) -> Manifest:
        length = torch.zeros(1, dtype=torch.int64, device=self.group.device)
        self.group.broadcast(length)
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.group.device)
        self.group.broadcast(payload)
        return Manifest.from_json(payload.cpu().numpy().tobytes().decode())


class _BucketStream:
    """Receives the buckets of one manifest in order, yielding views of each bucket's flat buffers;
    remembers how far it got so a failed apply can `drain` the rest."""

    def __init__(self, group: WeightSyncGroup, manifest: Manifest) -> None:
        self.group = group
        self.manifest = manifest
        self.next_bucket = 0
        self.broken = False  # a collective failed: the group is out of step, draining would only time out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self.next_bucket < len(self.manifest.buckets):
            yield from self._receive_bucket()

    def _receive_bucket(self) -> NamedTensors:
        """One whole bucket (all its dtype buffers), so a failure never splits a bucket."""
        index = self.next_bucket
        named: NamedTensors = []
        try:
            for _, specs in dtype_groups(self.manifest.buckets[index]):
                flat = torch.empty(sum(spec.numel for spec in specs), dtype=specs[0].torch_dtype,
                                   device=self.group.device)
                self.group.broadcast(flat)
                named.extend(zip((spec.name for spec in specs), _unflatten(flat, specs)))
        except RuntimeError as error:
            self.broken = True
            raise WeightSyncError(f"weight sync version {self.manifest.version}: receiving bucket {index} failed "
                                  f"({error})", version=self.manifest.version) from error
        finally:
            self.next_bucket = index + 1
        return named

    def drain(self) -> None:
        """Take part in the remaining broadcasts of this version, discarding the data."""
        try:
            while not self.broken and self.next_bucket < len(self.manifest.buckets):
                self._receive_bucket()
        except WeightSyncError:  # the group itself failed; nothing left to keep in step with
            pass


def _unflatten(flat: torch.Tensor, specs: list[TensorSpec]) -> list[torch.Tensor]:
    views, offset = [], 0
    for spec in specs:
        views.append(flat[offset: offset + spec.numel].view(spec.shape))
        offset += spec.numel
    return views


def loopback_environment() -> None:
    """Pin gloo to the loopback interface (single-host runs and tests)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
