"""In-process placement (the default): every role is an object in the trainer's process, and no Ray runs.

Weights are copied into the engines in place (`InProcessWeights`); the asynchronous modes' groups go through an
in-process data plane (`InProcessFeed`). When the engines live in other processes (external servers, a Serve
deployment) the rollout only waits on HTTP, so in the async modes the trainer-side roles compute on a thread of
their own (`relax.core.placement.compute_thread`) and the two overlap. ``--colocate-async`` does the same with the
embedded engine: it decodes on the event loop's thread while the trainer computes on its own thread and CUDA stream,
both on the one device.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from relax.config import RelaxConfig
from relax.core.build import build_roles
from relax.core.placement.compute_thread import ComputeThread, OffLoopRole
from relax.core.placement.feeds import InProcessFeed, RolloutFeed
from relax.core.placement.weights import InProcessWeights
from relax.core.roles import Roles
from relax.core.streaming.carry_over import CarryOverFeed
from relax.data_plane import StalenessGate

logger = logging.getLogger("relax")


class InProcessPlacement:
    def __init__(self, cfg: RelaxConfig, roles: Roles, compute_thread: ComputeThread | None = None) -> None:
        self.cfg = cfg
        self.roles = roles
        self.weights = InProcessWeights(cfg, roles)
        self._compute_thread = compute_thread

    @classmethod
    def build(cls, cfg: RelaxConfig) -> InProcessPlacement:
        roles = build_roles(cfg)
        compute_thread = None
        if cfg.colocate_async or (
                (cfg.fully_async or cfg.hybrid) and (cfg.rollout_external or cfg.rollout_serve_replicas)):
            compute_thread = ComputeThread(roles.device, own_stream=cfg.colocate_async)
            roles = dataclasses.replace(roles, **{
                name: OffLoopRole(getattr(roles, name), compute_thread)
                for name in ("actor", "reference", "critic") if getattr(roles, name) is not None})
        return cls(cfg, roles, compute_thread)

    def feed(self, gate: StalenessGate) -> RolloutFeed:
        if self.cfg.carries_groups_over:
            return CarryOverFeed(self.roles, gate, self.cfg.over_sampling_batch_size)
        return InProcessFeed(self.roles, gate)

    def beating_roles(self) -> list[str]:
        return []  # every role is this process: its health is the run's (the stall watchdog watches its phases)

    def watched_actors(self) -> dict[str, Any]:
        return {}

    def end_process(self, name: str) -> None:
        raise KeyError(f"no process of its own: {name}")  # nothing beats or is watched in one process

    def close(self) -> None:
        """End what the rollout's engines started (a Serve deployment and its Ray, HTTP clients) and the compute
        thread."""
        if self._compute_thread is not None:
            self._compute_thread.close()
        close = getattr(getattr(self.roles.rollout, "engine", None), "aclose", None)
        if close is not None:
            try:
                asyncio.run(close())
            except Exception as error:  # noqa: BLE001 - the run's result stands; say what was left behind
                logger.warning("closing the rollout engines failed: %s", error)
