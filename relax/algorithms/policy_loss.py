"""Policy-gradient losses per token. Every tensor is ``[B, T]`` over response tokens."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from relax.algorithms.aggregation import LossAggregation

# Bounds on the log importance ratio before it is exponentiated. One token whose log-prob moved by 25 nats (a
# near-zero probability under the old policy) would otherwise give exp(25)·|A| = 7e10 of loss, and 100 nats an
# infinity that poisons the whole step. The token ratio is clamped as verl does (±20); GSPO's sequence ratio, a mean
# over the sequence, tighter (±10), as verl's GSPO. A clamped token passes no gradient through the ratio.
MAX_TOKEN_LOG_RATIO = 20.0
MAX_SEQUENCE_LOG_RATIO = 10.0


@dataclass
class PolicyLossTerms:
    """Per-token pieces of a policy loss, all ``[B, T]``: the loss, whether the clipped branch was
    active, the policy's drift from the sampling policy (``old - new`` log-prob, unclamped), and
    whether the log-ratio hit its numerical bound (:data:`MAX_TOKEN_LOG_RATIO`)."""

    loss: torch.Tensor
    clipped: torch.Tensor
    ppo_kl: torch.Tensor
    ratio_clamped: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.ratio_clamped is None:
            self.ratio_clamped = torch.zeros_like(self.loss)

    def sample_mean_metrics(self) -> dict[str, float]:
        """A loss's own scalars of this micro-batch (M2PO's adaptive band, say), logged as their mean over the
        step's samples. None by default."""
        return {}


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
    max_response_len: int | None = None  # the constant of seq-mean-token-sum-norm
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    m2po_kl2_budget: float = 0.01
    m2po_miniclip_low: float = 0.3
    m2po_miniclip_high: float = 0.5
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    opd_loss_coef: float = 0.0  # on-policy distillation in loss mode (relax.algorithms.distillation)
    opd_kl_type: str = "reverse_kl"
    opd_norm_mode: str = "tail"


# (settings, log_probs, old_log_probs, advantages, mask) -> per-token terms, all [B, T]
PolicyLoss = Callable[[PolicyLossSettings, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], PolicyLossTerms]

# The policy losses by name (`AlgorithmSpec.policy_loss`), each registered beside its definition below.
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def registered_as(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register a policy loss under ``name``."""
    def register(loss: PolicyLoss) -> PolicyLoss:
        POLICY_LOSSES[name] = loss
        return loss

    return register


def bounded_log_ratio(log_ratio: torch.Tensor, bound: float = MAX_TOKEN_LOG_RATIO) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_ratio`` clamped to ``[-bound, bound]`` (NaN stays NaN: it is a bug upstream of the loss, not an
    outlier), and a float 0/1 tensor marking the clamped entries."""
    clamped = log_ratio.clamp(-bound, bound)
    return clamped, (log_ratio.abs() > bound).to(log_ratio.dtype)


def compute_ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> PolicyLossTerms:
    """PPO-clip (Schulman et al., 2017) with asymmetric range (DAPO clip-higher) and dual-clip.

    ``ratio = exp(clamp(log_probs - old_log_probs, ±20))``;
    ``loss = max(-ratio·A, -clip(ratio, 1 - eps_clip, 1 + eps_clip_high)·A)``;
    with dual-clip (Ye et al., 2020), tokens with ``A < 0`` are further bounded:
    ``loss = min(loss, -eps_clip_c·A)``.
    """
    ppo_kl = old_log_probs - log_probs
    log_ratio, ratio_clamped = bounded_log_ratio(-ppo_kl)
    loss, clipped = _ppo_clip(torch.exp(log_ratio), advantages, eps_clip, eps_clip_high, eps_clip_c)
    return PolicyLossTerms(loss=loss, clipped=clipped, ppo_kl=ppo_kl, ratio_clamped=ratio_clamped)



@registered_as("ppo_clip")
def _ppo_clip_policy_loss(s: PolicyLossSettings, lp, old, adv, mask) -> PolicyLossTerms:
    return compute_ppo_clip_loss(lp, old, adv, s.eps_clip, s.eps_clip_high, s.eps_clip_c)


def _ppo_clip(ratio: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float,
              eps_clip_c: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip's per-token loss and clipped indicator for a given (token or sequence) ratio."""
    unclipped = -ratio * advantages
    clipped_branch = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped_branch)
    clipped = clipped_branch > unclipped
    if eps_clip_c is not None:
        dual_bound = -eps_clip_c * advantages
        dual_active = (advantages < 0) & (loss > dual_bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, dual_bound), loss)
        clipped = clipped | dual_active
    return loss, clipped.float()


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
    ``s_i = exp(clamp(mean_t(log π - log π_old), ±10))``, the same for every token of sequence ``i``."""
    seq_ppo_kl = sequence_mean_ppo_kl(log_probs, old_log_probs, mask)
    seq_log_ratio, ratio_clamped = bounded_log_ratio(-seq_ppo_kl, MAX_SEQUENCE_LOG_RATIO)
    loss, clipped = _ppo_clip(torch.exp(seq_log_ratio), advantages, eps_clip, eps_clip_high, None)
    return PolicyLossTerms(loss=loss, clipped=clipped, ppo_kl=seq_ppo_kl, ratio_clamped=ratio_clamped)



@registered_as("gspo")
def _gspo_policy_loss(s: PolicyLossSettings, lp, old, adv, mask) -> PolicyLossTerms:
    return compute_gspo_loss(lp, old, adv, mask, s.eps_clip, s.eps_clip_high)


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
    log_ratio, ratio_clamped = bounded_log_ratio(-ppo_kl)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    p = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * p * advantages
    return PolicyLossTerms(loss=loss, clipped=(4 * p * (1 - p) < 0.9).float(), ppo_kl=ppo_kl,
                           ratio_clamped=ratio_clamped)



@registered_as("sapo")
def _sapo_policy_loss(s: PolicyLossSettings, lp, old, adv, mask) -> PolicyLossTerms:
    return compute_sapo_loss(lp, old, adv, s.sapo_tau_pos, s.sapo_tau_neg)


def compute_cispo_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, eps_clip: float,
    eps_clip_high: float,
) -> PolicyLossTerms:
    """CISPO (MiniMax-M1, 2025, eq. 4-5): clip the importance weight, never the gradient.

    ``coef = clip(r, 1 - eps_clip, 1 + eps_clip_high)`` for every token, whatever the sign of ``A``;
    ``loss = -sg(coef)·sg(A)·log π``, so every token keeps a gradient ``-coef·A`` on its log-prob.
    Upstream bounds the weight on one side only (``min(r, 1+eps_high)`` for A ≥ 0, ``max(r, 1-eps)``
    for A < 0), which leaves a negative-advantage token with a large ratio an unbounded weight.
    """
    ppo_kl = old_log_probs - log_probs
    log_ratio, ratio_clamped = bounded_log_ratio(-ppo_kl.detach())
    ratio = torch.exp(log_ratio)
    coef = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = -coef * advantages.detach() * log_probs
    return PolicyLossTerms(loss=loss, clipped=(coef != ratio).float(), ppo_kl=ppo_kl, ratio_clamped=ratio_clamped)



@registered_as("cispo")
def _cispo_policy_loss(s: PolicyLossSettings, lp, old, adv, mask) -> PolicyLossTerms:
    return compute_cispo_loss(lp, old, adv, s.eps_clip, s.eps_clip_high)


def compute_rloo_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor
) -> PolicyLossTerms:
    """RLOO (Ahmadian et al., 2024): unclipped REINFORCE, ``loss = -sg(A)·log π``; clipfrac ≡ 0."""
    return PolicyLossTerms(
        loss=-advantages.detach() * log_probs, clipped=torch.zeros_like(log_probs), ppo_kl=old_log_probs - log_probs
    )



@registered_as("rloo")
def _rloo_policy_loss(s: PolicyLossSettings, lp, old, adv, mask) -> PolicyLossTerms:
    return compute_rloo_loss(lp, old, adv)


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

    def sample_mean_metrics(self) -> dict[str, float]:
        return {"m2po_eps_low": self.eps_low, "m2po_eps_high": self.eps_high, "ppo_kl_m2_before": self.m2_before,
                "ppo_kl_m2_after": self.m2_after}


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
    ratio = torch.exp(-ppo_kl.clamp(-MAX_TOKEN_LOG_RATIO, MAX_TOKEN_LOG_RATIO))
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
    return M2POTerms(loss=terms.loss, clipped=terms.clipped, ppo_kl=terms.ppo_kl, ratio_clamped=terms.ratio_clamped,
                     eps_low=eps_low, eps_high=eps_high, m2_before=m2_before, m2_after=m2_after)



@registered_as("m2po")
def _m2po_policy_loss(s: PolicyLossSettings, lp, old, adv, mask) -> PolicyLossTerms:
    return compute_m2po_loss(lp, old, adv, mask, s.m2po_kl2_budget, s.m2po_miniclip_low, s.m2po_miniclip_high)


@dataclass
class TISWeights:
    """Truncated importance weights ``[B, T]`` (detached) and whether each was truncated."""

    weights: torch.Tensor
    clipped: torch.Tensor


def compute_tis_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, clip_low: float, clip_high: float
) -> TISWeights:
    """Truncated importance sampling (Yao et al., 2025) for the engine/trainer mismatch:
    ``w = clamp(exp(old_logp - rollout_logp), clip_low, clip_high)``, detached (the log-ratio bounded
    by :data:`MAX_TOKEN_LOG_RATIO` first, so an extreme token gives ``clip_high``, never inf·0)."""
    log_ratio, _ = bounded_log_ratio(old_log_probs.detach() - rollout_log_probs)
    raw = torch.exp(log_ratio)
    weights = raw.clamp(clip_low, clip_high)
    return TISWeights(weights=weights, clipped=(weights != raw).float())
