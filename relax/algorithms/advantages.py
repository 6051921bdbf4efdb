"""Advantage estimators: pure functions from rewards to per-token advantages.

An algorithm's advantages come from three stages (`AlgorithmSpec.compute_advantages`):
a reward normalizer (per-sample, group-relative baselines), an advantage function (per-sample
values to per-token advantages) and an optional global token-level whitening.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from relax.algorithms.gae import compute_gae, ppo_token_rewards


@dataclass
class AdvantageInputs:
    """What an estimator may read of one rollout batch of ``N`` samples.

    ``rewards`` is ``[N]`` with consecutive groups of ``group_size`` (samples of one prompt).
    ``response_masks`` holds one ``[T_i]`` tensor per sample over its response tokens (1 = the
    token enters the loss). ``kl`` holds per-token KL(policy || reference) of the same lengths,
    present only when the reward carries a KL penalty (``kl_coef`` > 0). ``values`` are the
    critic's per-token values, present only for PPO.
    """

    rewards: torch.Tensor
    group_size: int
    response_masks: list[torch.Tensor]
    normalize_std: bool = True
    kl: list[torch.Tensor] | None = None
    kl_coef: float = 0.0
    gamma: float = 1.0
    lambd: float = 1.0  # GAE's λ
    values: list[torch.Tensor] | None = None  # the critic's V_t, [T_i] per sample (PPO)


# (rewards [N], group_size, normalize_std) -> per-sample normalized rewards [N]
RewardNormalizer = Callable[[torch.Tensor, int, bool], torch.Tensor]
# inputs (with normalized rewards) -> one [T_i] advantage tensor per sample
AdvantageFn = Callable[[AdvantageInputs], list[torch.Tensor]]


def check_finite_rewards(rewards: torch.Tensor) -> None:
    """Non-finite rewards would poison every advantage of their group; reject them loudly."""
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"non-finite rewards at sample positions {bad[:10]}: {rewards[bad[:10]].tolist()}")


def group_rewards(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """View a flat reward vector of consecutive groups as ``[num_groups, group_size]``."""
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.view(-1, group_size)


def _grouped(rewards: torch.Tensor, group_size: int, name: str) -> torch.Tensor:
    """``[num_groups, group_size]`` in float64: group statistics in float32 are off by an ulp (eight rewards
    of 0.7 have a float32 mean 6e-8 away from 0.7), enough to turn a group with no signal into a push."""
    if group_size < 2:
        raise ValueError(f"{name} needs at least 2 samples per prompt, got {group_size}")
    check_finite_rewards(rewards)
    return group_rewards(rewards.double(), group_size)


def _centered(grouped: torch.Tensor) -> torch.Tensor:
    """``r - mean(group)``, exactly 0 for a group whose rewards are all equal (rounding cannot leave a
    residue that the std division would blow up)."""
    constant = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(grouped), grouped - grouped.mean(dim=1, keepdim=True))


# ---- reward normalizers -------------------------------------------------------------------
def compute_grpo_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (Shao et al., 2024): ``A_i = (r_i - mean(group)) / (std(group) + eps)``, float32 ``[N]``.

    ``rewards`` is ``[N]`` with consecutive groups of ``group_size``; ``std`` is the unbiased
    sample std, as upstream. ``normalize_std=False`` gives Dr.GRPO (Liu et al., 2025), which keeps
    only the mean baseline. Groups whose rewards are all equal get exactly zero advantages (the
    statistics are taken in float64, and a constant group is zero by construction).
    """
    grouped = _grouped(rewards, group_size, "GRPO")
    centered = _centered(grouped)
    if normalize_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.flatten().float()


def group_mean_baseline(rewards: torch.Tensor, group_size: int, normalize_std: bool = True) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al., 2025): ``A_i = r_i - mean(group)`` (the mean includes r_i).

    The scale is fixed later by global token-level whitening, so ``normalize_std`` is not used.
    """
    return _centered(_grouped(rewards, group_size, "the group-mean baseline")).flatten().float()


def group_leave_one_out(rewards: torch.Tensor, group_size: int, normalize_std: bool = True) -> torch.Tensor:
    """RLOO (Ahmadian et al., 2024): ``A_i = r_i - mean_{j≠i}(r_j) = G/(G-1)·(r_i - mean(r))``.

    The baseline of each sample excludes its own reward, so the estimator stays unbiased;
    ``normalize_std`` is not used.
    """
    grouped = _grouped(rewards, group_size, "RLOO")
    return (group_size / (group_size - 1) * _centered(grouped)).flatten().float()


def raw_rewards(rewards: torch.Tensor, group_size: int, normalize_std: bool = True) -> torch.Tensor:
    """No normalization (REINFORCE++, PPO): the reward itself, checked finite."""
    check_finite_rewards(rewards)
    return rewards.float()


# ---- per-sample values -> per-token advantages ----------------------------------------------
def broadcast_advantages(inputs: AdvantageInputs) -> list[torch.Tensor]:
    """GRPO family: every response token of sample ``i`` gets ``rewards[i]`` (``[T_i]`` each)."""
    return [torch.full(mask.shape, float(r)) for r, mask in zip(inputs.rewards, inputs.response_masks)]


def reinforce_plus_plus_returns(inputs: AdvantageInputs) -> list[torch.Tensor]:
    """REINFORCE++ (Hu et al., 2025) discounted returns with the KL penalty in the reward.

    Token rewards ``r_t = -kl_coef·kl_t·mask_t``, plus the scalar reward on the last valid token;
    ``G_t = r_t + γ·G_{t'}`` over the valid tokens only, ``t'`` the next valid token (``G = 0`` past the last).
    Environment tokens (mask 0) are not actions: they are skipped, never discounted, and get 0. This is GAE
    with ``V ≡ 0`` and ``λ = 1``, so the masked-token rule is the one of
    :func:`relax.algorithms.gae.compute_gae_batch`. A sample with no valid token gets zeros.
    """
    token_rewards = ppo_token_rewards(inputs.rewards, inputs.response_masks, inputs.kl, inputs.kl_coef)
    zeros = [torch.zeros_like(r) for r in token_rewards]
    returns, _ = compute_gae(token_rewards, zeros, inputs.response_masks, inputs.gamma, 1.0)
    return returns


def gae_advantages(inputs: AdvantageInputs) -> list[torch.Tensor]:
    """PPO (Schulman et al., 2017): GAE over the critic's values with the KL-shaped token rewards
    (:func:`relax.algorithms.gae.compute_gae_batch` holds the formula and the masked-token rule)."""
    if inputs.values is None:
        raise ValueError("GAE needs the critic's values")
    token_rewards = ppo_token_rewards(inputs.rewards, inputs.response_masks, inputs.kl, inputs.kl_coef)
    advantages, _ = compute_gae(token_rewards, inputs.values, inputs.response_masks, inputs.gamma, inputs.lambd)
    return advantages


def whiten_over_valid_tokens(
    advantages: list[torch.Tensor], masks: list[torch.Tensor], var_floor: float = 1e-8
) -> list[torch.Tensor]:
    """Global token-level whitening (REINFORCE++): ``(A - μ) / sqrt(max(σ², 1e-8))``.

    ``μ`` and ``σ²`` (population variance) are taken over the valid tokens of the whole batch;
    masked tokens are set to 0, so a fully masked sequence contributes nothing.
    """
    valid = [a[m.bool()] for a, m in zip(advantages, masks)]
    flat = torch.cat(valid) if valid else torch.zeros(0)
    if flat.numel() == 0:
        return [torch.zeros_like(a) for a in advantages]
    mean = flat.mean()
    scale = flat.var(unbiased=False).clamp(min=var_floor).rsqrt()
    return [torch.where(m.bool(), (a - mean) * scale, torch.zeros_like(a)) for a, m in zip(advantages, masks)]
