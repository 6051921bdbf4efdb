"""Assemble the training loss of an algorithm: policy loss, KL loss and entropy bonus.

``loss = agg(w·pg_loss) + kl_loss_coef·agg(KL(π, π_ref)) − entropy_coef·agg(H(π))
[+ opd_loss_coef·agg(KL(π, π_teacher))]``, where ``w`` are the truncated importance weights with
``--use-tis`` (1 otherwise); the critic's loss is `build_value_loss_fn`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from relax.algorithms.aggregation import LossAggregation, aggregate_loss
from relax.algorithms.distillation import opd_token_kl
from relax.algorithms.gae import compute_value_loss
from relax.algorithms.kl import compute_approx_kl
from relax.algorithms.preference import PREFERENCE_FIELDS
from relax.algorithms.policy_loss import (
    POLICY_LOSSES,
    PolicyLoss,
    PolicyLossSettings,
    PolicyLossTerms,
    compute_tis_weights,
)


@dataclass
class MicroBatchTensors:
    """What a loss function sees of one micro-batch. Per-token tensors are ``[B, T]`` over
    response tokens (right-padded); ``mask`` is 1 on tokens that enter the loss. The global counts
    cover the whole optimizer step (all micro-batches, all data-parallel ranks)."""

    mask: torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    global_num_samples: int = 1
    global_num_tokens: int = 1


# (micro-batch, per-token model output [B,T], entropy [B,T] or None) -> (loss, metrics). The model
# output is the policy's log-probs (the critic's values for a value loss); loss and metrics are
# this micro-batch's share of the step's mean, so summing over micro-batches yields the step's value.
LossFn = Callable[[MicroBatchTensors, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def build_policy_loss_fn(settings: PolicyLossSettings, custom: PolicyLoss | None = None) -> LossFn:
    """The loss function the trainer calls on each micro-batch, around the policy loss ``settings.policy_loss``
    names (`POLICY_LOSSES`), or ``custom`` (``--custom-policy-loss-function-path``) in its place.

    Fields read from the micro-batch: ``advantages`` (required), ``old_log_probs`` (when absent the
    update is on-policy and the detached current log-probs stand in, so the ratio is exactly 1),
    ``ref_log_probs`` (required with the KL loss), ``rollout_log_probs`` (required with TIS).
    """
    if custom is None and settings.policy_loss not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {settings.policy_loss!r}; known: {sorted(POLICY_LOSSES)}")
    policy_loss = custom or POLICY_LOSSES[settings.policy_loss]

    def loss_fn(mb: MicroBatchTensors, log_probs: torch.Tensor, entropy: torch.Tensor):
        def agg(values: torch.Tensor) -> torch.Tensor:
            return aggregate_loss(values, mb.mask, settings.aggregation, mb.global_num_samples, mb.global_num_tokens,
                                  settings.max_response_len)

        old_log_probs = mb.fields.get("old_log_probs", log_probs.detach())
        terms = policy_loss(settings, log_probs, old_log_probs, mb.fields["advantages"], mb.mask)
        if not isinstance(terms, PolicyLossTerms):
            raise TypeError(f"the policy loss returned {type(terms).__name__}, not PolicyLossTerms "
                            "(relax.algorithms.policy_loss)")
        token_loss = terms.loss
        metrics = {}
        if settings.use_tis:
            tis = compute_tis_weights(old_log_probs, mb.fields["rollout_log_probs"], settings.tis_clip_low,
                                      settings.tis_clip)
            token_loss = token_loss * tis.weights
            metrics["tis"] = agg(tis.weights).detach()
            metrics["tis_clipfrac"] = agg(tis.clipped).detach()
            # How far the engine's sampling distribution is from the trainer's (the mismatch TIS corrects).
            metrics["tis_mismatch_kl"] = agg(compute_approx_kl(mb.fields["rollout_log_probs"], old_log_probs, "k1"))
            metrics["tis_mismatch_k3_kl"] = agg(compute_approx_kl(mb.fields["rollout_log_probs"], old_log_probs, "k3"))
            metrics["tis_mismatch_abs"] = agg((old_log_probs - mb.fields["rollout_log_probs"]).abs())
        # The loss's own micro-batch scalars, weighted by the micro-batch's share of the step's samples so that
        # their sum over micro-batches (what the trainer logs) is the step's mean.
        share = log_probs.shape[0] / max(mb.global_num_samples, 1)
        for name, value in terms.sample_mean_metrics().items():
            metrics[name] = torch.tensor(value * share)
        pg_loss = agg(token_loss)
        loss = pg_loss
        metrics.update({
            "pg_loss": pg_loss.detach(),
            "clipfrac": agg(terms.clipped).detach(),
            "ppo_kl": agg(terms.ppo_kl).detach(),
            "entropy": agg(entropy.detach()),
            # Tokens whose log-ratio hit its numerical bound (policy_loss.MAX_TOKEN_LOG_RATIO); a count, so the
            # sum over micro-batches and ranks is the step's. Anything above 0 means the policy moved by tens of
            # nats on some token since it was sampled: a mismatch worth looking at.
            "log_ratio_clamped_tokens": (terms.ratio_clamped * mb.mask).sum().detach(),
        })
        if settings.opd_loss_coef:
            kl = opd_token_kl(settings.opd_kl_type, settings.opd_norm_mode, log_probs, mb.fields["teacher_log_probs"],
                              mb.fields.get("gathered_log_probs"), mb.fields.get("teacher_top_log_probs"))
            opd_loss = agg(kl)
            loss = loss + settings.opd_loss_coef * opd_loss
            metrics["opd_kl"] = opd_loss.detach()
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


def build_value_loss_fn(value_clip: float | None, aggregation: LossAggregation,
                        max_response_len: int | None = None) -> LossFn:
    """The critic's loss on each micro-batch: the clipped value loss of
    :func:`relax.algorithms.gae.compute_value_loss`, aggregated like the policy loss.

    Fields read: ``returns`` (GAE targets) and ``old_values`` (the values before this update, the
    centre of the clip range).
    """

    def loss_fn(mb: MicroBatchTensors, values: torch.Tensor, entropy: torch.Tensor | None):
        def agg(per_token: torch.Tensor) -> torch.Tensor:
            return aggregate_loss(per_token, mb.mask, aggregation, mb.global_num_samples, mb.global_num_tokens,
                                  max_response_len)

        per_token, clipped = compute_value_loss(values, mb.fields["old_values"], mb.fields["returns"], value_clip)
        loss = agg(per_token)
        metrics = {
            "value_loss": loss.detach(),
            "value_clipfrac": agg(clipped).detach(),
            "values": agg(values.detach()),
            "value_error": agg((values.detach() - mb.fields["returns"]).abs()),
        }
        return loss, metrics

    return loss_fn


def build_sft_loss_fn(aggregation: LossAggregation, max_response_len: int | None = None) -> LossFn:
    """Supervised fine-tuning: the negative log-likelihood of the target tokens (mask 1)."""

    def loss_fn(mb: MicroBatchTensors, log_probs: torch.Tensor, entropy: torch.Tensor | None):
        loss = aggregate_loss(-log_probs, mb.mask, aggregation, mb.global_num_samples, mb.global_num_tokens,
                              max_response_len)
        metrics = {"loss": loss.detach(), "nll": loss.detach()}
        if entropy is not None:
            metrics["entropy"] = aggregate_loss(entropy.detach(), mb.mask, aggregation, mb.global_num_samples,
                                                mb.global_num_tokens, max_response_len)
        return loss, metrics

    return loss_fn


def build_preference_loss_fn() -> LossFn:
    """DPO, IPO or SimPO on micro-batches that may hold any subset of the step's completions: the trained quantity is
    ``Σ g·s`` (``g`` the loss's derivative with respect to the completion's sequence log-prob ``s``, computed for the
    whole step beforehand; module doc of `relax.algorithms.preference`), divided by the step's pairs like every
    loss's share. The metrics are the real loss and the implicit rewards, each micro-batch's share of their mean over
    the step's pairs."""

    def loss_fn(mb: MicroBatchTensors, log_probs: torch.Tensor, entropy: torch.Tensor | None):
        sequence_log_probs = (log_probs * mb.mask.to(log_probs.dtype)).sum(dim=1)
        loss, metrics = _pairwise_surrogate(mb, sequence_log_probs)
        chosen, pairs = mb.fields["preference_is_chosen"][:, 0], max(mb.global_num_samples / 2, 1.0)
        metrics["logps_chosen"] = (sequence_log_probs.detach() * chosen).sum() / pairs
        metrics["logps_rejected"] = (sequence_log_probs.detach() * (1 - chosen)).sum() / pairs
        return loss, metrics

    return loss_fn


def build_reward_model_loss_fn() -> LossFn:
    """A reward model's Bradley-Terry loss on micro-batches holding any subset of the step's completions (as
    `build_preference_loss_fn`): a completion's score is its value at the token the ``score_position`` field marks
    (the last one that is not padding, where a sequence-classification model pools), and the trained quantity is
    ``Σ g·score``. Metrics: the loss, the scores (``rewards_*``) and the share of pairs ranked right."""

    def loss_fn(mb: MicroBatchTensors, values: torch.Tensor, entropy: torch.Tensor | None):
        return _pairwise_surrogate(mb, (values * mb.fields["score_position"].to(values.dtype)).sum(dim=1))

    return loss_fn


def _pairwise_surrogate(mb: MicroBatchTensors, per_completion_values: torch.Tensor):
    """``Σ g·v / pairs`` over the micro-batch's completions and its share of the step's pair metrics
    (`relax.algorithms.preference.PREFERENCE_FIELDS`)."""
    pairs = max(mb.global_num_samples / 2, 1.0)
    per_completion = {name: mb.fields[name][:, 0] for name in PREFERENCE_FIELDS}  # every completion has a token
    loss = (per_completion["preference_gradient"] * per_completion_values).sum() / pairs
    chosen = per_completion["preference_is_chosen"]
    metrics = {
        "loss": per_completion["preference_loss_half"].sum() / pairs,
        "rewards_chosen": (per_completion["preference_reward"] * chosen).sum() / pairs,
        "rewards_rejected": (per_completion["preference_reward"] * (1 - chosen)).sum() / pairs,
        "rewards_margin": per_completion["preference_margin_half"].sum() / pairs,
        "rewards_accuracy": per_completion["preference_accuracy_half"].sum() / pairs,
    }
    return loss, metrics
