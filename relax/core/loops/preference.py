"""The loops that train on preference pairs: DPO and its variants (`DPOController`) and a reward model
(`RewardModelController`). Both take each step's ``--rollout-batch-size`` pairs from the data stream, lay them out
``[chosen, rejected]``, compute each completion's loss gradient at the step's parameters from a no-gradient pass
(`relax.algorithms.preference`: the pair's loss couples two completions that a micro-batch or a rank may hold
apart) and train one optimizer step on them."""

from __future__ import annotations

import copy
import statistics
import time

import torch

from relax.algorithms.preference import (
    PreferenceSettings,
    bradley_terry_losses,
    preference_fields,
    preference_gradients,
    reward_model_gradients,
)
from relax.config import RelaxConfig
from relax.core.loops.sync import SFTController
from relax.core.placement import Placement
from relax.data.preference_dataset import pair_samples
from relax.data.sample import Sample
from relax.telemetry.tracking import Tracker


class PairController(SFTController):
    """What both preference loops share: a step's pairs laid out, trained on per-completion fields."""

    async def train_step(self, rollout_id: int) -> dict[str, float]:
        started = time.perf_counter()
        _, pairs = self.roles.rollout.data_source.take(self.cfg.rollout_batch_size)
        samples = pair_samples(pairs)
        fields = await self.step_fields(samples)
        metrics = await self.roles.actor.train(samples, fields)
        self._trained_version = rollout_id + 1
        metrics["perf/train_s"] = metrics["perf/step_s"] = time.perf_counter() - started
        metrics["perf/tokens_per_s"] = sum(len(s.tokens) for s in samples) / metrics["perf/step_s"]
        return metrics

    async def step_fields(self, samples: list[Sample]) -> dict[str, list[torch.Tensor]]:
        """The per-token fields the loss reads for the step's completions ``[chosen_0, rejected_0, ...]``."""
        raise NotImplementedError


class DPOController(PairController):
    """Preference training (``--loss-type dpo``): each step takes the next ``--rollout-batch-size`` pairs, lays them
    out ``[chosen, rejected]``, computes the reference's sequence log-probs (once per pair for the whole run: the
    reference is frozen; none for SimPO) and the policy's at the step's parameters, turns them into each
    completion's loss gradient (`relax.algorithms.preference`) and trains one optimizer step on them."""

    def __init__(self, cfg: RelaxConfig, placement: Placement, tracker: Tracker):
        super().__init__(cfg, placement, tracker)
        self.preference = PreferenceSettings(cfg.dpo_loss, cfg.dpo_beta, cfg.dpo_label_smoothing, cfg.simpo_gamma)
        self._reference_sums: dict[tuple[int, bool], float] = {}  # (row, preferred) -> sequence log-prob

    async def step_fields(self, samples: list[Sample]) -> dict[str, list[torch.Tensor]]:
        masks = [torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples]
        reference = await self._reference_log_prob_sums(samples, masks) if self.preference.needs_reference else None
        policy = await self.roles.actor.compute_log_probs(samples)
        sums = torch.stack([(log_probs.float() * mask).sum() for log_probs, mask in zip(policy.log_probs, masks)])
        step = preference_gradients(self.preference, sums, reference, torch.stack([mask.sum() for mask in masks]))
        return per_token(samples, preference_fields(step))

    async def _reference_log_prob_sums(self, samples: list[Sample], masks: list[torch.Tensor]) -> torch.Tensor:
        keys = [(s.index, bool(s.metadata["preferred"])) for s in samples]
        missing = [i for i, key in enumerate(keys) if key not in self._reference_sums]
        if missing:
            log_probs = await self.roles.reference.compute_log_probs([samples[i] for i in missing])
            for i, values in zip(missing, log_probs):
                self._reference_sums[keys[i]] = float((values.float() * masks[i]).sum())
        return torch.tensor([self._reference_sums[key] for key in keys])


class RewardModelController(PairController):
    """Reward-model training (``--loss-type rm``): the model with a scalar head scores each completion at its last
    token that is not padding (where a sequence-classification model pools); the Bradley-Terry loss (with the pairs'
    margins and ``--center-rewards-coefficient``) is trained through each score's gradient. The evaluation ranks
    the held-out pairs of ``--eval-prompt-data``: ``eval/<set>/pair_accuracy`` (the share of pairs whose chosen
    completion scores higher), ``loss``, ``margin`` and the scores' mean, and ``eval/accuracy`` their mean over
    sets. There is no engine: nothing is generated and no weights are synced."""

    def __init__(self, cfg: RelaxConfig, placement: Placement, tracker: Tracker):
        super().__init__(cfg, placement, tracker)
        # where the model pools a sequence (its config names the pad token: `load_score_model`)
        self.pad_token_id = self.roles.actor.backend.hf_config.pad_token_id

    async def step_fields(self, samples: list[Sample]) -> dict[str, list[torch.Tensor]]:
        positions = [score_position(s, self.pad_token_id) for s in samples]
        scores = await self._scores(samples, positions)
        step = reward_model_gradients(scores, _margins(samples), self.cfg.center_rewards_coefficient)
        fields = per_token(samples, preference_fields(step))
        fields["score_position"] = [torch.nn.functional.one_hot(torch.tensor(p), s.response_length).float()
                                    for p, s in zip(positions, samples)]
        return fields

    async def _scores(self, samples: list[Sample], positions: list[int]) -> torch.Tensor:
        values = await self.roles.actor.compute_values(samples)
        return torch.stack([v[p].float() for v, p in zip(values, positions)])

    async def sync_weights(self, version: int) -> dict[str, float]:
        return {}  # no engine to sync

    async def evaluate(self, step: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for name in self.roles.rollout.eval_sets:
            pairs = await self.roles.rollout.eval_set(name)  # (from the rollout's process under Ray placement)
            samples = pair_samples(copy.deepcopy(pairs))  # (laying out takes each rejected twin out of its pair)
            scores = await self._scores(samples, [score_position(s, self.pad_token_id) for s in samples])
            margins = _margins(samples)
            terms = bradley_terry_losses(scores[0::2].double(), scores[1::2].double(),
                                         margins.double() if margins is not None else None)
            ranked_right = (terms.chosen_rewards > terms.rejected_rewards).double()
            metrics[f"eval/{name}/pair_accuracy"] = float(ranked_right.mean())
            metrics[f"eval/{name}/loss"] = float(terms.losses.mean())
            metrics[f"eval/{name}/margin"] = float((terms.chosen_rewards - terms.rejected_rewards).mean())
            metrics[f"eval/{name}/score_mean"] = float(scores.mean())
        if metrics:
            metrics["eval/accuracy"] = statistics.fmean(value for key, value in metrics.items()
                                                        if key.endswith("/pair_accuracy"))
        return metrics


def per_token(samples: list[Sample], per_completion: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Each completion's scalar of every field carried on each of its response tokens."""
    return {name: [values[i].expand(s.response_length).clone() for i, s in enumerate(samples)]
            for name, values in per_completion.items()}


def score_position(sample: Sample, pad_token_id: int | None) -> int:
    """The response index a reward model scores ``sample`` at: its last token that is not padding (as
    ``AutoModelForSequenceClassification`` pools a sequence; the prompt's tokens are never all the sequence)."""
    response = sample.tokens[len(sample.tokens) - sample.response_length:]
    for index in range(len(response) - 1, -1, -1):
        if response[index] != pad_token_id:
            return index
    raise ValueError(f"row {sample.index}: the completion is all padding (token {pad_token_id}); a reward model "
                     "scores a sequence at its last token that is not padding")


def _margins(samples: list[Sample]) -> torch.Tensor | None:
    chosen = samples[0::2]
    if not chosen or "margin" not in chosen[0].metadata:
        return None
    return torch.tensor([s.metadata["margin"] for s in chosen], dtype=torch.float64)

