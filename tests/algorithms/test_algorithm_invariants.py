"""Invariants of the advantage and loss functions (issue 14, items 1-6): each defect pinned on the paper's formula
computed by hand, and a property test over generated inputs for the class it belongs to."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.algorithms.advantages import (
    AdvantageInputs,
    compute_grpo_advantages,
    group_leave_one_out,
    group_mean_baseline,
    reinforce_plus_plus_returns,
)
from relax.algorithms.gae import compute_value_loss
from relax.algorithms.loss import MicroBatchTensors, build_policy_loss_fn
from relax.algorithms.policy_loss import MAX_TOKEN_LOG_RATIO, POLICY_LOSSES, PolicyLossSettings, compute_cispo_loss
from relax.algorithms.spec import ALGORITHM_SPECS, get_algorithm
from relax.backends.training.base import TrainBatch
from tests.backends.training.test_fsdp_backend import make_backend, make_batch

GROUP_NORMALIZERS = {"grpo": compute_grpo_advantages,
                     "dr_grpo": lambda r, g: compute_grpo_advantages(r, g, normalize_std=False),
                     "rloo": group_leave_one_out, "group_mean": group_mean_baseline}
finite_floats = st.floats(-1e3, 1e3, allow_nan=False, width=32)


# ---- 1. CISPO's weight is clipped on both sides ------------------------------------------------
def test_cispo_weight_follows_minimax_m1_on_both_signs():
    # log r = [ln 3, ln 0.5], A = [-1, +1], eps 0.2 / 0.28: clip(3, 0.8, 1.28) = 1.28, clip(0.5, 0.8, 1.28) = 0.8
    log_probs = torch.log(torch.tensor([[3.0, 0.5]])).requires_grad_()
    terms = compute_cispo_loss(log_probs, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), 0.2, 0.28)
    terms.loss.sum().backward()
    # d(-sg(c)·A·logπ)/dlogπ = -c·A = [1.28, -0.8]
    torch.testing.assert_close(log_probs.grad, torch.tensor([[1.28, -0.8]]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(-30, 30, allow_nan=False), finite_floats), min_size=1, max_size=16),
       st.floats(0.01, 0.99), st.floats(0.01, 10.0))
def test_cispo_weight_stays_in_its_clip_range(pairs, eps_low, eps_high):
    log_ratio = torch.tensor([[p[0] for p in pairs]])
    advantages = torch.tensor([[p[1] for p in pairs]])
    log_probs = log_ratio.clone().requires_grad_()
    terms = compute_cispo_loss(log_probs, torch.zeros_like(log_ratio), advantages, eps_low, eps_high)
    terms.loss.sum().backward()
    weight = -log_probs.grad  # = coef·A
    nonzero = advantages.abs() > 1e-6  # coef = grad / A loses precision on subnormal A
    coef = weight[nonzero] / advantages[nonzero]
    assert torch.all(coef >= (1 - eps_low) * (1 - 1e-5)) and torch.all(coef <= (1 + eps_high) * (1 + 1e-5))


# ---- 2. REINFORCE++ never discounts across environment tokens ------------------------------------
def test_reinforce_plus_plus_skips_masked_tokens():
    # mask [1, 0, 0, 1], reward 1 on the last token, γ 0.9: G_3 = 1, G_0 = 0.9·G_3 = 0.9 (one step, not three)
    inputs = AdvantageInputs(torch.tensor([1.0]), 1, [torch.tensor([1, 0, 0, 1])], gamma=0.9)
    (returns,) = reinforce_plus_plus_returns(inputs)
    torch.testing.assert_close(returns, torch.tensor([0.9, 0.0, 0.0, 1.0]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 2, allow_nan=False), st.integers(0, 3)), min_size=1, max_size=12),
       st.floats(-2, 2, allow_nan=False), st.floats(0, 1), st.floats(0, 0.5))
def test_masked_tokens_never_change_a_return(valid_tokens, reward, gamma, kl_coef):
    """Environment spans inserted anywhere leave every valid token's return as in the sequence without them."""
    kl_valid = torch.tensor([k for k, _ in valid_tokens])
    compact = AdvantageInputs(torch.tensor([reward]), 1, [torch.ones(len(valid_tokens))], kl=[kl_valid],
                              kl_coef=kl_coef, gamma=gamma)
    (expected,) = reinforce_plus_plus_returns(compact)
    mask, kl = [], []
    for k, gap in valid_tokens:
        mask += [1] + [0] * gap
        kl += [k] + [5.0] * gap  # KL on environment tokens must not count either
    spread = AdvantageInputs(torch.tensor([reward]), 1, [torch.tensor(mask)], kl=[torch.tensor(kl)],
                             kl_coef=kl_coef, gamma=gamma)
    (returns,) = reinforce_plus_plus_returns(spread)
    valid = torch.tensor(mask).bool()
    torch.testing.assert_close(returns[valid], expected, atol=1e-6, rtol=1e-6)
    assert torch.all(returns[~valid] == 0)


# ---- 3. Equal rewards give exact zeros -----------------------------------------------------------
def test_eight_equal_fractional_rewards_give_exact_zeros():
    assert torch.equal(compute_grpo_advantages(torch.full((8,), 0.7), 8), torch.zeros(8))


@settings(max_examples=300, deadline=None)
@given(st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32), st.integers(2, 32),
       st.sampled_from(sorted(GROUP_NORMALIZERS)))
def test_equal_rewards_give_zeros(value, group_size, name):
    other = torch.tensor([0.0, 1.0] * group_size)[:group_size]  # a group with signal beside it
    rewards = torch.cat([torch.full((group_size,), value), other])
    advantages = GROUP_NORMALIZERS[name](rewards, group_size)
    assert torch.equal(advantages[:group_size], torch.zeros(group_size))


@pytest.mark.parametrize("name", sorted(n for n, s in ALGORITHM_SPECS.items() if s.min_group_size >= 2))
def test_every_group_estimator_gives_zero_advantages_to_equal_fractional_rewards(name):
    masks = [torch.ones(3) for _ in range(8)]
    out = get_algorithm(name).compute_advantages(AdvantageInputs(torch.full((8,), 0.7), 8, masks))
    assert torch.equal(torch.stack(out), torch.zeros(8, 3))


# ---- 4. The value clip fraction counts only clipped tokens ----------------------------------------
def test_value_clip_fraction_is_zero_inside_the_range():
    # V - V_old = 0.1 (inside ±0.2) on a value whose V_old + (V - V_old) rounds differently from V
    values = torch.tensor([[0.3, 1.7, -2.9]])
    old = torch.tensor([[0.2, 1.8, -3.0]])
    loss, clipped = compute_value_loss(values, old, torch.tensor([[5.0, -5.0, 0.0]]), value_clip=0.2)
    assert clipped.sum() == 0
    torch.testing.assert_close(loss, 0.5 * (values - torch.tensor([[5.0, -5.0, 0.0]])) ** 2)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(finite_floats, st.floats(-0.99, 0.99), finite_floats), min_size=1, max_size=16),
       st.floats(0.01, 5))
def test_values_within_the_clip_range_are_never_counted_as_clipped(rows, clip):
    old = torch.tensor([[r[0] for r in rows]])
    values = old + clip * torch.tensor([[r[1] for r in rows]])
    returns = torch.tensor([[r[2] for r in rows]])
    inside = (values >= old - clip) & (values <= old + clip)
    _, clipped = compute_value_loss(values, old, returns, value_clip=clip)
    assert torch.all(clipped[inside] == 0)


# ---- 5. M2PO trains on group-normalised advantages -------------------------------------------------
def test_m2po_gives_negative_advantages_to_wrong_answers():
    masks = [torch.ones(2) for _ in range(4)]
    out = get_algorithm("m2po").compute_advantages(AdvantageInputs(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, masks))
    # GRPO: mean 0.25, unbiased std 0.5: [1.5, -0.5, -0.5, -0.5]
    torch.testing.assert_close(torch.stack(out)[:, 0], torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5, rtol=0)


# ---- 6. One extreme log-ratio cannot make the step non-finite ---------------------------------------
def _settings(policy_loss, **kwargs):
    return PolicyLossSettings(policy_loss=policy_loss, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None,
                              aggregation="token-mean", **kwargs)


def test_ppo_loss_of_an_extreme_token_is_bounded_by_the_clamp():
    # A = -1, log r = 25: without a guard the loss is e^25 = 7e10; the ratio is clamped at e^20
    fn = build_policy_loss_fn(_settings("ppo_clip"))
    log_probs = torch.tensor([[25.0, 0.0]], requires_grad=True)
    mb = MicroBatchTensors(mask=torch.ones(1, 2), fields={"advantages": torch.tensor([[-1.0, 1.0]]),
                                                          "old_log_probs": torch.zeros(1, 2)},
                           global_num_samples=1, global_num_tokens=2)
    loss, metrics = fn(mb, log_probs, torch.zeros(1, 2))
    torch.testing.assert_close(loss, torch.tensor((math.exp(MAX_TOKEN_LOG_RATIO) - 1.0) / 2))
    assert metrics["log_ratio_clamped_tokens"] == 1
    loss.backward()
    assert log_probs.grad[0, 0] == 0  # the clamped token passes no gradient


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(POLICY_LOSSES)), st.floats(-1e4, 1e4, allow_nan=False), st.sampled_from([-1.0, 1.0]),
       st.booleans())
def test_one_extreme_token_leaves_every_policy_loss_finite(policy_loss, log_ratio, advantage, use_tis):
    fn = build_policy_loss_fn(_settings(policy_loss, use_tis=use_tis, use_kl_loss=True, kl_loss_coef=0.1,
                                        kl_loss_type="low_var_kl"))
    log_probs = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0 - log_ratio, -1.2, -0.8]])
    mb = MicroBatchTensors(mask=torch.ones(1, 3), global_num_samples=1, global_num_tokens=3, fields={
        "advantages": torch.tensor([[advantage, 0.5, -0.5]]), "old_log_probs": old,
        "rollout_log_probs": old - log_ratio, "ref_log_probs": torch.tensor([[-2.0, -1.0, -1.0]])})
    loss, metrics = fn(mb, log_probs, torch.zeros(1, 3))
    loss.backward()
    assert torch.isfinite(loss) and torch.all(torch.isfinite(log_probs.grad))
    assert all(torch.isfinite(v) for v in metrics.values())


def test_one_extreme_token_leaves_the_training_step_finite(tiny_workspace):
    """Through the real trainer: one token's old log-prob 100 nats off gives a finite loss and grad norm."""
    backend = make_backend(tiny_workspace / "model", micro_batch_size=4)
    batch = make_batch()
    old = [lp.clone() for lp in backend.compute_log_probs(batch).log_probs]
    old[2][0] -= 100.0  # log r = +100 on one negative-advantage token
    batch = TrainBatch(batch.tokens, batch.response_lengths, batch.loss_masks,
                       {**batch.fields, "old_log_probs": old})
    metrics = backend.train_step(batch, build_policy_loss_fn(_settings("ppo_clip")))
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    assert metrics["log_ratio_clamped_tokens"] == 1
