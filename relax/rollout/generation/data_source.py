"""Which prompts each rollout step uses.

The order is a pure function of the seed: an endless stream made of one (optionally shuffled)
permutation of the prompts per epoch. A cursor (``consumed``) marks how many prompts of the
stream were taken. Without dynamic sampling, step ``s`` takes positions ``[s·B, (s+1)·B)``;
dynamic sampling takes further positions to refill filtered groups. The cursor is saved with
each checkpoint, so a resumed run continues exactly where the interrupted one stopped.

Positions taken but not trained when a checkpoint is written (groups still decoding or finished for a later step
under ``--over-sampling-batch-size``, `relax.core.streaming.carry_over`) are saved beside the cursor as
``pending_prompts``; a resumed run takes them again first, so no prompt is lost or trained twice.
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
        self.pending: list[int] = []  # positions below the cursor to take again first (restored from a checkpoint)

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

    def take_positions(self, count: int) -> list[tuple[int, Sample]]:
        """The next ``count`` prompts with their stream positions: the pending ones first, then those at the cursor
        (which advances)."""
        positions = self.pending[:count]
        del self.pending[:count]
        fresh = count - len(positions)
        positions += range(self.consumed, self.consumed + fresh)
        self.consumed += fresh
        return [(position, self.prompts_at(position, 1)[0]) for position in positions]

    def state_dict(self) -> dict:
        state: dict = {"consumed_prompts": self.consumed}
        if self.pending:
            state["pending_prompts"] = list(self.pending)
        return state

    def load_state_dict(self, state: dict) -> None:
        consumed = int(state["consumed_prompts"])
        pending = sorted({int(position) for position in state.get("pending_prompts", ())})
        if any(not 0 <= position < consumed for position in pending):
            raise ValueError(f"pending_prompts {pending} must lie below consumed_prompts {consumed}")
        self.consumed, self.pending = consumed, pending
