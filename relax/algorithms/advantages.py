"""Advantage estimators: pure functions from rewards to per-sample advantages."""

from __future__ import annotations

import torch


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


def compute_grpo_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (Shao et al., 2024): ``A_i = (r_i - mean(group)) / (std(group) + eps)``.

    ``rewards`` is ``[N]`` with consecutive groups of ``group_size``; ``std`` is the unbiased
    sample std, as upstream. ``normalize_std=False`` gives Dr.GRPO (Liu et al., 2025), which keeps
    only the mean baseline. Groups whose rewards are all equal get zero advantages.
    """
    if group_size < 2:
        raise ValueError(f"GRPO needs at least 2 samples per prompt, got {group_size}")
    check_finite_rewards(rewards)
    grouped = group_rewards(rewards.float(), group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.flatten()
