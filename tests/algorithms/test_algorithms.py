"""Algorithm formulas pinned on hand-computed numbers."""

import math

import pytest
import torch

from relax.algorithms.advantages import compute_grpo_advantages
from relax.algorithms.aggregation import aggregate_loss
from relax.algorithms.kl import compute_approx_kl
from relax.algorithms.loss import MicroBatchTensors, build_policy_loss_fn
from relax.algorithms.policy_loss import PolicyLossSettings, compute_ppo_clip_loss
from relax.algorithms.spec import get_algorithm

SQRT_HALF = math.sqrt(0.5)


def test_grpo_advantages_normalise_by_group_mean_and_unbiased_std():
    # group [1, 0]: mean 0.5, unbiased std sqrt(0.5) -> ±0.5 / sqrt(0.5) = ±0.70710...
    advantages = compute_grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2)
    expected = torch.tensor([1, -1, -1, 1]) * 0.5 / (SQRT_HALF + 1e-6)
    torch.testing.assert_close(advantages, expected)


def test_dr_grpo_keeps_only_the_mean_baseline():
    advantages = compute_grpo_advantages(torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0, 1.0]), group_size=3, normalize_std=False)
    torch.testing.assert_close(advantages, torch.tensor([1.0, -1.0, 0.0, 1.0, -1.0, 0.0]))


def test_all_equal_group_rewards_give_zero_advantages():
    advantages = compute_grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), group_size=3)
    assert torch.equal(advantages, torch.zeros(6))


def test_grpo_rejects_groups_too_small_and_ragged_groups():
    with pytest.raises(ValueError, match="at least 2"):
        compute_grpo_advantages(torch.tensor([1.0, 0.0]), group_size=1)
    with pytest.raises(ValueError, match="groups of 2"):
        compute_grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), group_size=2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_grpo_rejects_non_finite_rewards(bad):
    with pytest.raises(ValueError, match="non-finite rewards at sample positions \\[1\\]"):
        compute_grpo_advantages(torch.tensor([1.0, bad]), group_size=2)


def test_ppo_clip_with_asymmetric_range():
    log_ratio = torch.log(torch.tensor([[1.5, 1.5, 0.5, 1.0]]))
    advantages = torch.tensor([[1.0, -1.0, -1.0, 2.0]])
    terms = compute_ppo_clip_loss(log_ratio, torch.zeros(1, 4), advantages, eps_clip=0.2, eps_clip_high=0.28)
    # r=1.5, A=1: max(-1.5, -1.28) = -1.28 (clipped); r=1.5, A=-1: max(1.5, 1.28) = 1.5;
    # r=0.5, A=-1: max(0.5, 0.8) = 0.8 (clipped); r=1, A=2: -2.
    torch.testing.assert_close(terms.loss, torch.tensor([[-1.28, 1.5, 0.8, -2.0]]))
    assert terms.clipped.tolist() == [[1.0, 0.0, 1.0, 0.0]]
    torch.testing.assert_close(terms.ppo_kl, -log_ratio)


def test_dual_clip_bounds_negative_advantage_tokens():
    log_ratio = torch.log(torch.tensor([[5.0, 5.0]]))
    advantages = torch.tensor([[-1.0, 1.0]])
    terms = compute_ppo_clip_loss(log_ratio, torch.zeros(1, 2), advantages, 0.2, 0.2, eps_clip_c=3.0)
    # A=-1, r=5: PPO gives max(5, 1.2) = 5, dual-clip caps it at -3·A = 3; A=1 is untouched: -1.2.
    torch.testing.assert_close(terms.loss, torch.tensor([[3.0, -1.2]]))
    assert terms.clipped.tolist() == [[1.0, 1.0]]


def test_kl_estimators():
    log_probs, ref = torch.tensor([0.0]), torch.log(torch.tensor([0.5]))
    log2 = math.log(2)
    torch.testing.assert_close(compute_approx_kl(log_probs, ref, "k1"), torch.tensor([log2]))
    torch.testing.assert_close(compute_approx_kl(log_probs, ref, "k2"), torch.tensor([log2**2 / 2]))
    torch.testing.assert_close(compute_approx_kl(log_probs, ref, "k3"), torch.tensor([0.5 - 1 + log2]))
    # low_var_kl is k3 clamped to [-10, 10]: log_ratio = -20 gives exp(20) - 21, clamped to 10.
    assert compute_approx_kl(torch.tensor([-20.0]), torch.tensor([0.0]), "low_var_kl").item() == 10.0
    with pytest.raises(ValueError, match="unknown KL estimator"):
        compute_approx_kl(log_probs, ref, "k4")


def test_loss_aggregation_modes_and_fully_masked_rows():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    # per-sample means 2, 4, 0 (fully masked) summed over 3 samples of the step
    assert aggregate_loss(values, mask, "seq-mean-token-mean", 3, 4).item() == pytest.approx(2.0)
    # token sum 10 over the step's 4 valid tokens
    assert aggregate_loss(values, mask, "token-mean", 3, 4).item() == pytest.approx(2.5)


def test_micro_batch_shares_sum_to_the_full_batch_loss():
    values = torch.tensor([[1.0, 2.0], [3.0, 5.0], [7.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    for mode in ("seq-mean-token-mean", "token-mean"):
        full = aggregate_loss(values, mask, mode, 3, 5)
        parts = aggregate_loss(values[:1], mask[:1], mode, 3, 5) + aggregate_loss(values[1:], mask[1:], mode, 3, 5)
        torch.testing.assert_close(full, parts)


def _settings(**overrides):
    base = dict(policy_loss="ppo_clip", eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None,
                aggregation="seq-mean-token-mean")
    return PolicyLossSettings(**{**base, **overrides})


def test_loss_fn_combines_policy_kl_and_entropy_terms():
    log_probs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    entropy = torch.tensor([[0.5, 1.5]])
    mb = MicroBatchTensors(
        mask=torch.ones(1, 2),
        fields={"advantages": torch.tensor([[1.0, 1.0]]), "ref_log_probs": torch.tensor([[-1.5, -2.0]])},
        global_num_samples=1, global_num_tokens=2,
    )
    loss_fn = build_policy_loss_fn(_settings(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1", entropy_coef=0.01))
    loss, metrics = loss_fn(mb, log_probs, entropy)
    # on-policy: ratio 1, pg = -mean(A) = -1; k1 KL = mean([0.5, 0]) = 0.25; entropy mean 1.0
    assert metrics["pg_loss"].item() == pytest.approx(-1.0)
    assert metrics["kl_loss"].item() == pytest.approx(0.25)
    assert metrics["entropy"].item() == pytest.approx(1.0)
    assert loss.item() == pytest.approx(-1.0 + 0.1 * 0.25 - 0.01 * 1.0)
    assert metrics["ppo_kl"].item() == 0.0 and metrics["clipfrac"].item() == 0.0
    loss.backward()
    # d/dlp of -A·exp(lp - sg(lp)) / 2 = -0.5; plus 0.1 · d(k1)/dlp / 2 = 0.05
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.45, -0.45]]))


def test_registry_names_known_algorithms():
    assert get_algorithm("grpo").min_group_size == 2
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'"):
        get_algorithm("nope")
