"""The Actor role: the policy being trained."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from pathlib import Path

import torch

from relax.algorithms.aggregation import LossAggregation, StepCounts, denominator_kind
from relax.algorithms.loss import LossFn
from relax.backends.training.base import LogProbs, TrainBackend, TrainBatch
from relax.data.sample import Sample


def to_train_batch(samples: list[Sample], fields: dict[str, list[torch.Tensor]] | None = None,
                   gather_ids: list[torch.Tensor] | None = None, routed_experts: bool = False) -> TrainBatch:
    """The trainer's view of ``samples``; with ``routed_experts`` the engine's routing of each sample (R3)."""
    return TrainBatch(
        tokens=[s.tokens for s in samples],
        response_lengths=[s.response_length for s in samples],
        loss_masks=[s.loss_mask if s.loss_mask is not None else [1] * s.response_length for s in samples],
        fields=dict(fields or {}),
        gather_ids=gather_ids,
        multimodal=[s.multimodal_train_inputs for s in samples] if any(s.multimodal_train_inputs for s in samples)
        else None,
        routed_experts=[rollout_routes(s) for s in samples] if routed_experts else None,
    )


def rollout_routes(sample: Sample) -> torch.Tensor:
    if sample.rollout_routed_experts is None:
        raise ValueError(f"sample {sample.index} carries no routed experts: --use-rollout-routing-replay needs the "
                         "engine's routing of every sample (a custom generate function sets "
                         "sample.rollout_routed_experts from its GenerationOutput.routed_experts)")
    return torch.as_tensor(sample.rollout_routed_experts)


def train_in_optimizer_steps(backend: TrainBackend, batch: TrainBatch, loss_fn: LossFn, train_batch_size: int,
                             prefix: str) -> dict[str, float]:
    """One optimizer step per ``train_batch_size`` samples of ``batch``, in order; returns the
    step metrics averaged over the steps, named ``prefix + name``."""
    per_step = [
        backend.train_step(batch.select(range(start, min(start + train_batch_size, len(batch)))), loss_fn)
        for start in range(0, len(batch), train_batch_size)
    ]
    return {f"{prefix}{name}": statistics.fmean(m[name] for m in per_step) for name in per_step[0]}


class Actor:
    """Trains on each rollout batch in ``len(samples) / train_batch_size`` optimizer steps.

    With a single optimizer step per rollout the policy has not moved when the loss is computed,
    so the old log-probs equal the current ones: they are not recomputed (upstream's true
    on-policy mode). With several steps they are computed once, before the first step.
    """

    def __init__(self, backend: TrainBackend, loss_fn: LossFn, train_batch_size: int, routing_replay: bool = False,
                 loss_aggregation: LossAggregation = "seq-mean-token-mean"):
        self.backend = backend
        self.loss_fn = loss_fn
        self.train_batch_size = train_batch_size
        self.routing_replay = routing_replay  # forwards route tokens to the rollout's experts (R3)
        self.loss_kind = denominator_kind(loss_aggregation)
        self._streamed_step: int | None = None  # the rollout step whose chunks the backend's open step holds

    def needs_old_log_probs(self, num_samples: int) -> bool:
        return num_samples > self.train_batch_size

    async def compute_log_probs(self, samples: list[Sample], gather_ids: list[torch.Tensor] | None = None) -> LogProbs:
        """The current policy's log-probs (and at ``gather_ids``, when given), without gradient."""
        return self.backend.compute_log_probs(to_train_batch(samples, gather_ids=gather_ids,
                                                             routed_experts=self.routing_replay))

    async def compute_values(self, samples: list[Sample]) -> list[torch.Tensor]:
        """A reward model's scores after each response token ``[T_i]`` per sample, without gradient."""
        return self.backend.compute_values(to_train_batch(samples))

    async def train(self, samples: list[Sample], fields: dict[str, list[torch.Tensor]],
                    gather_ids: list[torch.Tensor] | None = None) -> dict[str, float]:
        """Train on the rollout batch; returns ``train/*`` metrics averaged over optimizer steps."""
        batch = to_train_batch(samples, fields, gather_ids, routed_experts=self.routing_replay)
        metrics = train_in_optimizer_steps(self.backend, batch, self.loss_fn, self.train_batch_size, prefix="train/")
        metrics["train/optimizer_steps"] = float(math.ceil(len(samples) / self.train_batch_size))
        return metrics

    # ---- a step trained as its data arrives ------------------------------------------------
    async def streamed_step_unsupported(self, num_samples: int) -> str | None:
        """Why a step of ``num_samples`` cannot be trained chunk by chunk as its groups arrive, or None."""
        if self.needs_old_log_probs(num_samples):
            return f"several optimizer steps per rollout ({num_samples} samples, --global-batch-size " \
                   f"{self.train_batch_size}) need the old-policy log-probs of the whole batch first"
        if self.loss_kind == "tokens" and getattr(self.backend, "adds_per_sample_loss", False):
            return "the MoE auxiliary loss divides by samples and the token-mean loss by tokens: one rescale " \
                   "cannot correct both"
        return None

    async def train_chunk(self, step: int, samples: list[Sample], fields: dict[str, list[torch.Tensor]],
                          expected_samples: int, last: bool) -> None:
        """Add ``samples`` (whole groups of rollout step ``step``) to that step's one optimizer step; the first chunk
        of a step opens it. The loss divides by provisional counts (``expected_samples``, and the tokens the first
        chunk implies for them) that `finish_streamed_step` corrects. ``last``: no chunk follows."""
        batch = to_train_batch(samples, fields, routed_experts=self.routing_replay)
        if self._streamed_step != step:
            tokens = math.ceil(batch.num_loss_tokens() * expected_samples / max(len(batch), 1))
            self.backend.begin_step(self.loss_fn, StepCounts(expected_samples, max(tokens, 1)))
            self._streamed_step = step
        self.backend.accumulate(batch, last=last)

    async def finish_streamed_step(self, step: int) -> dict[str, float]:
        """Apply the optimizer step of ``step``'s chunks; ``train/*`` metrics as `train` gives them."""
        streamed, self._streamed_step = self._streamed_step, None
        if streamed != step:
            raise RuntimeError(f"no chunk of step {step + 1} was trained")
        metrics = {f"train/{name}": value for name, value in self.backend.end_step(self.loss_kind).items()}
        metrics["train/optimizer_steps"] = 1.0
        return metrics

    def weight_buckets(self, dtype: torch.dtype, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return self.backend.named_parameters_for_sync(dtype, bucket_bytes)

    def save(self, directory: Path, include_optimizer: bool = True, asynchronous: bool = False) -> list:
        """The backend's save; with ``asynchronous`` the futures of the files still being written."""
        return self.backend.save(directory, include_optimizer=include_optimizer, asynchronous=asynchronous)

    def load(self, directory: Path) -> None:
        self.backend.load(directory)
