"""The training loops, one per mode, each naming its steps: colocated sync (`sync.SyncController`), supervised
fine-tuning (`sync.SFTController`), preference training (`preference.DPOController`), reward-model training
(`preference.RewardModelController`), fully async and hybrid (`asynchronous.AsyncController`). A loop is handed a
placement (`relax.core.placement`): the same loop runs in one process and under Ray."""

from __future__ import annotations

from relax.config import RelaxConfig
from relax.core.loops.asynchronous import AsyncController
from relax.core.loops.preference import DPOController, RewardModelController
from relax.core.loops.sync import SFTController, SyncController


def loop_class(cfg: RelaxConfig) -> type[SyncController]:
    """The training loop of the configured mode."""
    if cfg.loss_type == "sft":
        return SFTController
    if cfg.loss_type == "dpo":
        return DPOController
    if cfg.loss_type == "rm":
        return RewardModelController
    return AsyncController if cfg.fully_async or cfg.hybrid else SyncController


__all__ = ["AsyncController", "DPOController", "RewardModelController", "SFTController", "SyncController",
           "loop_class"]
