"""KL estimators between the policy and a reference, per token (Schulman, "Approximating KL divergence")."""

from __future__ import annotations

import torch

from relax.algorithms.policy_loss import MAX_TOKEN_LOG_RATIO


def compute_approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs.

    With ``log_ratio = log_probs - ref_log_probs``:
    k1 = log_ratio; k2 = log_ratio² / 2; k3 = exp(-log_ratio) - 1 + log_ratio (log_ratio clamped to ±20);
    ``low_var_kl`` is k3 clamped to [-10, 10] (upstream's name for the stabilised k3).
    Shapes are preserved.
    """
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return log_ratio.square() / 2
    if kl_type in ("k3", "low_var_kl"):
        # exp(-x) - 1 + x, written with expm1 to stay exact for small x; x bounded first (as the policy ratio,
        # relax.algorithms.policy_loss.MAX_TOKEN_LOG_RATIO) so one extreme token gives a large finite value.
        log_ratio = log_ratio.clamp(-MAX_TOKEN_LOG_RATIO, MAX_TOKEN_LOG_RATIO)
        kl = torch.expm1(-log_ratio) + log_ratio
        return kl.clamp(-10.0, 10.0) if kl_type == "low_var_kl" else kl
    raise ValueError(f"unknown KL estimator {kl_type!r}; expected k1, k2, k3 or low_var_kl")
