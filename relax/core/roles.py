"""The roles of a run: which ones it needs, from its algorithm spec and mode (a pure function), and `Roles`, the
roles a placement built for the loop to drive.

Role names follow upstream: ``actor`` (the policy being trained), ``rollout`` (engine + rewards),
``advantages``, ``critic`` (PPO's value model), ``reference`` (the frozen initial policy for a KL),
``teacher`` (on-policy distillation) and ``actor_fwd`` (the old-policy log-probs of a batch split
into several optimizer steps; in true on-policy mode, one optimizer step per rollout, the old
log-probs equal the current ones and nothing computes them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax.algorithms.spec import AlgorithmSpec, get_algorithm
from relax.components.actor import Actor
from relax.components.actor_fwd import ActorFwd
from relax.components.advantages import Advantages
from relax.components.critic import Critic
from relax.components.distillation import OnPolicyDistillation
from relax.components.rollout import Rollout
from relax.config import RelaxConfig

ROLE_NAMES = ("actor", "rollout", "advantages", "critic", "reference", "teacher", "actor_fwd")
# Roles that hold a model and may get their own Ray process; the others are light and run in the
# controller's process (advantages) or inside the actor's process (actor_fwd: it needs the
# trainer's current weights).
PLACEABLE_ROLES = ("actor", "rollout", "critic", "reference")


def required_roles(spec: AlgorithmSpec, *, loss_type: str = "policy_loss", use_kl_loss: bool = False,
                   kl_coef: float = 0.0, use_opd: bool = False, true_on_policy: bool = True,
                   dpo_loss: str = "sigmoid") -> tuple[str, ...]:
    """The roles a run needs, in `ROLE_NAMES` order.

    - ``critic`` only for estimators that need one (PPO) and not for SFT;
    - ``reference`` only with a KL: ``use_kl_loss`` (KL in the loss) or ``kl_coef > 0`` for
      estimators that put the KL into the reward;
    - ``teacher`` only with on-policy distillation;
    - ``actor_fwd`` only when a rollout batch is trained in several optimizer steps;
    - SFT needs the actor and the rollout (which evaluates) only; DPO the reference as well (its log-probs are
      the loss's baseline), except the reference-free SimPO; a reward model the actor (the model with its score
      head) and the rollout (its data stream and held-out pairs: no engine).
    """
    if loss_type in ("sft", "rm") or (loss_type == "dpo" and dpo_loss == "simpo"):
        return ("actor", "rollout")
    if loss_type == "dpo":
        return tuple(name for name in ROLE_NAMES if name in {"actor", "rollout", "reference"})
    roles = {"actor", "rollout", "advantages"}
    if spec.needs_critic:
        roles.add("critic")
    if use_kl_loss or (spec.uses_reward_kl and kl_coef > 0):
        roles.add("reference")
    if use_opd:
        roles.add("teacher")
    if not true_on_policy:
        roles.add("actor_fwd")
    return tuple(name for name in ROLE_NAMES if name in roles)


def roles_for_config(cfg: RelaxConfig) -> tuple[str, ...]:
    """`required_roles` for a resolved config."""
    return required_roles(get_algorithm(cfg.advantage_estimator), loss_type=cfg.loss_type,
                          use_kl_loss=cfg.use_kl_loss, kl_coef=cfg.kl_coef, use_opd=cfg.use_opd,
                          true_on_policy=cfg.steps_per_rollout == 1, dpo_loss=cfg.dpo_loss)


@dataclass
class Roles:
    """The roles a placement built (objects in this process, or proxies of Ray processes with the same methods)."""

    tokenizer: object
    rollout: Rollout
    actor: Actor
    advantages: Advantages
    reference: ActorFwd | None
    total_steps: int
    device: torch.device
    inference_dtype: torch.dtype
    critic: Critic | None = None
    distillation: OnPolicyDistillation | None = None
