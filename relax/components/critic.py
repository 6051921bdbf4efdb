"""The Critic role (PPO): a value model that predicts each response token's return.

Each rollout step it first gives the values ``V_t`` that GAE needs (before any update, so they
are also the centre of the value clip), then trains on the GAE returns in
``len(samples) / train_batch_size`` optimizer steps, like the actor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from relax.algorithms.loss import LossFn
from relax.backends.training.fsdp import FSDPTrainBackend
from relax.components.actor import to_train_batch, train_in_optimizer_steps
from relax.data.sample import Sample

CHECKPOINT_SUBDIR = "critic"  # inside each iter_XXXXXXX directory, beside the actor's files


class Critic:
    def __init__(self, backend: FSDPTrainBackend, loss_fn: LossFn, train_batch_size: int):
        if not backend.value_head:
            raise ValueError("the critic needs a backend built with value_head=True")
        self.backend = backend
        self.loss_fn = loss_fn
        self.train_batch_size = train_batch_size

    async def compute_values(self, samples: list[Sample]) -> list[torch.Tensor]:
        return self.backend.compute_values(to_train_batch(samples))

    async def train(self, samples: list[Sample], returns: list[torch.Tensor],
                    old_values: list[torch.Tensor]) -> dict[str, float]:
        """Fit the values to ``returns``; returns ``critic/*`` metrics averaged over optimizer steps."""
        batch = to_train_batch(samples, {"returns": returns, "old_values": old_values})
        return train_in_optimizer_steps(self.backend, batch, self.loss_fn, self.train_batch_size, prefix="critic/")

    def save(self, iteration_dir: Path, include_optimizer: bool = True, asynchronous: bool = False) -> list:
        directory = Path(iteration_dir) / CHECKPOINT_SUBDIR
        directory.mkdir(parents=True, exist_ok=True)
        return self.backend.save(directory, include_optimizer=include_optimizer, asynchronous=asynchronous)

    def load(self, iteration_dir: Path) -> None:
        self.backend.load(Path(iteration_dir) / CHECKPOINT_SUBDIR)
