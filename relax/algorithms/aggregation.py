"""Reduce per-token values to one loss so that gradient accumulation over micro-batches is exact.

Each micro-batch returns its share of the global mean: the denominators are global (over the
whole optimizer step), so summing micro-batch losses gives the loss of the full batch.
"""

from __future__ import annotations

from typing import Literal

import torch

LossAggregation = Literal["seq-mean-token-mean", "token-mean"]


def aggregate_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggregation,
    global_num_samples: int,
    global_num_tokens: int,
) -> torch.Tensor:
    """Aggregate ``values`` ``[B, T]`` under ``mask`` ``[B, T]`` (1 = counted).

    - ``seq-mean-token-mean`` (upstream default): mean over each sample's tokens, then the sum over
      samples divided by the number of samples in the optimizer step. Fully masked samples
      contribute 0.
    - ``token-mean`` (``--calculate-per-token-loss``): sum over all tokens divided by the number of
      valid tokens in the optimizer step.
    """
    mask = mask.to(values.dtype)
    if mode == "seq-mean-token-mean":
        per_sample = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_sample.sum() / max(global_num_samples, 1)
    if mode == "token-mean":
        return (values * mask).sum() / max(global_num_tokens, 1)
    raise ValueError(f"unknown loss aggregation {mode!r}")
