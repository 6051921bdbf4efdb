"""Score rollout samples: run the configured reward on every sample and set ``sample.reward``.

One bad sample must not stop a rollout, and a broken reward must not pass unnoticed: a reward
that raises (or returns something that is not a finite number) gives that sample 0.0, is
counted in ``reward/num_errors``, and its message is logged once with the sample index.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from relax.data.sample import Sample
from relax.engine.rewards.custom import load_custom_reward
from relax.engine.rewards.registry import get_reward_fn

logger = logging.getLogger("relax.rewards")

Reward = float | dict[str, float]


class RewardComputer:
    """Sets ``sample.reward`` from one reward source: a rule reward or a custom function.

    - ``rm_type``: a registered rule reward (see ``get_reward_fn``); a sample's
      ``metadata["rm_type"]`` overrides it, so one dataset can mix answer formats. Rule rewards
      compare with ``sample.label``; a sample without a label is an error.
    - ``custom_rm_path``: a user function ``fn(args, sample) -> float | dict`` scores every
      sample (it can read ``metadata`` itself); with ``group_rm`` it is called once per GRPO
      group as ``fn(args, samples) -> list[float | dict]``, samples grouped by ``group_index``.

    Synchronous functions run in a pool of ``max_workers`` threads so the event loop (and the
    rollout it drives) keeps running; ``async def`` functions are awaited concurrently.
    ``args`` is passed unchanged to custom functions.
    """

    def __init__(
        self,
        rm_type: str | None = None,
        custom_rm_path: str | None = None,
        *,
        group_rm: bool = False,
        args: Any = None,
        max_workers: int = 16,
    ) -> None:
        if rm_type is None and custom_rm_path is None:
            raise ValueError("no reward configured: set --rm-type to a rule reward or --custom-rm-path to a function")
        if rm_type is not None and custom_rm_path is not None:
            raise ValueError(
                f"--rm-type {rm_type!r} and --custom-rm-path {custom_rm_path!r} both given; set one "
                "(a custom function can call get_reward_fn itself)"
            )
        if group_rm and custom_rm_path is None:
            raise ValueError("--group-rm scores whole groups and needs a --custom-rm-path function")
        if rm_type is not None:
            get_reward_fn(rm_type)  # an unknown type fails here, before any rollout
        self._rm_type = rm_type
        self._custom_fn = load_custom_reward(custom_rm_path) if custom_rm_path is not None else None
        self._custom_fn_is_async = inspect.iscoroutinefunction(self._custom_fn)
        self._group_rm = group_rm
        self._args = args
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="relax-reward")
        self.error_counts: Counter[str] = Counter()  # "ExceptionType: message" -> failed samples, over the run
        self._errors_since_metrics = 0

    async def score(self, samples: Sequence[Sample]) -> None:
        """Set ``reward`` on every sample; never raises for a failing reward (see the module doc)."""
        if self._group_rm:
            groups: dict[int, list[Sample]] = {}
            for sample in samples:
                groups.setdefault(sample.group_index, []).append(sample)
            await asyncio.gather(*(self._score_group(group) for group in groups.values()))
        else:
            await asyncio.gather(*(self._score_sample(sample) for sample in samples))

    def pop_metrics(self) -> dict[str, int]:
        """``reward/num_errors``: samples whose reward failed since the previous call."""
        metrics = {"reward/num_errors": self._errors_since_metrics}
        self._errors_since_metrics = 0
        return metrics

    def close(self) -> None:
        """Stop the worker threads once no more scoring will be requested."""
        self._pool.shutdown(cancel_futures=True)

    async def _score_sample(self, sample: Sample) -> None:
        try:
            if self._custom_fn is not None:
                reward = await self._call_custom_fn(sample)
            else:
                reward = await self._call_rule_reward(sample)
            sample.reward = _checked_reward(reward)
        except Exception as err:  # noqa: BLE001  (a user's reward may raise anything; it is counted and logged)
            self._record_failure([sample], err)

    async def _score_group(self, group: list[Sample]) -> None:
        try:
            rewards = await self._call_custom_fn(group)
            if not isinstance(rewards, (list, tuple)):
                raise TypeError(f"a --group-rm function must return a list of rewards, got {type(rewards).__name__}")
            if len(rewards) != len(group):
                raise ValueError(f"a --group-rm function returned {len(rewards)} rewards for a group of {len(group)}")
        except Exception as err:  # noqa: BLE001
            self._record_failure(group, err)
            return
        for sample, reward in zip(group, rewards):
            try:
                sample.reward = _checked_reward(reward)
            except Exception as err:  # noqa: BLE001
                self._record_failure([sample], err)

    async def _call_rule_reward(self, sample: Sample) -> Any:
        rm_type = sample.metadata.get("rm_type") or self._rm_type
        score = get_reward_fn(rm_type)
        if sample.label is None:
            raise ValueError(f"reward type {rm_type!r} compares the response with a label, but the sample has none")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, score, sample.response, sample.label, sample.metadata)

    async def _call_custom_fn(self, sample_or_group: Sample | list[Sample]) -> Any:
        if self._custom_fn_is_async:
            return await self._custom_fn(self._args, sample_or_group)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._custom_fn, self._args, sample_or_group)

    def _record_failure(self, samples: list[Sample], err: Exception) -> None:
        """Give the samples reward 0.0, count the error, and log its message the first time it is seen."""
        for sample in samples:
            sample.reward = 0.0
        message = f"{type(err).__name__}: {err}"
        if message not in self.error_counts:
            indices = ", ".join(str(sample.index) for sample in samples)
            where = f"sample {indices}" if len(samples) == 1 else f"samples {indices} (group {samples[0].group_index})"
            logger.error(
                "reward failed for %s, reward set to 0.0: %s (further failures with this message are only counted "
                "in reward/num_errors)",
                where,
                message,
                exc_info=err,
            )
        self.error_counts[message] += len(samples)
        self._errors_since_metrics += len(samples)


def _checked_reward(value: Any) -> Reward:
    """``value`` as a float, or a dict of floats; anything else, or a NaN/infinity, raises."""
    if isinstance(value, dict):
        return {key: _checked_number(number) for key, number in value.items()}
    return _checked_number(value)


def _checked_number(value: Any) -> float:
    if not isinstance(value, numbers.Real):
        raise TypeError(f"a reward must be a float or a dict of floats, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"a reward must be finite, got {value}")
    return float(value)
