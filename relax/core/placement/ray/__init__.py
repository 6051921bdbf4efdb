"""Ray placement (``--placement ray``): the roles in Ray processes (`service`, `workers`), and how weights and groups
move between them.

- Weights: pushed from the actor's processes to the rollout's over the configured transport (broadcast or disk),
  the push returning when the engines serve the version (`RayPushWeights`); or, in the async modes over disk
  without partial rollout, published as a versioned service that the rollout's engines follow between generations
  (`RayFollowedWeights`: the trainer publishes and goes on; a resumed run publishes first and its engines follow
  only its own versions).
- Groups (async modes): the rollout's process writes each step into TransferQueue itself (`RayFeed`); the trainer
  reads rows' keys and the actor's processes read the samples (`relax.data_plane.tq_plane`).
"""

from __future__ import annotations

from typing import Any

from relax.config import RelaxConfig
from relax.core.placement.ray.service import RayRoles, RayService
from relax.data_plane import StalenessGate
from relax.data_plane.tq_plane import TransferQueueDataPlane

# After a step's stream ended empty, how long to wait for the rollout process's error: it may arrive just after the
# end marker, and an empty step must then be raised, not skipped.
PRODUCER_ERROR_GRACE_S = 5.0


class RayPushWeights:
    """Each version goes from the actor's processes to the rollout's (broadcast, or disk then load) and the push
    returns once the engines serve it."""

    follows = False

    def __init__(self, service: RayService) -> None:
        self.service = service

    async def push(self, version: int) -> dict[str, float]:
        return await self.service.sync_weights(version)

    async def finish(self) -> None:
        return None


class RayFollowedWeights:
    """Weights as a versioned service over disk: the actor publishes each version and the step goes on; the rollout's
    engines load the newest of this run's versions between generations (`relax.distributed.weight_disk.DiskFollower`).
    The first publish comes before the engines start following, so a resumed run's engines start on the version it
    resumed from, never on a newer one a dead run left behind."""

    follows = True

    def __init__(self, service: RayService, roles: RayRoles) -> None:
        self.service, self.roles = service, roles
        self._following = False

    async def push(self, version: int) -> dict[str, float]:
        metrics = await self.service.publish_weights(version)
        if not self._following:
            await self.roles.rollout.follow_published_weights(str(self.service.weight_root), self.service.weight_run)
            await self.roles.rollout.catch_up_with_published_weights()
            self._following = True
        return metrics

    async def finish(self) -> None:
        """The run ends with its engines serving its final weights."""
        await self.roles.rollout.catch_up_with_published_weights()


class RayFeed:
    """The rollout's process generates each step into TransferQueue (the samples never pass through the loop's
    process) and writes the end marker itself, also when the generation fails."""

    failure_grace_s = PRODUCER_ERROR_GRACE_S
    carry_steps = 0

    def __init__(self, roles: RayRoles, gate: StalenessGate) -> None:
        self.roles = roles
        self.plane = TransferQueueDataPlane(gate)

    async def generate(self, step: int) -> tuple[dict[str, float], dict[str, int]]:
        return await self.roles.rollout.generate_into_plane(step)

    async def end_failed_step(self, step: int) -> None:
        return None  # the rollout's process wrote the end marker

    async def close(self) -> None:
        return None  # each step's generation ended with the step


class RayPlacement:
    """The roles in Ray processes of one `RayService`."""

    def __init__(self, cfg: RelaxConfig, service: RayService, roles: RayRoles) -> None:
        self.cfg, self.service, self.roles = cfg, service, roles
        follow = (cfg.fully_async or cfg.hybrid) and cfg.resolved_weight_sync_transport == "disk" \
            and not cfg.partial_rollout  # with --partial-rollout a push must land inside the generation in flight
        self.weights = RayFollowedWeights(service, roles) if follow else RayPushWeights(service)

    @classmethod
    def start(cls, cfg: RelaxConfig) -> RayPlacement:
        service = RayService(cfg)
        try:
            roles = service.start()
        except BaseException:
            service.shutdown()
            raise
        return cls(cfg, service, roles)

    def feed(self, gate: StalenessGate) -> RayFeed:
        return RayFeed(self.roles, gate)

    def beating_roles(self) -> list[str]:
        return list(self.service.workers)

    def watched_actors(self) -> dict[str, Any]:
        return self.service.transfer_queue_actors()

    def end_process(self, name: str) -> None:
        self.service.end_process(name)

    def close(self) -> None:
        self.service.shutdown()
