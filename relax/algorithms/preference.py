"""Preference losses on whole completions: DPO, IPO and SimPO (reference-free, length-normalised), and the
Bradley-Terry loss of a reward model.

Every loss is a function of four sequence log-probabilities per pair (the policy's and the reference's, of the chosen
and the rejected completion, each the sum over the completion's tokens) and the completions' lengths:

- ``sigmoid`` (DPO, Rafailov et al., 2023): ``-(1-ε)·logσ(βΔ) - ε·logσ(-βΔ)`` with ``Δ = (c - c_ref) - (r - r_ref)``;
  ``ε`` is ``--dpo-label-smoothing`` (conservative DPO; 0 is plain DPO, TRL's ``sigmoid``);
- ``ipo`` (Azar et al., 2023) as TRL computes it: ``(Δ_avg - 1/(2β))²`` where each log-ratio is divided by its
  completion's length (the IPO authors' normalised form);
- ``simpo`` (Meng et al., 2024): no reference model; ``-(1-ε)·logσ(β·(c/|c| - r/|r|) - γ) - ε·logσ(-(…))`` with
  ``γ`` the target margin ``--simpo-gamma`` (γ = 0 is TRL's ``sigmoid_norm`` with the reference's log-probs at 0).

The implicit rewards are ``β`` times the log-ratios (``β`` times the length-normalised log-probs for SimPO).

A reward model (``--loss-type rm``) gives each completion a scalar score ``r``; its loss is Bradley-Terry's
``-logσ(r_c - r_r - m)`` with ``m`` the pair's optional margin (``--margin-key``), plus ``λ·(r_c + r_r)²`` with ``λ``
``--center-rewards-coefficient`` (Eisenstein et al., 2023: keeps the scores centred on 0), as TRL's RewardTrainer.

Training with any split of the pairs into micro-batches (and ranks): the loss of a pair couples its two completions,
which a packed or sharded micro-batch may separate. The trainer therefore takes the loss's derivative with respect to
each completion's sequence log-prob (a reward model: its score), ``g = ∂L/∂s``, from a no-gradient pass at the step's parameters
(`preference_gradients`), and trains on ``Σ g·s``, whose gradient equals the loss's exactly (one optimizer step per
batch of pairs, so the parameters do not move in between).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F

PreferenceLoss = Literal["sigmoid", "ipo", "simpo"]
PREFERENCE_LOSSES: tuple[str, ...] = get_args(PreferenceLoss)


@dataclass(frozen=True)
class PreferenceSettings:
    loss: PreferenceLoss = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.0

    @property
    def needs_reference(self) -> bool:
        return self.loss != "simpo"


@dataclass
class PreferenceTerms:
    """Per pair: the loss, and the implicit rewards of the chosen and the rejected completion."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def preference_losses(settings: PreferenceSettings, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
                      ref_chosen_logps: torch.Tensor | None, ref_rejected_logps: torch.Tensor | None,
                      chosen_lengths: torch.Tensor, rejected_lengths: torch.Tensor) -> PreferenceTerms:
    """The per-pair loss of ``settings.loss`` (module doc); every argument is ``[P]`` (one entry per pair)."""
    beta, smoothing = settings.beta, settings.label_smoothing
    chosen_lengths = chosen_lengths.to(chosen_logps.dtype).clamp(min=1.0)
    rejected_lengths = rejected_lengths.to(rejected_logps.dtype).clamp(min=1.0)
    if settings.loss == "simpo":
        chosen_scores, rejected_scores = chosen_logps / chosen_lengths, rejected_logps / rejected_lengths
        logits = beta * (chosen_scores - rejected_scores) - settings.simpo_gamma
        losses = -(1 - smoothing) * F.logsigmoid(logits) - smoothing * F.logsigmoid(-logits)
        return PreferenceTerms(losses, beta * chosen_scores.detach(), beta * rejected_scores.detach())
    if ref_chosen_logps is None or ref_rejected_logps is None:
        raise ValueError(f"the {settings.loss} preference loss needs the reference model's log-probs")
    chosen_scores, rejected_scores = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    if settings.loss == "sigmoid":
        logits = beta * (chosen_scores - rejected_scores)
        losses = -(1 - smoothing) * F.logsigmoid(logits) - smoothing * F.logsigmoid(-logits)
    elif settings.loss == "ipo":
        delta = chosen_scores / chosen_lengths - rejected_scores / rejected_lengths
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {settings.loss!r}; known: {list(PREFERENCE_LOSSES)}")
    return PreferenceTerms(losses, beta * chosen_scores.detach(), beta * rejected_scores.detach())


@dataclass
class PreferenceStep:
    """What a step's training needs per completion, pairs interleaved ``[chosen_0, rejected_0, chosen_1, ...]``:
    ``gradients`` ``∂(Σ losses)/∂s`` of each completion's sequence log-prob ``s``; and, for the metrics, each
    completion's half of its pair's loss, its reward, and its half of the pair's margin and accuracy."""

    gradients: torch.Tensor
    loss_halves: torch.Tensor
    rewards: torch.Tensor
    margin_halves: torch.Tensor
    accuracy_halves: torch.Tensor


# The per-completion fields of a preference step that the trainer's loss reads (`relax.algorithms.loss`), each a
# scalar per completion carried on every one of its tokens.
PREFERENCE_FIELDS = ("preference_gradient", "preference_loss_half", "preference_reward", "preference_margin_half",
                     "preference_accuracy_half", "preference_is_chosen")


def preference_fields(step: PreferenceStep) -> dict[str, torch.Tensor]:
    """``step``'s per-completion values under their `PREFERENCE_FIELDS` names (completions interleaved, the chosen
    first in each pair)."""
    is_chosen = torch.tensor([1.0, 0.0]).repeat(len(step.gradients) // 2)
    values = (step.gradients, step.loss_halves, step.rewards, step.margin_halves, step.accuracy_halves, is_chosen)
    return dict(zip(PREFERENCE_FIELDS, values))


def preference_gradients(settings: PreferenceSettings, logps: torch.Tensor, ref_logps: torch.Tensor | None,
                         lengths: torch.Tensor) -> PreferenceStep:
    """`PreferenceStep` of completions given interleaved (``[2P]``: chosen, rejected, chosen, ...): their sequence
    log-probs under the policy (``logps``) and the reference (``ref_logps``, None for SimPO), and their lengths."""
    ref = ref_logps.detach().double() if ref_logps is not None else None
    lengths = lengths.double()
    return _step_of(logps, lambda sums: preference_losses(
        settings, sums[0::2], sums[1::2], ref[0::2] if ref is not None else None,
        ref[1::2] if ref is not None else None, lengths[0::2], lengths[1::2]))


def bradley_terry_losses(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor,
                         margins: torch.Tensor | None = None, center_coefficient: float = 0.0) -> PreferenceTerms:
    """A reward model's per-pair loss (module doc); the rewards are the scores themselves."""
    logits = chosen_scores - rejected_scores
    if margins is not None:
        logits = logits - margins.to(logits.dtype)
    losses = -F.logsigmoid(logits)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen_scores + rejected_scores) ** 2
    return PreferenceTerms(losses, chosen_scores.detach(), rejected_scores.detach())


def reward_model_gradients(scores: torch.Tensor, margins: torch.Tensor | None = None,
                           center_coefficient: float = 0.0) -> PreferenceStep:
    """`PreferenceStep` of a reward model's scores of completions given interleaved (``[2P]``), with the pairs'
    margins ``[P]`` (None: no margin)."""
    margins = margins.detach().double() if margins is not None else None
    return _step_of(scores, lambda values: bradley_terry_losses(values[0::2], values[1::2], margins,
                                                                center_coefficient))


def _step_of(values: torch.Tensor, terms_of) -> PreferenceStep:
    """`PreferenceStep` of the per-completion ``values`` (interleaved pairs) under the loss ``terms_of(values)``."""
    if values.numel() % 2:
        raise ValueError(f"preference completions come in pairs; got {values.numel()}")
    leaves = values.detach().double().requires_grad_(True)
    terms = terms_of(leaves)
    (gradients,) = torch.autograd.grad(terms.losses.sum(), leaves)
    rewards = torch.stack([terms.chosen_rewards, terms.rejected_rewards], dim=1).flatten()
    margins = (terms.chosen_rewards - terms.rejected_rewards).repeat_interleave(2)
    accuracy = (terms.chosen_rewards > terms.rejected_rewards).double().repeat_interleave(2)
    return PreferenceStep(gradients.float(), (terms.losses.detach() / 2).repeat_interleave(2).float(),
                          rewards.float(), (margins / 2).float(), (accuracy / 2).float())
