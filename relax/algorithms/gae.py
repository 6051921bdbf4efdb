"""PPO's critic-side pure functions: KL-shaped token rewards, GAE and the clipped value loss.

PPO: Schulman et al., 2017, "Proximal Policy Optimization Algorithms".
GAE: Schulman et al., 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation".

Per-sample tensors are ``[T_i]`` over one sample's response tokens; batched tensors are ``[B, T]``
(padded, the padding masked out). A mask is 1 for a token the policy produced (it enters the loss)
and 0 for an environment / tool token inside a response or for padding.
"""

from __future__ import annotations

import torch


def ppo_token_rewards(
    rewards: torch.Tensor,
    masks: list[torch.Tensor],
    kl: list[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
) -> list[torch.Tensor]:
    """Token-level rewards of PPO with the KL penalty folded into the reward.

    ``rewards`` is ``[N]`` (one scalar per sample), ``masks[i]`` and ``kl[i]`` are ``[T_i]``.
    Returns one float32 ``[T_i]`` tensor per sample:

        ``r_t = -kl_coef · kl_t · mask_t``, plus ``rewards[i]`` on the last token with ``mask_t = 1``.

    Masked tokens get 0. A sample with no valid token gets all zeros (its scalar reward has no token
    to land on). ``kl=None`` or ``kl_coef=0`` gives the sparse reward alone.
    """
    if rewards.ndim != 1 or rewards.numel() != len(masks):
        raise ValueError(f"{rewards.numel()} rewards for {len(masks)} masks")
    if kl is not None and len(kl) != len(masks):
        raise ValueError(f"{len(kl)} kl tensors for {len(masks)} masks")
    out = []
    for i, mask in enumerate(masks):
        mask = mask.float()
        token_rewards = torch.zeros_like(mask)
        if kl is not None and kl_coef:
            if kl[i].shape != mask.shape:
                raise ValueError(f"sample {i}: kl shape {tuple(kl[i].shape)} != mask shape {tuple(mask.shape)}")
            token_rewards = -kl_coef * kl[i].float() * mask
        valid = mask.nonzero().flatten()
        if valid.numel():
            token_rewards[valid[-1]] += rewards[i].float()
        out.append(token_rewards)
    return out


def compute_gae_batch(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lambd: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over a padded batch, all tensors ``[B, T]``; returns ``(advantages, returns)``, ``[B, T]``.

    Over the valid tokens ``t_1 < t_2 < ... < t_n`` of a row (``mask = 1``), with ``t_{n+1}`` past
    the end and ``V_{t_{n+1}} = A_{t_{n+1}} = 0``:

        ``δ_k = r_{t_k} + γ·V_{t_{k+1}} − V_{t_k}``
        ``A_{t_k} = δ_k + γλ·A_{t_{k+1}}``
        ``R_{t_k} = A_{t_k} + V_{t_k}``

    Masked tokens are skipped by the recursion, as in verl's ``compute_gae_advantage_return``: their
    reward and value are never read, and the bootstrap value and running advantage pass through them
    unchanged. So the valid token before an environment span bootstraps from the value of the first
    valid token after it, with one factor ``γ`` (resp. ``γλ``), not one per skipped position.
    Trailing padding is the same case: the last valid token bootstraps from 0.

    Advantages and returns at masked tokens are set to 0 (verl leaves the carried-through values
    there; they enter no loss either way). A fully masked row is all zeros, never NaN.
    Computed in float32 with a reverse loop over ``T`` (vectorised over ``B``).
    """
    if not (token_rewards.shape == values.shape == mask.shape) or token_rewards.ndim != 2:
        raise ValueError(
            f"GAE needs equal [B, T] shapes, got rewards {tuple(token_rewards.shape)}, "
            f"values {tuple(values.shape)}, mask {tuple(mask.shape)}"
        )
    rewards = token_rewards.float()
    values = values.float()
    valid = mask.bool()
    batch, length = rewards.shape
    next_value = rewards.new_zeros(batch)
    next_advantage = rewards.new_zeros(batch)
    advantages = torch.zeros_like(rewards)
    for t in range(length - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lambd * next_advantage
        keep = valid[:, t]
        next_value = torch.where(keep, values[:, t], next_value)
        next_advantage = torch.where(keep, advantage, next_advantage)
        advantages[:, t] = torch.where(keep, advantage, torch.zeros_like(advantage))
    returns = torch.where(valid, advantages + values, torch.zeros_like(advantages))
    return advantages, returns


def _pad(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    out = torch.zeros(len(tensors), length)
    for i, x in enumerate(tensors):
        out[i, : x.numel()] = x.float()
    return out


def compute_gae(
    token_rewards: list[torch.Tensor],
    values: list[torch.Tensor],
    masks: list[torch.Tensor],
    gamma: float,
    lambd: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-sample GAE: ``token_rewards[i]``, ``values[i]``, ``masks[i]`` are ``[T_i]``; returns
    ``(advantages, returns)``, one float32 ``[T_i]`` tensor per sample each.

    The samples are padded to ``[B, max T_i]`` (padding masked out) and run through
    :func:`compute_gae_batch`, which holds the formula and the masked-token rule.
    """
    if not (len(token_rewards) == len(values) == len(masks)):
        raise ValueError(f"{len(token_rewards)} rewards, {len(values)} values, {len(masks)} masks")
    for i, (r, v, m) in enumerate(zip(token_rewards, values, masks)):
        if not (r.shape == v.shape == m.shape) or r.ndim != 1:
            raise ValueError(
                f"sample {i}: rewards {tuple(r.shape)}, values {tuple(v.shape)}, mask {tuple(m.shape)} "
                "must be equal [T_i]"
            )
    if not masks:
        return [], []
    lengths = [m.numel() for m in masks]
    length = max(lengths)
    advantages, returns = compute_gae_batch(
        _pad(token_rewards, length), _pad(values, length), _pad(masks, length), gamma, lambd
    )
    return (
        [advantages[i, :n] for i, n in enumerate(lengths)],
        [returns[i, :n] for i, n in enumerate(lengths)],
    )


def compute_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    value_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss per token (PPO; the form of verl and OpenAI baselines), all ``[B, T]``.

        ``V_clip = clip(V, V_old − value_clip, V_old + value_clip)``
        ``loss_t = 0.5 · max((V − R)², (V_clip − R)²)``

    The factor 0.5 IS applied (as verl does; upstream Relax/slime omit it, which doubles the
    gradient). Returns ``(loss, clipped)``: ``clipped`` is a float 0/1 indicator, 1 where the
    clipped term is strictly larger (it decided the loss, verl's ``vf_clipfrac``); its masked mean
    is the clip fraction. Mask-agnostic: the caller aggregates both under the response mask.
    ``value_clip=None`` gives the plain ``0.5·(V − R)²`` with ``clipped`` all 0.
    """
    if not (values.shape == old_values.shape == returns.shape):
        raise ValueError(
            f"value loss needs equal shapes, got values {tuple(values.shape)}, "
            f"old_values {tuple(old_values.shape)}, returns {tuple(returns.shape)}"
        )
    unclipped = (values - returns) ** 2
    if value_clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    if value_clip < 0:
        raise ValueError(f"value_clip must be >= 0, got {value_clip}")
    # clamp(V, V_old ± c), not V_old + clamp(V - V_old, ±c): inside the range the latter differs from V by a
    # rounding step, which made the clipped term "larger" on tokens that were never clipped.
    clipped_values = torch.clamp(values, old_values - value_clip, old_values + value_clip)
    clipped_term = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped_term)
    return loss, (clipped_term > unclipped).to(unclipped.dtype)
