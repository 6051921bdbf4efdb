"""The Advantages role: rewards → per-token advantages through the algorithm's spec."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax.algorithms.advantages import AdvantageInputs
from relax.algorithms.kl import compute_approx_kl
from relax.algorithms.spec import AlgorithmSpec
from relax.components.rollout import scalar_reward
from relax.data.sample import Sample


@dataclass
class AdvantageResult:
    advantages: list[torch.Tensor]  # [T_i] per sample
    returns: list[torch.Tensor] | None  # the critic's targets (PPO), [T_i] per sample
    metrics: dict[str, float]


class Advantages:
    def __init__(self, spec: AlgorithmSpec, group_size: int, normalize_std: bool, kl_coef: float = 0.0,
                 gamma: float = 1.0, lambd: float = 1.0):
        self.spec = spec
        self.group_size = group_size
        self.normalize_std = normalize_std
        self.kl_coef = kl_coef
        self.gamma = gamma
        self.lambd = lambd

    @property
    def needs_kl(self) -> bool:
        """Whether `compute` needs the policy's and the reference's log-probs (KL in the reward)."""
        return self.spec.uses_reward_kl and self.kl_coef > 0

    async def compute(
        self,
        samples: list[Sample],
        log_probs: list[torch.Tensor] | None = None,
        ref_log_probs: list[torch.Tensor] | None = None,
        values: list[torch.Tensor] | None = None,
    ) -> AdvantageResult:
        """One advantage per response token of each sample. With a KL in the reward, ``log_probs``
        (the sampling policy's) and ``ref_log_probs`` give the per-token k1 KL; PPO needs the
        critic's ``values``."""
        masks = _response_masks(samples)
        kl = None
        if self.needs_kl:
            kl = [compute_approx_kl(lp, ref, "k1") for lp, ref in zip(log_probs, ref_log_probs)]
        inputs = AdvantageInputs(
            rewards=torch.tensor([scalar_reward(s) for s in samples], dtype=torch.float32),
            group_size=self.group_size, response_masks=masks, normalize_std=self.normalize_std,
            kl=kl, kl_coef=self.kl_coef, gamma=self.gamma, lambd=self.lambd, values=values,
        )
        advantages, returns = self.spec.compute_advantages_and_returns(inputs)
        metrics = self.result_of(samples, advantages, masks).metrics
        if kl is not None:
            metrics["train/reward_kl"] = _masked_mean(kl, masks)
        if returns is not None:
            metrics["critic/returns_mean"] = _masked_mean(returns, masks)
        return AdvantageResult(advantages, returns, metrics)

    def result_of(self, samples: list[Sample], advantages: list[torch.Tensor],
                  masks: list[torch.Tensor] | None = None) -> AdvantageResult:
        """The result (and its metrics) of advantages computed elsewhere: group by group as the groups arrived
        (relax.core.streaming.roles), which for group-local estimators equals computing them over the step."""
        return AdvantageResult(advantages, None, {"train/advantage_abs_mean": mean_of(
            advantage_abs_means(samples, advantages, masks))})


def advantage_abs_means(samples: list[Sample], advantages: list[torch.Tensor],
                        masks: list[torch.Tensor] | None = None) -> list[float]:
    """Each sample's mean |advantage| over its loss tokens (``train/advantage_abs_mean`` is their mean)."""
    masks = masks if masks is not None else _response_masks(samples)
    return _masked_means([a.abs() for a in advantages], masks)


def mean_of(per_sample: list[float]) -> float:
    return sum(per_sample) / len(per_sample) if per_sample else 0.0


def _response_masks(samples: list[Sample]) -> list[torch.Tensor]:
    return [torch.tensor(s.loss_mask if s.loss_mask is not None else [1] * s.response_length) for s in samples]


def _masked_means(per_token: list[torch.Tensor], masks: list[torch.Tensor]) -> list[float]:
    """Each sample's mean over its valid tokens."""
    return [float((x.float() * m).sum() / m.sum().clamp(min=1)) for x, m in zip(per_token, masks)]


def _masked_mean(per_token: list[torch.Tensor], masks: list[torch.Tensor]) -> float:
    """Mean over samples of each sample's mean over its valid tokens."""
    return mean_of(_masked_means(per_token, masks))
