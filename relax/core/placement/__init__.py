"""Where a run's roles live, as a strategy the training loops are handed.

A placement gives the loop three things and takes them down at the end:

- ``roles``: the actor, rollout, reference, critic, advantages (objects in this process, or proxies with the same
  async methods for roles in Ray processes);
- ``weights``: how a new version of the weights reaches the engines (`WeightSync`): copied in this process, pushed
  to other processes over broadcast or disk, or published for engines that follow the versions themselves;
- ``feed(gate)``: for the asynchronous modes, where each step's groups come from (`RolloutFeed`): a producer in this
  process writing the data plane, or the rollout's Ray process writing TransferQueue itself.

The loops (`relax.core.loops`) are the same for every placement: a loop never subclasses another to change where
the roles are.
"""

from __future__ import annotations

from typing import Any, Protocol

from relax.config import RelaxConfig
from relax.core.placement.feeds import RolloutFeed
from relax.core.placement.weights import WeightSync
from relax.core.roles import Roles
from relax.data_plane import StalenessGate


class Placement(Protocol):
    roles: Roles
    weights: WeightSync

    def feed(self, gate: StalenessGate) -> RolloutFeed:
        """The source of the asynchronous modes' groups, writing into a data plane gated by ``gate``."""

    def beating_roles(self) -> list[str]:
        """The roles in processes of their own, which send heartbeats (`relax.core.state.health`)."""

    def watched_actors(self) -> dict[str, Any]:
        """Ray actors the health monitor pings (the data plane's)."""

    def end_process(self, name: str) -> None:
        """End the process of ``name`` (a beating role or a watched actor) that the health check found stopped,
        hung or dead, so that the run's teardown fails fast on it instead of waiting out its timeouts."""

    def close(self) -> None:
        """Tear down what the placement started (processes, engines, threads)."""


def place_roles(cfg: RelaxConfig) -> Placement:
    """The placement ``--placement`` names, with its roles built and started."""
    if cfg.placement == "ray":
        from relax.core.placement.ray import RayPlacement  # Ray is an optional dependency

        return RayPlacement.start(cfg)
    from relax.core.placement.in_process import InProcessPlacement

    return InProcessPlacement.build(cfg)


__all__ = ["Placement", "RolloutFeed", "WeightSync", "place_roles"]
