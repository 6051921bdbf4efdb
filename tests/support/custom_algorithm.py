"""A custom advantage function and a custom policy loss, loaded by dotted path (--custom-advantage-function-path,
--custom-policy-loss-function-path) in tests/algorithms/test_custom_algorithm.py."""

from __future__ import annotations

import torch

from relax.algorithms.advantages import AdvantageInputs
from relax.algorithms.policy_loss import PolicyLossSettings, PolicyLossTerms, compute_ppo_clip_loss


def sign_of_reward(inputs: AdvantageInputs) -> list[torch.Tensor]:
    """+0.5 on every token of a sample rewarded above the step's mean, -0.5 below (0 at the mean): it reads the
    whole step, as a custom estimator may."""
    mean = inputs.rewards.mean()
    return [0.5 * torch.sign(reward - mean) * mask.float() for reward, mask in zip(inputs.rewards, inputs.response_masks)]


def nan_advantages(inputs: AdvantageInputs) -> list[torch.Tensor]:
    """An estimator with a bug: NaN on every token."""
    return [torch.full(mask.shape, float("nan")) for mask in inputs.response_masks]


class CountedTerms(PolicyLossTerms):
    def sample_mean_metrics(self) -> dict[str, float]:
        return {"custom_loss_calls": 1.0}  # its step mean is 1: every micro-batch went through this loss


def clipped_with_a_metric(settings: PolicyLossSettings, log_probs, old_log_probs, advantages, mask) -> PolicyLossTerms:
    """PPO-clip, with a metric of its own."""
    terms = compute_ppo_clip_loss(log_probs, old_log_probs, advantages, settings.eps_clip, settings.eps_clip_high)
    return CountedTerms(terms.loss, terms.clipped, terms.ppo_kl, terms.ratio_clamped)


def not_terms(settings, log_probs, old_log_probs, advantages, mask):
    return log_probs.sum()
