"""Where the asynchronous modes' groups come from (a placement's `RolloutFeed`).

The loop's producer asks the feed to generate step ``s`` into the data plane's partition ``train_{s}`` (and close the
partition, also when the generation fails), and its trainer reads the partition back. In this process the rollout
role generates and the feed writes each group as it is scored (`InProcessFeed`; with ``--over-sampling-batch-size``
the groups of several steps decode at once and each step takes the first to finish: `relax.core.streaming.
carry_over.CarryOverFeed`); under Ray placement the rollout's process writes into TransferQueue itself and the feed
only asks it to.
"""

from __future__ import annotations

from typing import Protocol

from relax.core.roles import Roles
from relax.core.streaming.roles import generate_group_by_group
from relax.data_plane import DataPlane, InProcessDataPlane, StalenessGate


class RolloutFeed(Protocol):
    plane: DataPlane
    # How long the trainer waits, after a step's stream ended empty, for the rollout's error to arrive (it may come
    # from another process just after the end marker): an empty step is then raised as a failure, not skipped.
    failure_grace_s: float
    # How many steps after the one that launched it a group may still be taken: the producer keeps that many of
    # --max-staleness's slots free, so that a group carried over is not stale when it is trained.
    carry_steps: int

    async def generate(self, step: int) -> tuple[dict[str, float], dict[str, int]]:
        """Generate step ``step`` into its partition and close it; the rollout metrics and the data cursor after."""

    async def end_failed_step(self, step: int) -> None:
        """Close the partition of a step whose generation failed, so the trainer's stream ends."""

    async def close(self) -> None:
        """Stop what the feed still generates (the run ended)."""


class InProcessFeed:
    """The rollout role in this process writes each scored group into an in-process data plane."""

    failure_grace_s = 0.0
    carry_steps = 0

    def __init__(self, roles: Roles, gate: StalenessGate) -> None:
        self.roles = roles
        self.plane = InProcessDataPlane(gate)

    async def generate(self, step: int) -> tuple[dict[str, float], dict[str, int]]:
        metrics = await generate_group_by_group(self.roles.rollout, self.plane, step)
        await self.plane.mark_complete(step)
        return metrics, self.roles.rollout.data_source.state_dict()

    async def end_failed_step(self, step: int) -> None:
        await self.plane.mark_complete(step)

    async def close(self) -> None:
        return None  # each step's generation ended with the step
