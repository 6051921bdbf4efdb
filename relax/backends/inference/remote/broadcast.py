"""Weight updates for SGLang-protocol servers over a broadcast group instead of a shared filesystem.

The trainer is rank 0 of a `WeightSyncGroup` (gloo on CPU, NCCL on GPU) and every server of the
router is one of ranks 1..N; servers join through SGLang's ``/init_weights_update_group`` and
receive each version through ``/update_weights_from_distributed`` (`relax serve` implements both;
see `relax.serving.sglang_routes`). One update is: post ``/update_weights_from_distributed`` to every
server (each starts waiting on the group), broadcast the manifest and the buckets from a worker
thread, and wait for every server's answer. Nothing touches the disk, so this is the transport for
engines on other GPUs of the same host or on hosts without a shared filesystem.

The group is built at the first update and rebuilt when the set of servers changes (elastic
scale-out or scale-in), on a fresh port each time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import torch

from relax.backends.inference.remote.sglang import EngineHTTPError, SGLangHTTPEngine
from relax.distributed.process_group import free_port
from relax.distributed.weight_broadcast import BroadcastPublisher, WeightSyncGroup
from relax.distributed.weight_sync import NamedTensors

logger = logging.getLogger(__name__)

GROUP_NAME = "relax_weight_sync"


class BroadcastWeightTransport:
    """Pushes versions to SGLang-protocol servers over one broadcast group.

    ``master_address`` is the address the servers reach the trainer's TCP store at (the trainer
    binds it); ``backend`` is ``nccl`` when trainer and servers hold their weights on GPUs.
    ``device`` is the trainer's device for the collectives (its current CUDA device by default).
    """

    transport = "broadcast"

    def __init__(self, master_address: str = "127.0.0.1", backend: str = "gloo",
                 device: torch.device | None = None, timeout_s: float = 300.0) -> None:
        self.master_address = master_address
        self.backend = backend
        self.device = device
        self.timeout_s = timeout_s
        self._group: WeightSyncGroup | None = None
        self._members: tuple[str, ...] = ()

    async def update(self, engines: Sequence[SGLangHTTPEngine], buckets: list[NamedTensors], version: int) -> None:
        """Every engine serves ``version`` afterwards; raises `EngineHTTPError` naming the server that refused."""
        members = tuple(engine.base_url for engine in engines)
        if self._group is None or members != self._members:
            await self._join(engines)
        publisher = BroadcastPublisher(self._group)
        receiving = [asyncio.create_task(self._receive(engine, version)) for engine in engines]
        try:
            await asyncio.to_thread(lambda: asyncio.run(publisher.publish(buckets, version)))
        finally:
            answers = await asyncio.gather(*receiving, return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException):
                self.close()  # a peer that failed mid-version leaves the group out of step: rebuild next time
                raise answer

    async def _join(self, engines: Sequence[SGLangHTTPEngine]) -> None:
        self.close()
        port = free_port(self.master_address)
        world_size = len(engines) + 1
        joining = [asyncio.create_task(engine.http.request(
            "POST", "/init_weights_update_group", timeout_s=self.timeout_s, json={
                "master_address": self.master_address, "master_port": port, "rank_offset": rank,
                "world_size": world_size, "backend": self.backend, "group_name": GROUP_NAME,
                "timeout_s": self.timeout_s}))
            for rank, engine in enumerate(engines, start=1)]
        try:
            self._group = await asyncio.to_thread(
                WeightSyncGroup.init, self.master_address, port, 0, world_size, self.backend, self.timeout_s,
                self.device)
        finally:
            answers = await asyncio.gather(*joining, return_exceptions=True)
        for engine, answer in zip(engines, answers):
            if isinstance(answer, BaseException):
                self.close()
                raise answer
        self._members = tuple(engine.base_url for engine in engines)
        logger.info("weight-sync group (%s) with %d server(s) on %s:%d", self.backend, len(engines),
                    self.master_address, port)

    @staticmethod
    async def _receive(engine: SGLangHTTPEngine, version: int) -> None:
        answer = await engine.http.request("POST", "/update_weights_from_distributed", timeout_s=None,
                                           json={"weight_version": version, "group_name": GROUP_NAME})
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineHTTPError(f"POST {engine.base_url}/update_weights_from_distributed: {answer.get('message')}",
                                  engine.base_url, "/update_weights_from_distributed")
        engine.note_weight_version(version)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group, self._members = None, ()
