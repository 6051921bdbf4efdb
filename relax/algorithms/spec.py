"""The algorithm registry: each RL algorithm is one `AlgorithmSpec` built from pure functions.

Adding an algorithm is one entry in `ALGORITHM_SPECS` plus its functions, with a unit test that
pins the formula on hand-computed numbers. The trainer knows nothing of algorithms: it receives
the loss function that `relax.algorithms.loss.build_policy_loss_fn` assembles from the spec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from relax.algorithms.advantages import compute_grpo_advantages

# (rewards [N], group_size, normalize_std) -> per-sample advantages [N]
AdvantageFn = Callable[[torch.Tensor, int, bool], torch.Tensor]


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    advantage_fn: AdvantageFn
    policy_loss: str  # a key of relax.algorithms.loss.POLICY_LOSSES
    min_group_size: int = 1  # smallest --n-samples-per-prompt the estimator is defined for
    needs_critic: bool = False
    paper: str = ""


ALGORITHM_SPECS: dict[str, AlgorithmSpec] = {
    "grpo": AlgorithmSpec(
        name="grpo",
        advantage_fn=compute_grpo_advantages,
        policy_loss="ppo_clip",
        min_group_size=2,
        paper="Shao et al. 2024, DeepSeekMath (arXiv 2402.03300); Dr.GRPO: Liu et al. 2025 (arXiv 2503.20783)",
    ),
}


def get_algorithm(name: str) -> AlgorithmSpec:
    try:
        return ALGORITHM_SPECS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ALGORITHM_SPECS)}") from None
