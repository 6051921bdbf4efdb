"""The Rollout role: turn prompts into scored samples with the inference engine."""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from relax.backends.inference.base import InferenceEngine, SamplingParams
from relax.data.sample import Sample, SampleStatus
from relax.data_plane.base import split_into_groups
from relax.rollout.agentic.multi_turn import STATUS_OF_STOP_REASON
from relax.rollout.filters.dynamic_sampling import apply_filter
from relax.rollout.generation.context import PerSampleGeneration
from relax.rollout.generation.data_source import PromptDataSource
from relax.rollout.generation.generate import expand_groups, generate_samples
from relax.rollout.generation.multimodal import MultimodalPreparer
from relax.rollout.rewards.compute import RewardComputer
from relax.utils.aio import cancel_and_wait

logger = logging.getLogger("relax")

# Takes the scored groups complete now (several when they finish together: one write to the data plane for them).
GroupSink = Callable[[list[list[Sample]]], Awaitable[None]]


def scalar_reward(sample: Sample) -> float:
    """The number that drives advantages: the reward, or its ``score`` entry for dict rewards."""
    if isinstance(sample.reward, dict):
        return float(sample.reward["score"])
    return float(sample.reward if sample.reward is not None else 0.0)


def is_correct(sample: Sample) -> bool:
    """Whether the reward judged the sample correct: a dict reward says so in its ``acc`` entry (verl's convention,
    for partial-credit rewards), any other counts as correct when positive (the rule rewards give 1 for a correct
    answer and 0, or DAPO's -1, otherwise)."""
    if isinstance(sample.reward, dict) and "acc" in sample.reward:
        return bool(sample.reward["acc"])
    return scalar_reward(sample) > 0


def summarize_samples(samples: list[Sample], prefix: str, verdicts: bool = True) -> dict[str, float]:
    """Reward, accuracy (the share of samples the reward judged correct: `is_correct`; not with a reward that
    gives scores, not verdicts, ``verdicts=False``: a trained reward model), lengths and finish reasons."""
    rewards = [scalar_reward(s) for s in samples]
    lengths = [s.response_length for s in samples]
    return {
        f"{prefix}/reward_mean": statistics.fmean(rewards),
        **({f"{prefix}/accuracy": sum(map(is_correct, samples)) / len(samples)} if verdicts else {}),
        f"{prefix}/response_length_mean": statistics.fmean(lengths),
        f"{prefix}/response_length_max": float(max(lengths)),
        f"{prefix}/truncated_ratio": sum(s.status is SampleStatus.TRUNCATED for s in samples) / len(samples),
        f"{prefix}/failed_ratio": sum(s.status is SampleStatus.FAILED for s in samples) / len(samples),
        f"{prefix}/num_samples": float(len(samples)),
        **episode_metrics(samples, prefix),
        **weight_version_metrics(samples, prefix),
        **agent_metrics(samples, prefix),
    }


def agent_metrics(samples: list[Sample], prefix: str) -> dict[str, float]:
    """Reward and accuracy per agent for multi-agent episodes (``metadata["agent"]``, see
    `relax.rollout.agentic.multi_agent`): the agents' rewards mean different things (a proposer's answer, a
    verifier's verdict), so their mean over all samples alone hides which one learns."""
    by_agent: dict[str, list[Sample]] = {}
    for sample in samples:
        if "agent" in sample.metadata:
            by_agent.setdefault(str(sample.metadata["agent"]), []).append(sample)
    metrics = {}
    for agent, members in by_agent.items():
        metrics[f"{prefix}/agent/{agent}/reward_mean"] = statistics.fmean(map(scalar_reward, members))
        metrics[f"{prefix}/agent/{agent}/accuracy"] = sum(map(is_correct, members)) / len(members)
    return metrics


def weight_version_metrics(samples: list[Sample], prefix: str) -> dict[str, float]:
    """The oldest and newest weight version that produced the samples' tokens: with the trainer's version at the
    step, what shows that no sample came from weights outside the staleness bound (or from a dead run's)."""
    versions = [v for s in samples for v in (s.weight_version if isinstance(s.weight_version, list)
                                             else [s.weight_version]) if v is not None]
    if not versions:
        return {}
    return {f"{prefix}/weight_version_min": float(min(versions)), f"{prefix}/weight_version_max": float(max(versions))}


def episode_metrics(samples: list[Sample], prefix: str) -> dict[str, float]:
    """Turns per episode and the share of each stop reason, for samples of the multi-turn loop; agent programs'
    admission waits (--agentic-program-admission)."""
    metrics = admission_metrics(samples, prefix)
    episodes = [s for s in samples if "rollout_stop_reason" in s.metadata]
    if not episodes:
        return metrics
    reasons = [s.metadata["rollout_stop_reason"] for s in episodes]
    return {
        **metrics,
        f"{prefix}/turns_mean": statistics.fmean(s.metadata["rollout_turns"] for s in episodes),
        **{f"{prefix}/stop_{reason}_ratio": reasons.count(reason) / len(episodes) for reason in STATUS_OF_STOP_REASON},
    }


def admission_metrics(samples: list[Sample], prefix: str) -> dict[str, float]:
    """How many agent programs waited for admission, how long on average, and how many went in past the wait."""
    admitted = [s for s in samples if "admission_wait_s" in s.metadata]
    if not admitted:
        return {}
    waits = [s.metadata["admission_wait_s"] for s in admitted]
    return {f"{prefix}/admission_waits": float(sum(wait > 0 for wait in waits)),
            f"{prefix}/admission_wait_s_mean": statistics.fmean(waits),
            f"{prefix}/admission_bypasses": float(sum(bool(s.metadata["admission_bypassed"]) for s in admitted))}


def zero_std_group_ratio(samples: list[Sample]) -> float:
    """Share of prompt groups whose rewards are all equal (they carry no GRPO signal)."""
    groups: dict[int, list[float]] = {}
    for sample in samples:
        groups.setdefault(sample.group_index, []).append(scalar_reward(sample))
    return sum(len(set(rewards)) == 1 for rewards in groups.values()) / max(len(groups), 1)


def overlong_penalty(response_length: int, max_response_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_response_len - buffer_len`` tokens, then
    falling linearly to ``-factor`` at ``max_response_len``: ``min(0, (M - L - l) / L) * F``."""
    return min(0.0, (max_response_len - buffer_len - response_length) / buffer_len) * factor


def add_to_reward(sample: Sample, amount: float) -> None:
    """Add ``amount`` to a sample's reward (to the ``score`` entry of dict rewards)."""
    if isinstance(sample.reward, dict):
        sample.reward = {**sample.reward, "score": float(sample.reward["score"]) + amount}
    else:
        sample.reward = scalar_reward(sample) + amount


@dataclass(frozen=True)
class OverlongPenalty:
    """``--overlong-buffer-len`` / ``--overlong-penalty-factor`` with the response-length cap."""

    max_response_len: int
    buffer_len: int
    factor: float

    def apply(self, samples: list[Sample]) -> list[float]:
        """Add each sample's penalty to its reward (recorded in ``metadata["overlong_penalty"]``)."""
        penalties = []
        for sample in samples:
            penalty = overlong_penalty(sample.response_length, self.max_response_len, self.buffer_len, self.factor)
            if penalty:
                add_to_reward(sample, penalty)
            sample.metadata["overlong_penalty"] = penalty
            penalties.append(penalty)
        return penalties


@dataclass(frozen=True)
class DynamicSampling:
    """``--dynamic-sampling-filter-path`` (the loaded filter) and ``--max-dynamic-sampling-rounds``."""

    filter_fn: Callable[..., Any]
    max_rounds: int
    args: Any = None


def split_groups(samples: list[Sample], group_size: int) -> list[list[Sample]]:
    return [samples[i:i + group_size] for i in range(0, len(samples), group_size)]


class Rollout:
    """Generates and scores each step's groups and the held-out sets. ``engine`` and ``rewards`` are None in a run
    that generates nothing (``--loss-type rm``): the rollout is then its data stream and held-out sets only.
    ``eval_rewards`` grades the held-out sets instead of ``rewards`` (``--eval-rm-type``)."""

    def __init__(
        self,
        engine: InferenceEngine | None,
        data_source: PromptDataSource,
        rewards: RewardComputer | None,
        sampling: SamplingParams,
        n_samples_per_prompt: int,
        seed: int,
        eval_sets: dict[str, list[Sample]] | None = None,
        eval_sampling: SamplingParams | None = None,
        n_samples_per_eval_prompt: int = 1,
        dynamic_sampling: DynamicSampling | None = None,
        overlong: OverlongPenalty | None = None,
        multimodal: MultimodalPreparer | None = None,
        per_sample: PerSampleGeneration | None = None,
        routing_replay: bool = False,
        eval_rewards: RewardComputer | None = None,
    ):
        self.engine = engine
        self.data_source = data_source
        self.rewards = rewards
        self.eval_rewards = eval_rewards or rewards
        self.sampling = sampling
        self.n_samples_per_prompt = n_samples_per_prompt
        self.seed = seed
        self.eval_sets = eval_sets or {}
        self.eval_sampling = eval_sampling or sampling
        self.n_samples_per_eval_prompt = n_samples_per_eval_prompt
        self.dynamic_sampling = dynamic_sampling
        self.overlong = overlong
        self.multimodal = multimodal
        self.per_sample = per_sample
        self.routing_replay = routing_replay  # training samples keep the engine's routed experts (R3)
        self._skipped_bad_samples = 0  # prompts dropped for unreadable media since the last step's metrics

    def _step_seed(self, rollout_id: int, salt: int = 0) -> int:
        # One seed per step: a resumed run samples exactly what the interrupted one would have.
        return (self.seed * 1_000_003 + rollout_id * 7919 + salt) % (2**63)

    async def _sample_round(self, rollout_id: int, round_index: int, count: int,
                            on_group: GroupSink | None = None) -> list[Sample]:
        """Generate and score ``count`` prompt groups taken at the data source's cursor (``on_group``: see
        `_generate_and_score`)."""
        start, prompts = self.data_source.take(count)
        prompts = await self._prepare_media(prompts)
        samples = expand_groups(prompts, self.n_samples_per_prompt, start)
        # Refill rounds get their own seeds, disjoint from the step seeds of eval (salt 1 + set position).
        salt = 0 if round_index == 0 else 1_000_003 * round_index
        sampling = replace(self.sampling, seed=self._step_seed(rollout_id, salt=salt))
        samples = await self._generate_and_score(samples, sampling, on_group=on_group)
        if on_group is None:  # handed-on groups were finished before they left
            self._finish_group(samples)
        return samples

    def _finish_group(self, samples: list[Sample]) -> None:
        """What a scored group gets before it is handed on: the overlong penalty."""
        if self.overlong is not None:
            self.overlong.apply(samples)

    async def generate(self, rollout_id: int, on_group: GroupSink | None = None) -> tuple[list[Sample], dict[str, float]]:
        """Scored samples of step ``rollout_id``, grouped by prompt, and rollout metrics.

        ``on_group``: awaited with the groups, scored, as soon as their last samples finish, while the others still
        decode (the asynchronous modes write them to training then); a per-sample generate function hands them all
        on at its end. Groups it was given are in the returned samples too. With dynamic sampling it is not called:
        the caller takes the returned samples.

        With dynamic sampling, groups the filter rejects are dropped and replaced by groups of the
        next prompts of the data source, round after round, until ``rollout_batch_size`` groups are
        kept or ``max_rounds`` rounds ran. A refill round over-samples the missing groups by the keep
        rate seen so far (at most ``rollout_batch_size`` groups); groups kept beyond the batch are
        discarded and counted in ``rollout/dropped_surplus_groups`` (their prompts count as consumed).
        The data source's cursor records the prompts consumed, and checkpoints save it.
        """
        batch_size = self.data_source.rollout_batch_size
        if self.dynamic_sampling is None:
            # Stateless: step s takes stream positions [s·B, (s+1)·B), whatever ran before.
            self.data_source.consumed = rollout_id * batch_size
        epoch = self.data_source.epoch_of_position(self.data_source.consumed)
        metrics: dict[str, float] = {}
        if self.dynamic_sampling is None:
            samples = await self._sample_round(rollout_id, 0, batch_size, on_group)
        else:
            samples, metrics = await self._generate_filtered(rollout_id, batch_size)
        metrics.update(self.step_metrics(samples, epoch))
        return samples, metrics

    def step_metrics(self, samples: list[Sample], epoch: int) -> dict[str, float]:
        """The ``rollout/*`` metrics of a step's samples (and the reward's since the last step)."""
        metrics = summarize_samples(samples, "rollout", self.rewards.gives_verdicts)
        metrics["rollout/zero_std_group_ratio"] = zero_std_group_ratio(samples)
        metrics["rollout/epoch"] = float(epoch)
        if self.overlong is not None:
            metrics["rollout/overlong_penalty_mean"] = statistics.fmean(
                s.metadata.get("overlong_penalty", 0.0) for s in samples
            )
        metrics.update(self.rewards.pop_metrics())
        if self.multimodal is not None:
            metrics["rollout/skipped_bad_samples"] = float(self._skipped_bad_samples)
            self._skipped_bad_samples = 0
        return metrics

    async def generate_group(self, rollout_id: int, position: int, prompt: Sample) -> list[Sample] | None:
        """One prompt's group, generated, scored and finished: the unit `relax.core.streaming.carry_over` keeps in
        flight across steps. ``position``: the prompt's stream position (its ``group_index``); its sampling seed is
        the launching step's, mixed with the position, so the group samples the same whichever step takes it.
        None when the prompt's media cannot be read (counted in ``rollout/skipped_bad_samples``)."""
        prompts = await self._prepare_media([prompt])
        if not prompts:
            return None
        samples = expand_groups(prompts, self.n_samples_per_prompt, position)
        sampling = replace(self.sampling, seed=(self._step_seed(rollout_id) + position * 104_729) % (2**63))
        samples = await self._generate_and_score(samples, sampling)
        self._finish_group(samples)
        return samples

    async def _generate_and_score(self, samples: list[Sample], sampling: SamplingParams,
                                  evaluation: bool = False, on_group: GroupSink | None = None) -> list[Sample]:
        """Responses for ``samples`` from the engine (one call) or from the per-sample generate
        function, then rewards.

        A FAILED sample (its environment raised or hung; ``metadata["error"]``) is not shown to the
        reward: it gets reward 0.0, and its loss mask is all 0, so it stays in its group (group and
        batch sizes hold) without training the policy on a broken episode.

        ``on_group``: each group is scored, finished (`_finish_group`) and handed to it as soon as the engine
        reports its last sample (engine generation; the engine call is still the same single call), or all at the
        end (a per-sample generate function).
        """
        routed = self.routing_replay and not evaluation
        if on_group is not None and self.per_sample is None:
            return await self._generate_group_by_group(samples, sampling, routed, on_group)
        if self.per_sample is None:
            samples = await generate_samples(self.engine, samples, sampling, return_routed_experts=routed)
        else:
            samples = await self.per_sample.run(self.engine, samples, sampling, evaluation)
        await self._score(samples, self.eval_rewards if evaluation else self.rewards)
        if on_group is not None:
            self._finish_group(samples)
            await on_group(split_into_groups(samples))
        return samples

    async def _generate_group_by_group(self, samples: list[Sample], sampling: SamplingParams, routed: bool,
                                       on_group: GroupSink) -> list[Sample]:
        """One engine call; each group scored and handed to ``on_group`` the moment its last sample is reported
        (with the others that completed meanwhile)."""
        groups = split_into_groups(samples)
        group_of = {id(sample): group for group in groups for sample in group}
        left = {id(group): len(group) for group in groups}
        finished: asyncio.Queue[list[Sample]] = asyncio.Queue()

        def on_sample(sample: Sample) -> None:
            group = group_of[id(sample)]
            left[id(group)] -= 1
            if not left[id(group)]:
                finished.put_nowait(group)

        async def hand_on() -> None:
            handed = 0
            while handed < len(groups):
                ready = [await finished.get()]
                while not finished.empty():
                    ready.append(finished.get_nowait())
                ready_samples = [sample for group in ready for sample in group]
                await self._score(ready_samples)
                self._finish_group(ready_samples)
                await on_group(ready)
                handed += len(ready)

        handing = asyncio.create_task(hand_on())
        try:
            await generate_samples(self.engine, samples, sampling, return_routed_experts=routed, on_sample=on_sample)
            await handing
        finally:
            await cancel_and_wait(handing)
        return samples

    async def _score(self, samples: list[Sample], rewards: RewardComputer | None = None) -> None:
        failed = [s for s in samples if s.status is SampleStatus.FAILED]
        # A generate function may have scored its samples already (an agent's reward from its output file).
        await (rewards or self.rewards).score([s for s in samples
                                               if s.status is not SampleStatus.FAILED and s.reward is None])
        for sample in failed:
            sample.reward = 0.0
            sample.loss_mask = [0] * sample.response_length

    async def _prepare_media(self, prompts: list[Sample]) -> list[Sample]:
        """Decode and process the prompts' media in the worker pool (no-op for text runs)."""
        if self.multimodal is None:
            return prompts
        ready, skipped = await self.multimodal.prepare(prompts)
        self._skipped_bad_samples += skipped
        return ready

    async def _generate_filtered(self, rollout_id: int, batch_size: int) -> tuple[list[Sample], dict[str, float]]:
        dynamic = self.dynamic_sampling
        kept: list[list[Sample]] = []
        last_round: list[list[Sample]] = []
        generated = dropped = 0
        reasons: dict[str, int] = {}
        rounds = 0
        while len(kept) < batch_size and rounds < dynamic.max_rounds:
            missing = batch_size - len(kept)
            # Over-sample by the keep rate so far (deterministic: it depends on the scored groups only).
            oversampled = -(-missing * generated // max(len(kept), 1))  # ceil(missing / keep rate)
            count = batch_size if generated == 0 else min(batch_size, max(missing, oversampled))
            samples = await self._sample_round(rollout_id, rounds, count)
            rounds += 1
            generated += count
            last_round = split_groups(samples, self.n_samples_per_prompt)
            for group in last_round:
                verdict = apply_filter(dynamic.filter_fn, dynamic.args, group)
                if verdict.keep:
                    kept.append(group)
                else:
                    dropped += 1
                    reasons[verdict.reason or "filtered"] = reasons.get(verdict.reason or "filtered", 0) + 1
        surplus = max(len(kept) - batch_size, 0)
        kept = kept[:batch_size]
        metrics = {
            "rollout/dynamic_filter_dropped_groups": float(dropped),
            "rollout/dynamic_sampling_rounds": float(rounds),
            "rollout/dropped_surplus_groups": float(surplus),
            "rollout/generated_groups": float(generated),
        }
        if len(kept) < batch_size:
            if not kept:
                # Nothing passed: train on the last round's groups rather than on an empty batch.
                kept = last_round
                logger.warning("step %d: dynamic sampling kept no group in %d rounds (%s); training on the last "
                               "round's %d unfiltered groups", rollout_id + 1, rounds, reasons, len(kept))
            else:
                logger.warning("step %d: dynamic sampling kept %d of %d groups in %d rounds (%s); training on "
                               "the kept groups", rollout_id + 1, len(kept), batch_size, rounds, reasons)
        return [sample for group in kept for sample in group], metrics

    async def eval_set(self, name: str) -> list:
        """The rows of held-out set ``name`` (a reward model's loop ranks its pairs itself); a proxy of this role in
        another process fetches them the same way."""
        return self.eval_sets[name]

    async def evaluate(self, step: int) -> tuple[dict[str, float], dict[str, list[Sample]]]:
        """Metrics ``eval/<set>/...`` per held-out set, plus ``eval/accuracy`` (mean over sets)."""
        metrics: dict[str, float] = {}
        results: dict[str, list[Sample]] = {}
        for position, (name, prompts) in enumerate(list(self.eval_sets.items())):
            # Processed once and kept: the held-out prompts and their media do not change.
            prompts = self.eval_sets[name] = await self._prepare_media(prompts)
            samples = expand_groups(prompts, self.n_samples_per_eval_prompt)
            sampling = replace(self.eval_sampling, seed=self._step_seed(step, salt=1 + position))
            samples = await self._generate_and_score(samples, sampling, evaluation=True)
            metrics.update(summarize_samples(samples, f"eval/{name}", self.eval_rewards.gives_verdicts))
            results[name] = samples
        if results:
            if self.eval_rewards.gives_verdicts:  # (a reward model's scores make no accuracy: --eval-rm-type does)
                metrics["eval/accuracy"] = statistics.fmean(metrics[f"eval/{name}/accuracy"] for name in results)
            metrics.update({f"eval/{k.removeprefix('reward/')}": v for k, v in self.eval_rewards.pop_metrics().items()})
        return metrics, results

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await self.engine.update_weights(named_tensors, version)
