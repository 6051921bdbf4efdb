"""The auxiliary load-balancing loss of mixture-of-experts models (``--moe-aux-loss-coef``), as each family defines
it: the family's own ``load_balancing_loss_func`` (Switch-Transformer style, over every layer's router logits) and,
by default, its own coefficient (``router_aux_loss_coef``) when its config turns the loss on
(``output_router_logits``). Families that balance their experts otherwise (DeepSeek-V3's routing biases) define no
such loss; asking for one on them is an error.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MoeAuxLoss:
    coef: float
    num_experts: int
    top_k: int
    loss_fn: Any  # the family's load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)

    def __call__(self, router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The unweighted auxiliary loss of one forward (``attention_mask`` ``[B, S]`` for a padded batch)."""
        return self.loss_fn(router_logits, self.num_experts, self.top_k, attention_mask)


def aux_loss_coef(config, coef: float | None) -> float:
    """The auxiliary loss's weight for a model of ``config``: ``--moe-aux-loss-coef``, or where that is None the
    family's own (its ``router_aux_loss_coef`` when its config turns router logits on); 0: no loss."""
    if coef is not None:
        return coef
    text = config.get_text_config()
    return float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0) if getattr(text, "output_router_logits",
                                                                              False) else 0.0


def moe_aux_loss(model: torch.nn.Module, coef: float | None) -> MoeAuxLoss | None:
    """The loss to add for ``model`` (None: none), ``coef`` being ``--moe-aux-loss-coef`` (None: the family's)."""
    config = model.config.get_text_config()
    loss_fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    coef = aux_loss_coef(model.config, coef)
    if coef == 0:
        return None
    if loss_fn is None or not num_experts:
        raise ValueError(f"--moe-aux-loss-coef {coef:g}: {type(model).__name__} defines no auxiliary "
                         "load-balancing loss (a dense model, or experts balanced another way)")
    return MoeAuxLoss(coef, int(num_experts), int(config.num_experts_per_tok), loss_fn)
