"""The `TrainBackend` contract and the batch it consumes."""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from relax.algorithms.aggregation import StepCounts
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
    # Token ids ``[T_i, k]`` per sample at which log-probs are also wanted (the teacher's top-k
    # of on-policy distillation); the loss sees them as the field ``gathered_log_probs``.
    gather_ids: list[torch.Tensor] | None = None
    # Per sample, the processor tensors of its media (pixel values, grid sizes, audio features), or
    # None for a text-only sample; they go through the model's multimodal path with gradients.
    multimodal: list[dict[str, torch.Tensor] | None] | None = None
    # Per sample, the experts the engine routed its tokens to, ``[T_i - 1, L, k]`` (rollout routing replay).
    routed_experts: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, indices: Sequence[int]) -> TrainBatch:
        return TrainBatch(
            tokens=[self.tokens[i] for i in indices],
            response_lengths=[self.response_lengths[i] for i in indices],
            loss_masks=[self.loss_masks[i] for i in indices],
            fields={name: [values[i] for i in indices] for name, values in self.fields.items()},
            gather_ids=None if self.gather_ids is None else [self.gather_ids[i] for i in indices],
            multimodal=None if self.multimodal is None else [self.multimodal[i] for i in indices],
            routed_experts=None if self.routed_experts is None else [self.routed_experts[i] for i in indices],
        )

    def num_loss_tokens(self) -> int:
        return sum(sum(mask) for mask in self.loss_masks)


class PerTokenOutputs(NamedTuple):
    """A micro-batch forward, all ``[B, R]`` over response positions: ``primary`` holds the
    policy's log-probs (or the critic's values), ``entropy`` is None for a critic, ``gathered``
    ``[B, R, k]`` holds log-probs at the batch's ``gather_ids`` when it has them."""

    primary: torch.Tensor
    entropy: torch.Tensor | None
    response_mask: torch.Tensor
    gathered: torch.Tensor | None = None
    top_log_probs: torch.Tensor | None = None  # [B, R, k], the k most likely tokens' log-probs
    top_ids: torch.Tensor | None = None  # [B, R, k]


class LogProbs(NamedTuple):
    """Per-sample results of a forward without gradient, on CPU: ``[T_i]`` log-probs and
    entropies, and ``[T_i, k]`` log-probs at ``gather_ids`` (None when none were asked for)."""

    log_probs: list[torch.Tensor]
    entropy: list[torch.Tensor]
    gathered: list[torch.Tensor] | None = None
    top_log_probs: list[torch.Tensor] | None = None  # [T_i, k] with top_k > 0
    top_ids: list[torch.Tensor] | None = None  # [T_i, k]


class TrainBackend(abc.ABC):
    @abc.abstractmethod
    def compute_log_probs(self, batch: TrainBatch, top_k: int = 0) -> LogProbs:
        """Per-sample log-probs and entropies of the response tokens (no gradient), on CPU; with
        ``top_k`` also the ``top_k`` most likely tokens at each response position."""

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on the global batch ``batch``; returns step metrics."""

    @abc.abstractmethod
    def begin_step(self, loss_fn: LossFn, counts: StepCounts) -> None:
        """Open an optimizer step whose batch arrives in chunks; the loss divides by ``counts`` (provisional when
        the chunks are not all known yet)."""

    @abc.abstractmethod
    def accumulate(self, batch: TrainBatch, last: bool = False) -> None:
        """Add the gradients of chunk ``batch`` to the open step."""

    @abc.abstractmethod
    def end_step(self, loss_kind: str | None = None) -> dict[str, float]:
        """Apply the open step; with ``loss_kind`` (what the loss divides by) its gradients and metrics are rescaled
        from the counts it began with to those its chunks held. Its metrics."""

    @abc.abstractmethod
    def named_parameters_for_sync(self, dtype: torch.dtype, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full (unsharded) weights in Hugging Face naming, in buckets of about ``bucket_bytes``."""

    @abc.abstractmethod
    def save(self, directory: Path) -> None:
        """Write model, optimizer and LR-schedule state."""

    @abc.abstractmethod
    def load(self, directory: Path) -> None:
        """Restore what `save` wrote."""
