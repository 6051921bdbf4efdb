"""Policy-gradient losses per token. Every tensor is ``[B, T]`` over response tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PolicyLossTerms:
    """Per-token pieces of a policy loss, all ``[B, T]``: the loss, whether the clipped branch was
    active, and the policy's drift from the sampling policy (``old - new`` log-prob)."""

    loss: torch.Tensor
    clipped: torch.Tensor
    ppo_kl: torch.Tensor


def compute_ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> PolicyLossTerms:
    """PPO-clip (Schulman et al., 2017) with asymmetric range (DAPO clip-higher) and dual-clip.

    ``ratio = exp(log_probs - old_log_probs)``;
    ``loss = max(-ratio·A, -clip(ratio, 1 - eps_clip, 1 + eps_clip_high)·A)``;
    with dual-clip (Ye et al., 2020), tokens with ``A < 0`` are further bounded:
    ``loss = min(loss, -eps_clip_c·A)``.
    """
    ppo_kl = old_log_probs - log_probs
    ratio = torch.exp(-ppo_kl)
    unclipped = -ratio * advantages
    clipped_branch = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped_branch)
    clipped = clipped_branch > unclipped
    if eps_clip_c is not None:
        dual_bound = -eps_clip_c * advantages
        dual_active = (advantages < 0) & (loss > dual_bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, dual_bound), loss)
        clipped = clipped | dual_active
    return PolicyLossTerms(loss=loss, clipped=clipped.float(), ppo_kl=ppo_kl)
