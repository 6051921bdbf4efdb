"""Assemble the training loss of an algorithm: policy loss, KL loss and entropy bonus.

``loss = agg(pg_loss) + kl_loss_coef·agg(KL(π, π_ref)) − entropy_coef·agg(H(π))``
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from relax.algorithms.aggregation import LossAggregation, aggregate_loss
from relax.algorithms.kl import compute_approx_kl
from relax.algorithms.policy_loss import compute_ppo_clip_loss


@dataclass
class MicroBatchTensors:
    """What a loss function sees of one micro-batch. Per-token tensors are ``[B, T]`` over
    response tokens (right-padded); ``mask`` is 1 on tokens that enter the loss. The global counts
    cover the whole optimizer step (all micro-batches, all data-parallel ranks)."""

    mask: torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    global_num_samples: int = 1
    global_num_tokens: int = 1


# (micro-batch, log_probs [B,T], entropy [B,T]) -> (loss, metrics); both are this micro-batch's
# share of the step's mean, so summing over micro-batches yields the step's value.
LossFn = Callable[[MicroBatchTensors, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class PolicyLossSettings:
    policy_loss: str
    eps_clip: float
    eps_clip_high: float
    eps_clip_c: float | None
    aggregation: LossAggregation
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k1"
    entropy_coef: float = 0.0
    use_kl_loss: bool = False


POLICY_LOSSES = ("ppo_clip",)


def build_policy_loss_fn(settings: PolicyLossSettings) -> LossFn:
    """The loss function the trainer calls on each micro-batch.

    Fields read from the micro-batch: ``advantages`` (required), ``old_log_probs`` (when absent the
    update is on-policy and the detached current log-probs stand in, so the ratio is exactly 1),
    ``ref_log_probs`` (required with the KL loss).
    """
    if settings.policy_loss not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {settings.policy_loss!r}; known: {POLICY_LOSSES}")

    def loss_fn(mb: MicroBatchTensors, log_probs: torch.Tensor, entropy: torch.Tensor):
        def agg(values: torch.Tensor) -> torch.Tensor:
            return aggregate_loss(values, mb.mask, settings.aggregation, mb.global_num_samples, mb.global_num_tokens)

        old_log_probs = mb.fields.get("old_log_probs", log_probs.detach())
        terms = compute_ppo_clip_loss(
            log_probs, old_log_probs, mb.fields["advantages"],
            settings.eps_clip, settings.eps_clip_high, settings.eps_clip_c,
        )
        pg_loss = agg(terms.loss)
        loss = pg_loss
        metrics = {
            "pg_loss": pg_loss.detach(),
            "clipfrac": agg(terms.clipped).detach(),
            "ppo_kl": agg(terms.ppo_kl).detach(),
            "entropy": agg(entropy.detach()),
        }
        if settings.use_kl_loss:
            kl = compute_approx_kl(log_probs, mb.fields["ref_log_probs"], settings.kl_loss_type)
            kl_loss = agg(kl)
            loss = loss + settings.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
        if settings.entropy_coef:
            loss = loss - settings.entropy_coef * agg(entropy)
        metrics["loss"] = loss.detach()
        return loss, metrics

    return loss_fn
