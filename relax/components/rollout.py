"""The Rollout role: turn prompts into scored samples with the inference engine."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import replace

import torch

from relax.backends.inference.base import InferenceEngine, SamplingParams
from relax.data.sample import Sample, SampleStatus
from relax.engine.rewards.compute import RewardComputer
from relax.engine.rollout.data_source import PromptDataSource
from relax.engine.rollout.generate import expand_groups, generate_samples


def scalar_reward(sample: Sample) -> float:
    """The number that drives advantages: the reward, or its ``score`` entry for dict rewards."""
    if isinstance(sample.reward, dict):
        return float(sample.reward["score"])
    return float(sample.reward if sample.reward is not None else 0.0)


def summarize_samples(samples: list[Sample], prefix: str) -> dict[str, float]:
    """Reward, accuracy (share of samples with reward > 0), lengths and finish reasons."""
    rewards = [scalar_reward(s) for s in samples]
    lengths = [s.response_length for s in samples]
    return {
        f"{prefix}/reward_mean": statistics.fmean(rewards),
        f"{prefix}/accuracy": sum(r > 0 for r in rewards) / len(rewards),
        f"{prefix}/response_length_mean": statistics.fmean(lengths),
        f"{prefix}/response_length_max": float(max(lengths)),
        f"{prefix}/truncated_ratio": sum(s.status is SampleStatus.TRUNCATED for s in samples) / len(samples),
        f"{prefix}/num_samples": float(len(samples)),
    }


def zero_std_group_ratio(samples: list[Sample]) -> float:
    """Share of prompt groups whose rewards are all equal (they carry no GRPO signal)."""
    groups: dict[int, list[float]] = {}
    for sample in samples:
        groups.setdefault(sample.group_index, []).append(scalar_reward(sample))
    return sum(len(set(rewards)) == 1 for rewards in groups.values()) / max(len(groups), 1)


class Rollout:
    def __init__(
        self,
        engine: InferenceEngine,
        data_source: PromptDataSource,
        rewards: RewardComputer,
        sampling: SamplingParams,
        n_samples_per_prompt: int,
        seed: int,
        eval_sets: dict[str, list[Sample]] | None = None,
        eval_sampling: SamplingParams | None = None,
        n_samples_per_eval_prompt: int = 1,
    ):
        self.engine = engine
        self.data_source = data_source
        self.rewards = rewards
        self.sampling = sampling
        self.n_samples_per_prompt = n_samples_per_prompt
        self.seed = seed
        self.eval_sets = eval_sets or {}
        self.eval_sampling = eval_sampling or sampling
        self.n_samples_per_eval_prompt = n_samples_per_eval_prompt

    def _step_seed(self, rollout_id: int, salt: int = 0) -> int:
        # One seed per step: a resumed run samples exactly what the interrupted one would have.
        return (self.seed * 1_000_003 + rollout_id * 7919 + salt) % (2**63)

    async def generate(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        """Scored samples of step ``rollout_id``, grouped by prompt, and rollout metrics."""
        prompts = self.data_source.prompts_for_step(rollout_id)
        samples = expand_groups(prompts, self.n_samples_per_prompt, rollout_id * len(prompts))
        sampling = replace(self.sampling, seed=self._step_seed(rollout_id))
        await generate_samples(self.engine, samples, sampling)
        await self.rewards.score(samples)
        metrics = summarize_samples(samples, "rollout")
        metrics["rollout/zero_std_group_ratio"] = zero_std_group_ratio(samples)
        metrics["rollout/epoch"] = float(self.data_source.epoch_of_step(rollout_id))
        metrics.update(self.rewards.pop_metrics())
        return samples, metrics

    async def evaluate(self, step: int) -> tuple[dict[str, float], dict[str, list[Sample]]]:
        """Metrics ``eval/<set>/...`` per held-out set, plus ``eval/accuracy`` (mean over sets)."""
        metrics: dict[str, float] = {}
        results: dict[str, list[Sample]] = {}
        for position, (name, prompts) in enumerate(self.eval_sets.items()):
            samples = expand_groups(prompts, self.n_samples_per_eval_prompt)
            sampling = replace(self.eval_sampling, seed=self._step_seed(step, salt=1 + position))
            await generate_samples(self.engine, samples, sampling)
            await self.rewards.score(samples)
            metrics.update(summarize_samples(samples, f"eval/{name}"))
            results[name] = samples
        if results:
            metrics["eval/accuracy"] = statistics.fmean(metrics[f"eval/{name}/accuracy"] for name in results)
            metrics.update({f"eval/{k.removeprefix('reward/')}": v for k, v in self.rewards.pop_metrics().items()})
        return metrics, results

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await self.engine.update_weights(named_tensors, version)
