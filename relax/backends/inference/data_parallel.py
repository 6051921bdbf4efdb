"""`DataParallelEngine`: colocated rollout across the ranks of a multi-GPU trainer (``torchrun``).

Under ``torchrun --nproc-per-node N relax train ...`` every rank holds an FSDP shard of the policy
and a whole engine on its own GPU, and every rank runs the same training loop on the same data.
Each engine call is therefore made on every rank with the same requests: this wrapper generates
only the prompt groups assigned to its rank (group ``k`` of the call, in order of first
appearance, goes to rank ``k mod N``, so the groups of one prompt share an engine and its prefill)
and all-gathers the outputs, so every rank returns all of them in the request order and the loop
continues identically on every rank. Weight updates go to the local engine only: every rank gets
the full tensors from the FSDP gather and loads its own copy.

Decoding is memory-bound, so a GPU decodes its half of the batch in about the time the whole
batch would take; the gain of colocation across N GPUs is in training, which FSDP splits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from relax.backends.inference.base import (
    PAUSE_OPERATOR,
    GenerationOutput,
    GenerationRequest,
    InferenceEngine,
    group_key,
)


def assign_groups(requests: Sequence[GenerationRequest], world_size: int) -> list[int]:
    """The rank that generates each request: prompt groups round-robin in order of first appearance."""
    group_rank: dict[str, int] = {}
    for request in requests:
        group_rank.setdefault(group_key(request.request_id), len(group_rank) % world_size)
    return [group_rank[group_key(request.request_id)] for request in requests]


class DataParallelEngine(InferenceEngine):
    """Wraps this rank's engine; must be called with the same requests on every rank of the default group."""

    def __init__(self, engine: InferenceEngine) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DataParallelEngine needs the default process group (torchrun)")
        self.engine = engine
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        owners = assign_groups(requests, self.world_size)
        mine = [request for request, owner in zip(requests, owners) if owner == self.rank]
        local = await self.engine.generate(mine) if mine else []
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, list(local))
        outputs = {output.request_id: output for part in gathered for output in part}
        return [outputs[request.request_id] for request in requests]

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await self.engine.update_weights(named_tensors, version)

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self.engine.abort(request_ids)

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self.engine.release_memory_occupation(tags)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        await self.engine.resume_memory_occupation(tags)

    async def pause(self, owner: str = PAUSE_OPERATOR) -> None:
        await self.engine.pause(owner)

    async def resume(self, owner: str = PAUSE_OPERATOR) -> None:
        await self.engine.resume(owner)

    async def health(self) -> dict[str, Any]:
        return {**await self.engine.health(), "rank": self.rank, "world_size": self.world_size}

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def __getattr__(self, name: str) -> Any:
        # Everything else (tokenizer, model, score, ...) is the local engine's.
        return getattr(self.engine, name)
