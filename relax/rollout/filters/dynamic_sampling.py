"""Dynamic sampling filters (DAPO): decide, per prompt group, whether it enters the batch.

A filter is ``fn(args, samples) -> bool | DynamicFilterOutput``, called with the scored
samples of one prompt group; it is named on the command line by
``--dynamic-sampling-filter-path module:fn``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relax.data.sample import Sample


@dataclass(frozen=True)
class DynamicFilterOutput:
    keep: bool
    reason: str = ""


def group_rewards(samples: list[Sample]) -> list[float]:
    """The scalar reward of each sample (the ``score`` entry of dict rewards)."""
    rewards = []
    for sample in samples:
        reward = sample.reward
        if isinstance(reward, dict):
            reward = reward["score"]
        rewards.append(float(reward if reward is not None else 0.0))
    return rewards


def check_reward_nonzero_std(args: Any, samples: list[Sample]) -> DynamicFilterOutput:
    """Keep a group only if its rewards are not all equal (a group with one reward value gives
    every sample a zero group-relative advantage, so it carries no gradient)."""
    rewards = group_rewards(samples)
    if len(rewards) > 1 and len(set(rewards)) > 1 and statistics.pstdev(rewards) > 0:
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason=f"zero_std_{rewards[0] if rewards else 'empty'}")


def apply_filter(function: Callable[..., Any], args: Any, samples: list[Sample]) -> DynamicFilterOutput:
    """Call a filter and normalise its answer to a ``DynamicFilterOutput``."""
    result = function(args, samples)
    if isinstance(result, DynamicFilterOutput):
        return result
    if isinstance(result, bool):
        return DynamicFilterOutput(keep=result)
    raise TypeError(
        f"--dynamic-sampling-filter-path: {getattr(function, '__name__', function)!r} returned "
        f"{type(result).__name__}; expected bool or DynamicFilterOutput"
    )
