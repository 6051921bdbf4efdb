"""The algorithm registry: each RL algorithm is one `AlgorithmSpec` built from pure functions.

Adding an algorithm is one entry in `ALGORITHM_SPECS` plus its functions, with a unit test that
pins the formula on hand-computed numbers. The trainer knows nothing of algorithms: it receives
the loss function that `relax.algorithms.loss.build_policy_loss_fn` assembles from the spec.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from relax.algorithms.advantages import (
    AdvantageFn,
    AdvantageInputs,
    RewardNormalizer,
    broadcast_advantages,
    compute_grpo_advantages,
    gae_advantages,
    group_leave_one_out,
    group_mean_baseline,
    raw_rewards,
    reinforce_plus_plus_returns,
    whiten_over_valid_tokens,
)


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    reward_normalizer: RewardNormalizer  # rewards [N] -> per-sample values [N]
    advantage_fn: AdvantageFn  # per-sample values -> per-token advantages
    policy_loss: str  # a key of relax.algorithms.loss.POLICY_LOSSES
    whiten_advantages: bool = False  # global token-level whitening over valid tokens (REINFORCE++)
    min_group_size: int = 1  # smallest --n-samples-per-prompt the estimator is defined for
    uses_reward_kl: bool = False  # the reward carries -kl_coef·KL (--kl-coef)
    requires_on_policy_updates: bool = False  # one optimizer step per rollout
    needs_critic: bool = False
    # A group's advantages depend on that group alone, so they may be computed group by group as groups arrive
    # (the streaming advantages of --fully-async); whitening, a critic or a KL in the reward make them step-wide.
    group_local: bool = True
    paper: str = ""

    def compute_advantages(self, inputs: AdvantageInputs) -> list[torch.Tensor]:
        """Rewards → per-token advantages: normalizer, advantage function, optional whitening."""
        return self.compute_advantages_and_returns(inputs)[0]

    def compute_advantages_and_returns(
        self, inputs: AdvantageInputs
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-token advantages and, with a critic, the value targets ``R_t = A_t + V_t``. The
        returns are taken before whitening: the critic learns the value, not a normalized one."""
        normalized = self.reward_normalizer(inputs.rewards, inputs.group_size, inputs.normalize_std)
        advantages = self.advantage_fn(replace(inputs, rewards=normalized))
        returns = None
        if self.needs_critic:
            returns = [(a + v.float()) * m.float() for a, v, m in zip(advantages, inputs.values, inputs.response_masks)]
        if self.whiten_advantages:
            advantages = whiten_over_valid_tokens(advantages, inputs.response_masks)
        return advantages, returns


def _group_relative(name: str, policy_loss: str, paper: str) -> AlgorithmSpec:
    """GRPO's advantages (group mean/std normalization, broadcast) under another policy loss."""
    return AlgorithmSpec(name=name, reward_normalizer=compute_grpo_advantages, advantage_fn=broadcast_advantages,
                         policy_loss=policy_loss, min_group_size=2, paper=paper)


ALGORITHM_SPECS: dict[str, AlgorithmSpec] = {
    "ppo": AlgorithmSpec(
        name="ppo", reward_normalizer=raw_rewards, advantage_fn=gae_advantages, policy_loss="ppo_clip",
        whiten_advantages=True, uses_reward_kl=True, needs_critic=True,
        paper="Schulman et al. 2017, Proximal Policy Optimization (arXiv 1707.06347); GAE: Schulman et al. 2016 "
              "(arXiv 1506.02438)",
    ),
    "grpo": _group_relative(
        "grpo", "ppo_clip",
        "Shao et al. 2024, DeepSeekMath (arXiv 2402.03300); Dr.GRPO: Liu et al. 2025 (arXiv 2503.20783)",
    ),
    "gspo": _group_relative("gspo", "gspo", "Zheng et al. 2025, Group Sequence Policy Optimization (arXiv 2507.18071)"),
    "sapo": _group_relative("sapo", "sapo", "Gao et al. 2025, Soft Adaptive Policy Optimization (SAPO, Qwen team)"),
    "cispo": _group_relative("cispo", "cispo", "MiniMax 2025, MiniMax-M1 (arXiv 2506.13585)"),
    # M2PO's paper and its authors' code train on group-normalised (GRPO) advantages; upstream passes raw rewards,
    # which with 0/1 rewards leaves no negative signal at all.
    "m2po": _group_relative(
        "m2po", "m2po", "Zheng et al. 2025, Prosperity before Collapse: off-policy RL with stale data (M2PO)"),
    "rloo": AlgorithmSpec(
        name="rloo", reward_normalizer=group_leave_one_out, advantage_fn=broadcast_advantages, policy_loss="rloo",
        min_group_size=2, requires_on_policy_updates=True,
        paper="Ahmadian et al. 2024, Back to Basics: REINFORCE-style optimization (arXiv 2402.14740)",
    ),
    "reinforce_plus_plus": AlgorithmSpec(
        name="reinforce_plus_plus", reward_normalizer=raw_rewards, advantage_fn=reinforce_plus_plus_returns,
        policy_loss="ppo_clip", whiten_advantages=True, uses_reward_kl=True,
        paper="Hu et al. 2025, REINFORCE++ (arXiv 2501.03262)",
    ),
    "reinforce_plus_plus_baseline": AlgorithmSpec(
        name="reinforce_plus_plus_baseline", reward_normalizer=group_mean_baseline,
        advantage_fn=broadcast_advantages, policy_loss="ppo_clip", whiten_advantages=True, min_group_size=2,
        paper="Hu et al. 2025, REINFORCE++ (arXiv 2501.03262), group-mean baseline variant",
    ),
}


def get_algorithm(name: str) -> AlgorithmSpec:
    try:
        return ALGORITHM_SPECS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ALGORITHM_SPECS)}") from None
