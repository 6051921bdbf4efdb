"""Group filters applied to scored rollouts (DAPO dynamic sampling)."""

from relax.rollout.filters.dynamic_sampling import DynamicFilterOutput, check_reward_nonzero_std

__all__ = ["DynamicFilterOutput", "check_reward_nonzero_std"]
