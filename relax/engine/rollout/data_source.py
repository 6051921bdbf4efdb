"""Which prompts each rollout step uses.

The order is a pure function of (seed, step): step ``s`` takes positions
``[s·B, (s+1)·B)`` of an endless stream made of one (optionally shuffled) permutation of the
prompts per epoch. A resumed run therefore needs only the step number to continue exactly where
the interrupted one stopped.
"""

from __future__ import annotations

import copy

import torch

from relax.data.sample import Sample


class PromptDataSource:
    def __init__(self, prompts: list[Sample], rollout_batch_size: int, shuffle: bool, seed: int):
        if not prompts:
            raise ValueError("the prompt dataset is empty")
        self.prompts = prompts
        self.rollout_batch_size = rollout_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self._order_cache: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.prompts)

    def epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._order_cache:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(len(self.prompts), generator=generator).tolist()
            else:
                order = list(range(len(self.prompts)))
            self._order_cache = {epoch: order}  # steps move forward: one epoch at a time is enough
        return self._order_cache[epoch]

    def epoch_of_step(self, rollout_id: int) -> int:
        return rollout_id * self.rollout_batch_size // len(self.prompts)

    def prompts_for_step(self, rollout_id: int) -> list[Sample]:
        """Fresh copies of this step's prompts (callers may fill them in)."""
        batch = []
        for position in range(rollout_id * self.rollout_batch_size, (rollout_id + 1) * self.rollout_batch_size):
            epoch, offset = divmod(position, len(self.prompts))
            batch.append(copy.deepcopy(self.prompts[self.epoch_order(epoch)[offset]]))
        return batch
