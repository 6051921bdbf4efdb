"""Which prompts each rollout step uses.

The order is a pure function of the seed: an endless stream made of one (optionally shuffled)
permutation of the prompts per epoch. A cursor (``consumed``) marks how many prompts of the
stream were taken. Without dynamic sampling, step ``s`` takes positions ``[s·B, (s+1)·B)``;
dynamic sampling takes further positions to refill filtered groups. The cursor is saved with
each checkpoint, so a resumed run continues exactly where the interrupted one stopped.
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
        self.consumed = 0  # prompts of the stream taken so far (the cursor)

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

    def epoch_of_position(self, position: int) -> int:
        return position // len(self.prompts)

    def prompts_at(self, start: int, count: int) -> list[Sample]:
        """Fresh copies of stream positions ``[start, start + count)`` (callers may fill them in)."""
        batch = []
        for position in range(start, start + count):
            epoch, offset = divmod(position, len(self.prompts))
            batch.append(copy.deepcopy(self.prompts[self.epoch_order(epoch)[offset]]))
        return batch

    def prompts_for_step(self, rollout_id: int) -> list[Sample]:
        """Fresh copies of step ``rollout_id``'s prompts when no step took extra prompts."""
        return self.prompts_at(rollout_id * self.rollout_batch_size, self.rollout_batch_size)

    def take(self, count: int) -> tuple[int, list[Sample]]:
        """The next ``count`` prompts at the cursor, and the stream position of the first; advances the cursor."""
        start = self.consumed
        self.consumed += count
        return start, self.prompts_at(start, count)

    def state_dict(self) -> dict[str, int]:
        return {"consumed_prompts": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed = int(state["consumed_prompts"])
