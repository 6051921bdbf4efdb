"""Preference losses (issue 34) against TRL 1.16's `DPOTrainer` loss code on the same batch, in float32: the loss, the
implicit rewards and the gradient with respect to every token's log-prob, for DPO (sigmoid), IPO and the
reference-free length-normalised variant; the gradient surrogate that lets any micro-batch split train exactly. The
reward model's Bradley-Terry loss (with margins and the centring term) against TRL's `RewardTrainer.compute_loss`."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.algorithms.loss import MicroBatchTensors, build_preference_loss_fn, build_reward_model_loss_fn
from relax.algorithms.preference import (
    PREFERENCE_FIELDS,
    PreferenceSettings,
    bradley_terry_losses,
    preference_fields,
    preference_gradients,
    preference_losses,
    reward_model_gradients,
)

import trl  # noqa: E402  (the bench extra, part of the test extra)


def _batch(pairs: int, seed: int):
    """TRL's layout: [chosen..., rejected...] rows of prompt + completion + padding; per-token log-probs (shifted by
    one, zero outside the completion, as TRL's fused head returns them) and the reference's sequence log-probs."""
    generator = torch.Generator().manual_seed(seed)
    rows, width = 2 * pairs, 12
    completion_mask = torch.zeros(rows, width, dtype=torch.long)
    for row in range(rows):
        prompt = int(torch.randint(1, 4, (1,), generator=generator))
        length = int(torch.randint(1, width - prompt, (1,), generator=generator))
        completion_mask[row, prompt:prompt + length] = 1
    shifted = completion_mask[:, 1:]
    token_logps = (-torch.rand(rows, width - 1, generator=generator) * 3) * shifted
    ref = token_logps.sum(1) + torch.randn(rows, generator=generator)
    return completion_mask, token_logps, ref


def _trl(loss_type: str, beta: float, completion_mask, token_logps, ref):
    trainer = object.__new__(trl.DPOTrainer)
    identity = lambda tensor: tensor  # noqa: E731  (one process: gathering is the identity)
    trainer.__dict__.update(
        model=SimpleNamespace(training=True), accelerator=SimpleNamespace(device="cpu", gather=identity,
                                                                           gather_for_metrics=identity),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=0.0, use_weighting=False,
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    log_probs = token_logps.clone().requires_grad_(True)
    zeros = torch.zeros_like(log_probs)
    outputs = SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())
    chosen_ref, rejected_ref = ref.chunk(2)
    inputs = {"input_ids": torch.ones_like(completion_mask), "attention_mask": torch.ones_like(completion_mask),
              "completion_mask": completion_mask, "ref_chosen_logps": chosen_ref, "ref_rejected_logps": rejected_ref}
    loss = trainer._compute_loss(lambda **kwargs: outputs, inputs, return_outputs=False)
    (gradient,) = torch.autograd.grad(loss, log_probs)
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return loss.item(), gradient, metrics


def _interleave(tensor: torch.Tensor) -> torch.Tensor:
    chosen, rejected = tensor.chunk(2)
    return torch.stack([chosen, rejected], dim=1).flatten(0, 1)


def _ours(settings: PreferenceSettings, completion_mask, token_logps, ref):
    """The trainer's path: the step's gradients first, then the loss function on micro-batches of one completion
    each (the most split a pair can be), summed."""
    logps, lengths = _interleave(token_logps), _interleave(completion_mask.sum(1))
    mask = _interleave(completion_mask[:, 1:])
    step = preference_gradients(settings, logps.sum(1), _interleave(ref) if settings.needs_reference else None,
                                lengths)
    values = preference_fields(step)
    loss_fn = build_preference_loss_fn()
    log_probs = logps.clone().requires_grad_(True)
    totals: dict[str, float] = defaultdict(float)
    surrogate = 0.0
    for row in range(len(logps)):
        fields = {name: values[name][row:row + 1, None].expand(1, logps.shape[1]) for name in PREFERENCE_FIELDS}
        mb = MicroBatchTensors(mask=mask[row:row + 1], fields=fields, global_num_samples=len(logps))
        loss, metrics = loss_fn(mb, log_probs[row:row + 1], None)
        surrogate = surrogate + loss
        for name, value in metrics.items():
            totals[name] += float(value)
    (gradient,) = torch.autograd.grad(surrogate, log_probs)
    chosen, rejected = gradient[0::2], gradient[1::2]
    return totals, torch.cat([chosen, rejected])  # back to TRL's layout


@settings(max_examples=30, deadline=None)
@given(pairs=st.integers(1, 6), seed=st.integers(0, 2**31), beta=st.sampled_from([0.01, 0.1, 0.5, 2.0]),
       kind=st.sampled_from([("sigmoid", "sigmoid"), ("ipo", "ipo"), ("simpo", "sigmoid_norm")]))
def test_loss_rewards_and_gradients_equal_trl(pairs, seed, beta, kind):
    ours_name, trl_name = kind
    completion_mask, token_logps, ref = _batch(pairs, seed)
    if ours_name == "simpo":  # reference-free: TRL's sigmoid_norm with the reference's log-probs at zero
        ref = torch.zeros_like(ref)
    trl_loss, trl_gradient, trl_metrics = _trl(trl_name, beta, completion_mask, token_logps, ref)
    totals, gradient = _ours(PreferenceSettings(loss=ours_name, beta=beta), completion_mask, token_logps, ref)
    assert totals["loss"] == pytest.approx(trl_loss, rel=1e-6, abs=1e-6)
    # on the completion's tokens (TRL's fused head gives the other positions no log-prob, hence no gradient)
    completion = completion_mask[:, 1:].float()
    torch.testing.assert_close(gradient * completion, trl_gradient * completion, rtol=1e-6, atol=1e-6)
    assert gradient.abs().sum() > 0
    if ours_name != "simpo":  # TRL's rewards are β·log-ratios; SimPO's are length-normalised (module doc)
        for ours_key, trl_key in (("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected"),
                                  ("rewards_margin", "rewards/margins"), ("rewards_accuracy", "rewards/accuracies")):
            assert totals[ours_key] == pytest.approx(trl_metrics[trl_key], rel=1e-6, abs=1e-6), ours_key
    assert totals["logps_chosen"] == pytest.approx(trl_metrics["logps/chosen"], rel=1e-6, abs=1e-6)


def test_label_smoothing_and_the_simpo_margin_follow_their_formulas():
    c, r = torch.tensor([-3.0, -1.0]), torch.tensor([-2.0, -4.0])
    rc, rr = torch.tensor([-2.5, -2.0]), torch.tensor([-2.5, -3.0])
    lc, lr = torch.tensor([3.0, 2.0]), torch.tensor([4.0, 1.0])
    beta, eps, gamma = 0.5, 0.2, 0.3
    dpo = preference_losses(PreferenceSettings("sigmoid", beta, eps), c, r, rc, rr, lc, lr)
    z = beta * ((c - rc) - (r - rr))
    expected = -(1 - eps) * torch.nn.functional.logsigmoid(z) - eps * torch.nn.functional.logsigmoid(-z)
    torch.testing.assert_close(dpo.losses, expected)
    simpo = preference_losses(PreferenceSettings("simpo", beta, 0.0, gamma), c, r, None, None, lc, lr)
    torch.testing.assert_close(simpo.losses, -torch.nn.functional.logsigmoid(beta * (c / lc - r / lr) - gamma))
    torch.testing.assert_close(simpo.chosen_rewards, beta * c / lc)
    with pytest.raises(ValueError, match="needs the reference model"):
        preference_losses(PreferenceSettings("ipo"), c, r, None, None, lc, lr)
    with pytest.raises(ValueError, match="in pairs"):
        preference_gradients(PreferenceSettings(), torch.zeros(3), torch.zeros(3), torch.ones(3))


def _trl_reward(scores: torch.Tensor, margins: torch.Tensor | None, center: float | None):
    """TRL's RewardTrainer.compute_loss on a "model" whose logits are ``scores`` ([chosen..., rejected...])."""
    trainer = object.__new__(trl.RewardTrainer)
    identity = lambda tensor: tensor  # noqa: E731
    trainer.__dict__.update(
        model=SimpleNamespace(training=True), args=SimpleNamespace(center_rewards_coefficient=center),
        accelerator=SimpleNamespace(device="cpu", gather=identity, gather_for_metrics=identity),
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    logits = scores.clone().unsqueeze(-1).requires_grad_(True)
    inputs = {"attention_mask": torch.ones(len(scores), 3, dtype=torch.long)}
    if margins is not None:
        inputs["margin"] = margins
    loss = trainer.compute_loss(lambda **kwargs: SimpleNamespace(logits=logits), inputs)
    (gradient,) = torch.autograd.grad(loss, logits)
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return loss.item(), gradient.squeeze(-1), metrics


@settings(max_examples=40, deadline=None)
@given(pairs=st.integers(1, 8), seed=st.integers(0, 2**31), with_margin=st.booleans(),
       center=st.sampled_from([None, 0.01, 0.5]), width=st.integers(1, 5))
def test_reward_model_loss_and_gradients_equal_trl(pairs, seed, with_margin, center, width):
    """Per completion, its score sits at a marked token of a row of ``width`` values; each micro-batch holds one
    completion (a pair split as far as it can be); the summed surrogate's gradient is TRL's."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(2 * pairs, generator=generator) * 3
    margins = torch.rand(pairs, generator=generator) * 2 if with_margin else None
    trl_loss, trl_gradient, trl_metrics = _trl_reward(scores, margins, center)

    interleaved = _interleave(scores)
    step = reward_model_gradients(interleaved, margins, center or 0.0)
    values = preference_fields(step)
    positions = torch.randint(0, width, (2 * pairs,), generator=generator)
    rows = torch.randn(2 * pairs, width, generator=generator)
    rows[torch.arange(2 * pairs), positions] = interleaved
    rows.requires_grad_(True)
    loss_fn = build_reward_model_loss_fn()
    totals: dict[str, float] = defaultdict(float)
    surrogate = 0.0
    for row in range(2 * pairs):
        fields = {name: values[name][row:row + 1, None].expand(1, width) for name in PREFERENCE_FIELDS}
        fields["score_position"] = torch.nn.functional.one_hot(positions[row:row + 1], width).float()
        mb = MicroBatchTensors(mask=torch.ones(1, width), fields=fields, global_num_samples=2 * pairs)
        loss, metrics = loss_fn(mb, rows[row:row + 1], None)
        surrogate = surrogate + loss
        for name, value in metrics.items():
            totals[name] += float(value)
    (gradient,) = torch.autograd.grad(surrogate, rows)
    at_scores = gradient[torch.arange(2 * pairs), positions]
    torch.testing.assert_close(torch.cat([at_scores[0::2], at_scores[1::2]]), trl_gradient, rtol=1e-6, atol=1e-6)
    assert gradient.abs().sum() == pytest.approx(at_scores.abs().sum(), rel=1e-6)  # only the scored tokens learn
    assert totals["loss"] == pytest.approx(trl_loss, rel=1e-6, abs=1e-6)
    assert totals["rewards_accuracy"] == pytest.approx(trl_metrics["accuracy"], rel=1e-6, abs=1e-6)
    assert totals["rewards_margin"] == pytest.approx(trl_metrics["margin"], rel=1e-5, abs=1e-5)


def test_bradley_terry_follows_its_formula():
    chosen, rejected, margin = torch.tensor([2.0, -1.0]), torch.tensor([0.5, 1.0]), torch.tensor([1.0, 0.0])
    terms = bradley_terry_losses(chosen, rejected, margin, center_coefficient=0.1)
    expected = -torch.nn.functional.logsigmoid(chosen - rejected - margin) + 0.1 * (chosen + rejected) ** 2
    torch.testing.assert_close(terms.losses, expected)
    torch.testing.assert_close(terms.chosen_rewards, chosen)
    with pytest.raises(ValueError, match="in pairs"):
        reward_model_gradients(torch.zeros(5))
