"""The Advantages role: rewards → per-token advantages through the algorithm's spec."""

from __future__ import annotations

import torch

from relax.algorithms.advantages import AdvantageInputs
from relax.algorithms.kl import compute_approx_kl
from relax.algorithms.spec import AlgorithmSpec
from relax.components.rollout import scalar_reward
from relax.data.sample import Sample


class Advantages:
    def __init__(self, spec: AlgorithmSpec, group_size: int, normalize_std: bool, kl_coef: float = 0.0,
                 gamma: float = 1.0):
        self.spec = spec
        self.group_size = group_size
        self.normalize_std = normalize_std
        self.kl_coef = kl_coef
        self.gamma = gamma

    @property
    def needs_kl(self) -> bool:
        """Whether `compute` needs the policy's and the reference's log-probs (KL in the reward)."""
        return self.spec.uses_reward_kl and self.kl_coef > 0

    async def compute(
        self,
        samples: list[Sample],
        log_probs: list[torch.Tensor] | None = None,
        ref_log_probs: list[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], dict[str, float]]:
        """One advantage per response token of each sample. With a KL in the reward, ``log_probs``
        (the sampling policy's) and ``ref_log_probs`` give the per-token k1 KL."""
        masks = [torch.tensor(s.loss_mask if s.loss_mask is not None else [1] * s.response_length) for s in samples]
        kl = None
        if self.needs_kl:
            kl = [compute_approx_kl(lp, ref, "k1") for lp, ref in zip(log_probs, ref_log_probs)]
        inputs = AdvantageInputs(
            rewards=torch.tensor([scalar_reward(s) for s in samples], dtype=torch.float32),
            group_size=self.group_size, response_masks=masks, normalize_std=self.normalize_std,
            kl=kl, kl_coef=self.kl_coef, gamma=self.gamma,
        )
        per_token = self.spec.compute_advantages(inputs)
        per_sample = [(a.abs() * m).sum() / m.sum().clamp(min=1) for a, m in zip(per_token, masks)]
        metrics = {"train/advantage_abs_mean": float(torch.stack(per_sample).mean())}
        return per_token, metrics
