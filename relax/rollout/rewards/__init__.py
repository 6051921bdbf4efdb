"""Rewards: rule rewards by name, custom reward functions by dotted path, and the scorer that runs them.

Importing this package registers the built-in rule rewards: ``math``, ``gsm8k``, ``dapo``,
``multiple_choice``, ``f1``, ``exact_match`` and, for each, its ``boxed_`` variant.
"""

from relax.rollout.rewards import math_rewards, text_rewards  # noqa: F401  (registers the built-ins)
from relax.rollout.rewards.compute import RewardComputer
from relax.rollout.rewards.custom import load_custom_reward
from relax.rollout.rewards.registry import get_reward_fn, register_reward

__all__ = ["RewardComputer", "get_reward_fn", "load_custom_reward", "register_reward"]
