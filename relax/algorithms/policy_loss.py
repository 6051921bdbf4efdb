"""Policy-gradient losses per token. Every tensor is ``[B, T]`` over response tokens."""

from __future__ import annotations

import math
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


def sequence_mean_ppo_kl(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level drift: ``mean_t(old - new)`` over each row's masked tokens, ``[B, T]``
    (broadcast back to every token). Fully masked rows get 0."""
    mask = mask.to(log_probs.dtype)
    per_seq = ((old_log_probs - log_probs) * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    return per_seq.expand_as(log_probs)


def compute_gspo_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    eps_clip: float, eps_clip_high: float,
) -> PolicyLossTerms:
    """GSPO (Zheng et al., 2025): PPO-clip on the sequence-level ratio
    ``s_i = exp(mean_t(log π - log π_old))``, the same for every token of sequence ``i``."""
    seq_log_ratio = -sequence_mean_ppo_kl(log_probs, old_log_probs, mask)
    # compute_ppo_clip_loss takes (new, old); a zero "old" makes its log-ratio the sequence one.
    return compute_ppo_clip_loss(seq_log_ratio, torch.zeros_like(seq_log_ratio), advantages, eps_clip, eps_clip_high)


def compute_sapo_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float
) -> PolicyLossTerms:
    """SAPO: a soft gate instead of a hard clip, ``loss = -f(r)·A`` with
    ``f(r) = (4/τ)·σ(τ(r - 1))``, ``τ = tau_pos`` if ``A > 0`` else ``tau_neg``.

    ``f'(1) = 1``, so on-policy the gradient equals the plain policy gradient; it decays smoothly
    as ``r`` leaves 1. ``clipped`` is the proxy ``4p(1-p) < 0.9`` with ``p = σ(τ(r-1))``
    (the gate's slope has fallen below 0.9).
    """
    ppo_kl = old_log_probs - log_probs
    ratio = torch.exp(-ppo_kl)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    p = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * p * advantages
    return PolicyLossTerms(loss=loss, clipped=(4 * p * (1 - p) < 0.9).float(), ppo_kl=ppo_kl)


def compute_cispo_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, eps_clip: float,
    eps_clip_high: float,
) -> PolicyLossTerms:
    """CISPO (MiniMax-M1, 2025): clip the importance weight, never the gradient.

    ``coef = min(r, 1 + eps_high)`` if ``A ≥ 0`` else ``max(r, 1 - eps)``;
    ``loss = -sg(coef)·sg(A)·log π``, so every token keeps a gradient ``-coef·A`` on its log-prob.
    """
    ppo_kl = old_log_probs - log_probs
    ratio = torch.exp(-ppo_kl).detach()
    coef = torch.where(advantages >= 0, ratio.clamp(max=1.0 + eps_clip_high), ratio.clamp(min=1.0 - eps_clip))
    loss = -coef * advantages.detach() * log_probs
    return PolicyLossTerms(loss=loss, clipped=(coef != ratio).float(), ppo_kl=ppo_kl)


def compute_rloo_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor
) -> PolicyLossTerms:
    """RLOO (Ahmadian et al., 2024): unclipped REINFORCE, ``loss = -sg(A)·log π``; clipfrac ≡ 0."""
    return PolicyLossTerms(
        loss=-advantages.detach() * log_probs, clipped=torch.zeros_like(log_probs), ppo_kl=old_log_probs - log_probs
    )


def water_fill_cap(values: torch.Tensor, total: float) -> float:
    """The cap ``c`` with ``Σ min(v, c) = total`` for non-negative ``values`` whose sum exceeds ``total``.

    Sorted ascending, the ``k`` smallest stay whole and the rest are capped:
    ``c = (total - Σ_{i<k} v_i) / (n - k)``, for the first ``k`` with ``c ≤ v_k``.
    """
    sorted_values = values.double().sort().values
    prefix = 0.0
    n = sorted_values.numel()
    for k in range(n):
        cap = (total - prefix) / (n - k)
        if cap <= sorted_values[k].item():
            return cap
        prefix += sorted_values[k].item()
    return sorted_values[-1].item()


@dataclass
class M2POTerms(PolicyLossTerms):
    """M2PO's terms plus its adaptive band and the second moment of harmful tokens' drift."""

    eps_low: float = 0.0
    eps_high: float = 0.0
    m2_before: float = 0.0
    m2_after: float = 0.0


def compute_m2po_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    kl2_budget: float, miniclip_low: float, miniclip_high: float,
) -> M2POTerms:
    """M2PO: PPO-clip with a band sized so the harmful tokens' drift respects a second-moment budget.

    Harmful tokens ``H = (A>0 & r>1) | (A<0 & r<1)`` (valid tokens only). With
    ``M2 = mean_H(ppo_kl²)``: if ``M2 ≤ budget``, ``τ = max_H |ppo_kl|`` (nothing is clipped);
    otherwise the cap ``τ²`` is water-filled so that ``Σ_H min(ppo_kl², τ²) = budget·|H|``, and the band is
    ``eps_low = max(1 - e^{-τ}, miniclip_low)``, ``eps_high = max(e^{τ} - 1, miniclip_high)``.
    Upstream takes the statistic over every token of the micro-batch; here padding is excluded.
    """
    ppo_kl = (old_log_probs - log_probs).detach()
    ratio = torch.exp(-ppo_kl)
    harmful = (((advantages > 0) & (ratio > 1)) | ((advantages < 0) & (ratio < 1))) & mask.bool()
    delta_sq = ppo_kl[harmful].square()
    m2_before = float(delta_sq.mean()) if delta_sq.numel() else 0.0
    if m2_before <= kl2_budget:
        # Within budget: the band just covers every harmful token (PPO-clip only ever binds on
        # harmful tokens, so nothing is clipped), and stays finite for logging.
        cap = float(delta_sq.max()) if delta_sq.numel() else 0.0
    else:
        cap = water_fill_cap(delta_sq, kl2_budget * delta_sq.numel())
    tau = cap**0.5
    eps_low = max(1.0 - math.exp(-tau), miniclip_low)
    eps_high = max(math.exp(tau) - 1.0, miniclip_high)
    m2_after = float(delta_sq.clamp(max=cap).mean()) if delta_sq.numel() else 0.0
    terms = compute_ppo_clip_loss(log_probs, old_log_probs, advantages, eps_low, eps_high)
    return M2POTerms(loss=terms.loss, clipped=terms.clipped, ppo_kl=terms.ppo_kl, eps_low=eps_low, eps_high=eps_high,
                     m2_before=m2_before, m2_after=m2_after)


@dataclass
class TISWeights:
    """Truncated importance weights ``[B, T]`` (detached) and whether each was truncated."""

    weights: torch.Tensor
    clipped: torch.Tensor


def compute_tis_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, clip_low: float, clip_high: float
) -> TISWeights:
    """Truncated importance sampling (Yao et al., 2025) for the engine/trainer mismatch:
    ``w = clamp(exp(old_logp - rollout_logp), clip_low, clip_high)``, detached."""
    raw = torch.exp(old_log_probs.detach() - rollout_log_probs)
    weights = raw.clamp(clip_low, clip_high)
    return TISWeights(weights=weights, clipped=(weights != raw).float())
