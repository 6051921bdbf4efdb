"""On-policy distillation (OPD): per-token divergences between the student and a teacher on the
student's own samples (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning
from Self-Generated Mistakes", arXiv 2306.13649; Thinking Machines 2025, "On-Policy Distillation").

All tensors are ``[B, T]`` (or ``[B, T, k]`` for top-k tensors) over response tokens; every
function is elementwise over tokens, so masking and aggregation stay with the caller.

- ``reverse_kl``: ``log p_s(y_t) − log p_t(y_t)`` on the sampled token ``y_t ~ p_s``: the k1
  estimator of KL(student || teacher), unbiased because the tokens come from the student.
- ``low_var_kl``: the k3 estimator ``exp(log p_t − log p_s) − 1 − (log p_t − log p_s)`` of the
  same KL, non-negative and lower-variance, clamped to [−10, 10].
- ``forward_kl``: KL(teacher || student) over the teacher's top-k tokens ``S_t`` at position t:
  ``Σ_{v∈S_t} p_t(v)·(log p_t(v) − log p_s(v))``, completed per ``norm_mode``:
  ``trunc`` stops there; ``norm`` renormalises both distributions over ``S_t`` first; ``tail``
  adds one bucket for everything outside ``S_t`` (mass ``1 − Σ p``), which makes it the exact KL
  between the two distributions coarsened to k+1 outcomes (so it is ≥ 0 and ≤ the full KL).
"""

from __future__ import annotations

import torch

from relax.algorithms.kl import compute_approx_kl

OPD_KL_TYPES = ("reverse_kl", "low_var_kl", "forward_kl")
_TAIL_FLOOR = 1e-12  # a tail of zero mass would give log(0); it contributes 0·log(...) = 0 anyway


def sampled_token_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """reverse_kl (k1) or low_var_kl (k3, clamped) of the student against the teacher, per token."""
    if kl_type == "reverse_kl":
        return compute_approx_kl(student_log_probs, teacher_log_probs, "k1")
    if kl_type == "low_var_kl":
        return compute_approx_kl(student_log_probs, teacher_log_probs, "low_var_kl")
    raise ValueError(f"{kl_type!r} is not a sampled-token divergence; expected reverse_kl or low_var_kl")


def top_k_forward_kl(student_top_log_probs: torch.Tensor, teacher_top_log_probs: torch.Tensor,
                     norm_mode: str) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top-k tokens, ``[..., k]`` log-probs of the same
    token ids under each model → ``[...]``."""
    student = student_top_log_probs.float()
    teacher = teacher_top_log_probs.float()
    if norm_mode == "norm":
        student = student - student.logsumexp(dim=-1, keepdim=True)
        teacher = teacher - teacher.logsumexp(dim=-1, keepdim=True)
    kl = (teacher.exp() * (teacher - student)).sum(dim=-1)
    if norm_mode == "tail":
        teacher_tail = (1 - teacher.exp().sum(dim=-1)).clamp(min=_TAIL_FLOOR)
        student_tail = (1 - student.exp().sum(dim=-1)).clamp(min=_TAIL_FLOOR)
        kl = kl + teacher_tail * (teacher_tail.log() - student_tail.log())
    elif norm_mode not in ("norm", "trunc"):
        raise ValueError(f"unknown OPD norm mode {norm_mode!r}; expected tail, norm or trunc")
    return kl


def opd_token_kl(kl_type: str, norm_mode: str, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                 student_top_log_probs: torch.Tensor | None = None,
                 teacher_top_log_probs: torch.Tensor | None = None) -> torch.Tensor:
    """The divergence of ``kl_type`` per token; forward_kl needs the top-k tensors."""
    if kl_type == "forward_kl":
        if student_top_log_probs is None or teacher_top_log_probs is None:
            raise ValueError("forward_kl needs the teacher's top-k log-probs and the student's at the same ids")
        return top_k_forward_kl(student_top_log_probs, teacher_top_log_probs, norm_mode)
    return sampled_token_kl(student_log_probs, teacher_log_probs, kl_type)


def penalize_advantages(advantages: torch.Tensor, kl: torch.Tensor, coef: float) -> torch.Tensor:
    """Advantage mode: ``A_t − coef·KL_t``, the KL detached (it is a reward, not a loss)."""
    return advantages - coef * kl.detach()
