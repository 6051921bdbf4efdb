"""Reduce per-token values to one loss so that gradient accumulation over micro-batches is exact.

Each micro-batch returns its share of the global mean: the denominators are global (over the
whole optimizer step), so summing micro-batch losses gives the loss of the full batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

LossAggregation = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)


def aggregate_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggregation,
    global_num_samples: int,
    global_num_tokens: int,
    max_response_len: int | None = None,
) -> torch.Tensor:
    """Aggregate ``values`` ``[B, T]`` under ``mask`` ``[B, T]`` (1 = counted).

    - ``seq-mean-token-mean`` (upstream default): mean over each sample's tokens, then the sum over
      samples divided by the number of samples in the optimizer step. Fully masked samples
      contribute 0.
    - ``token-mean`` (``--calculate-per-token-loss``): sum over all tokens divided by the number of
      valid tokens in the optimizer step.
    - ``seq-mean-token-sum``: sum over each sample's tokens, averaged over samples.
    - ``seq-mean-token-sum-norm`` (Dr.GRPO, Liu et al., 2025): the token sum divided by a constant,
      ``max_response_len``, so no sample's tokens are weighted by its own length; averaged over
      samples.
    """
    mask = mask.to(values.dtype)
    if mode == "seq-mean-token-mean":
        per_sample = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_sample.sum() / max(global_num_samples, 1)
    if mode == "token-mean":
        return (values * mask).sum() / max(global_num_tokens, 1)
    if mode == "seq-mean-token-sum":
        return (values * mask).sum() / max(global_num_samples, 1)
    if mode == "seq-mean-token-sum-norm":
        if not max_response_len:
            raise ValueError("seq-mean-token-sum-norm needs max_response_len")
        return (values * mask).sum() / (max(global_num_samples, 1) * max_response_len)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def denominator_kind(mode: LossAggregation) -> str:
    """What the loss of ``mode`` divides by: the step's loss tokens (``token-mean``) or its samples (the others)."""
    return "tokens" if mode == "token-mean" else "samples"


# Metrics of the loss functions (and the trainer's auxiliary loss) that do not divide by the aggregation's count:
# counts summed over micro-batches and ranks, and per-sample shares whatever the aggregation.
COUNT_METRICS = frozenset({"log_ratio_clamped_tokens"})
PER_SAMPLE_METRICS = frozenset({"m2po_eps_low", "m2po_eps_high", "ppo_kl_m2_before", "ppo_kl_m2_after",
                                "moe_aux_loss"})


@dataclass(frozen=True)
class StepCounts:
    """The global counts of an optimizer step that the loss divides by."""

    samples: int
    tokens: int


@dataclass(frozen=True)
class Rescale:
    """From a step accumulated with provisional counts to the step over its final counts.

    A step trained while its data still arrives (streamed) divides by counts guessed up front; every loss term and
    metric is linear in ``1 / count``, so multiplying by ``provisional / final`` afterwards gives exactly the values
    the whole batch would have given. ``loss_kind`` is the count the loss itself divides by.
    """

    provisional: StepCounts
    final: StepCounts
    loss_kind: str

    def of(self, kind: str) -> float:
        return max(getattr(self.provisional, kind), 1) / max(getattr(self.final, kind), 1)

    @property
    def gradients(self) -> float:
        return self.of(self.loss_kind)

    def metric(self, name: str) -> float:
        if name in COUNT_METRICS:
            return 1.0
        return self.of("samples" if name in PER_SAMPLE_METRICS else self.loss_kind)
