"""The `TrainBackend` contract and the batch it consumes."""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from relax.algorithms.loss import LossFn


@dataclass
class TrainBatch:
    """Samples as the trainer sees them.

    ``tokens[i]`` is prompt + response ids of sample i. ``loss_masks[i]`` and every entry of
    ``fields`` (advantages, old/ref log-probs, ...) hold one value per response token, i.e.
    ``response_lengths[i]`` values.
    """

    tokens: list[list[int]]
    response_lengths: list[int]
    loss_masks: list[list[int]]
    fields: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, indices: Sequence[int]) -> TrainBatch:
        return TrainBatch(
            tokens=[self.tokens[i] for i in indices],
            response_lengths=[self.response_lengths[i] for i in indices],
            loss_masks=[self.loss_masks[i] for i in indices],
            fields={name: [values[i] for i in indices] for name, values in self.fields.items()},
        )

    def num_loss_tokens(self) -> int:
        return sum(sum(mask) for mask in self.loss_masks)


class TrainBackend(abc.ABC):
    @abc.abstractmethod
    def compute_log_probs(self, batch: TrainBatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-sample log-probs and entropies of the response tokens (no gradient), on CPU."""

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on the global batch ``batch``; returns step metrics."""

    @abc.abstractmethod
    def named_parameters_for_sync(self, dtype: torch.dtype, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full (unsharded) weights in Hugging Face naming, in buckets of about ``bucket_bytes``."""

    @abc.abstractmethod
    def save(self, directory: Path) -> None:
        """Write model, optimizer and LR-schedule state."""

    @abc.abstractmethod
    def load(self, directory: Path) -> None:
        """Restore what `save` wrote."""
