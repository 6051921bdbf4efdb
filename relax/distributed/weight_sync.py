"""Weight sync (DCS), in-process transport: stream the trainer's buckets into an engine.

The trainer publishes version ``v``; the engine serves ``v`` once every bucket has landed. Other
transports (torch.distributed broadcast, safetensors on disk) come with the service placement.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Protocol

import torch


class WeightSource(Protocol):
    def weight_buckets(self, dtype: torch.dtype, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]: ...


class WeightSink(Protocol):
    async def update_weights(self, named_tensors, version: int) -> None: ...


async def sync_weights_in_process(
    source: WeightSource, sink: WeightSink, version: int, dtype: torch.dtype, bucket_bytes: int
) -> dict[str, float]:
    """Copy all weights from ``source`` to ``sink`` as ``version``; returns timing metrics."""
    started = time.perf_counter()
    buckets = source.weight_buckets(dtype, bucket_bytes)
    await sink.update_weights(itertools.chain.from_iterable(buckets), version)
    return {"perf/weight_sync_s": time.perf_counter() - started}
