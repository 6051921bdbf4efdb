"""The ActorFwd role: forward-only log-probs of a frozen model (it also serves `reference`)."""

from __future__ import annotations

import torch

from relax.backends.training.base import TrainBackend
from relax.components.actor import to_train_batch
from relax.data.sample import Sample


class ActorFwd:
    def __init__(self, backend: TrainBackend):
        self.backend = backend

    async def compute_log_probs(self, samples: list[Sample]) -> list[torch.Tensor]:
        return self.backend.compute_log_probs(to_train_batch(samples)).log_probs
