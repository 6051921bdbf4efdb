"""The Advantages role: rewards → per-token advantages through the algorithm's spec."""

from __future__ import annotations

import torch

from relax.algorithms.spec import AlgorithmSpec
from relax.components.rollout import scalar_reward
from relax.data.sample import Sample


class Advantages:
    def __init__(self, spec: AlgorithmSpec, group_size: int, normalize_std: bool):
        self.spec = spec
        self.group_size = group_size
        self.normalize_std = normalize_std

    async def compute(self, samples: list[Sample]) -> tuple[list[torch.Tensor], dict[str, float]]:
        """One advantage per response token of each sample (the sample's value, broadcast)."""
        rewards = torch.tensor([scalar_reward(s) for s in samples], dtype=torch.float32)
        per_sample = self.spec.advantage_fn(rewards, self.group_size, self.normalize_std)
        per_token = [torch.full((s.response_length,), float(a)) for s, a in zip(samples, per_sample)]
        metrics = {"train/advantage_abs_mean": float(per_sample.abs().mean())}
        return per_token, metrics
