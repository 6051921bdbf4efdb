"""How a new version of the weights reaches the rollout's engines (a placement's `WeightSync`).

``push(version)`` returns when the engines serve ``version`` (their metrics: seconds, bytes, buckets), except for a
sync that ``follows``: the trainer publishes the version and goes on, and the engines load it themselves between
generations (so nothing waits for the generation in flight); ``finish()`` then makes the run end with its engines
on its last version.
"""

from __future__ import annotations

from typing import Protocol

from relax.config import RelaxConfig
from relax.core.roles import Roles
from relax.distributed.weight_sync import sync_weights_in_process


class WeightSync(Protocol):
    follows: bool  # the engines follow published versions: a push does not wait for the generation in flight

    async def push(self, version: int) -> dict[str, float]: ...

    async def finish(self) -> None: ...


class InProcessWeights:
    """The engines are in the trainer's process: the actor's buckets are copied into them (`sync_weights_in_process`)."""

    follows = False

    def __init__(self, cfg: RelaxConfig, roles: Roles) -> None:
        self.roles, self.bucket_bytes = roles, cfg.update_weight_buffer_size

    async def push(self, version: int) -> dict[str, float]:
        return await sync_weights_in_process(self.roles.actor, self.roles.rollout, version, self.roles.inference_dtype,
                                             self.bucket_bytes)

    async def finish(self) -> None:
        return None
