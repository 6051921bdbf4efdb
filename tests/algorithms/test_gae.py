"""PPO's pure functions (relax.algorithms.gae) pinned on hand-computed numbers: KL-shaped token
rewards, GAE (with the masked-token rule) and the clipped value loss."""

import pytest
import torch

from relax.algorithms.advantages import AdvantageInputs, reinforce_plus_plus_returns
from relax.algorithms.gae import compute_gae, compute_gae_batch, compute_value_loss, ppo_token_rewards

GAMMA, LAMBD = 0.9, 0.8  # γλ = 0.72


def _t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def test_gae_hand_computed_four_tokens():
    rewards, values, mask = _t(-0.1, 0.0, 0.0, 1.0), _t(0.5, 0.5, 0.6, 0.8), _t(1, 1, 1, 1)
    # t=3: δ = 1 + 0.9·0 − 0.8 = 0.2;           A = 0.2;                       R = 0.2 + 0.8 = 1.0
    # t=2: δ = 0 + 0.9·0.8 − 0.6 = 0.12;        A = 0.12 + 0.72·0.2 = 0.264;   R = 0.864
    # t=1: δ = 0 + 0.9·0.6 − 0.5 = 0.04;        A = 0.04 + 0.72·0.264 = 0.23008; R = 0.73008
    # t=0: δ = −0.1 + 0.9·0.5 − 0.5 = −0.15;    A = −0.15 + 0.72·0.23008 = 0.0156576; R = 0.5156576
    (advantages,), (returns,) = compute_gae([rewards], [values], [mask], GAMMA, LAMBD)
    torch.testing.assert_close(advantages, _t(0.0156576, 0.23008, 0.264, 0.2))
    torch.testing.assert_close(returns, _t(0.5156576, 0.73008, 0.864, 1.0))


def test_gae_with_unit_gamma_lambda_is_reward_to_go_minus_value():
    torch.manual_seed(0)
    rewards, values = torch.randn(6), torch.randn(6)
    (advantages,), (returns,) = compute_gae([rewards], [values], [torch.ones(6)], 1.0, 1.0)
    # A_t = Σ_{k≥t} r_k − V_t (the values telescope); R_t = Σ_{k≥t} r_k.
    reward_to_go = rewards.flip(0).cumsum(0).flip(0)
    torch.testing.assert_close(advantages, reward_to_go - values)
    torch.testing.assert_close(returns, reward_to_go)


def test_gae_with_lambda_zero_is_the_one_step_td_error():
    rewards, values = _t(0.0, 1.0, 2.0), _t(1.0, 2.0, 3.0)
    (advantages,), _ = compute_gae([rewards], [values], [torch.ones(3)], GAMMA, 0.0)
    # δ = [0 + 0.9·2 − 1, 1 + 0.9·3 − 2, 2 + 0 − 3] = [0.8, 1.7, −1.0]
    torch.testing.assert_close(advantages, _t(0.8, 1.7, -1.0))


def test_gae_skips_a_masked_middle_token():
    # The environment token at t=1 has a reward and value that must never be read.
    rewards, values, mask = _t(0.0, 5.0, 1.0), _t(0.5, 9.0, 0.8), _t(1, 0, 1)
    # t=2: δ = 1 − 0.8 = 0.2; A = 0.2; R = 1.0
    # t=1: masked -> output 0; the bootstrap value (0.8) and advantage (0.2) pass through
    # t=0: δ = 0 + 0.9·0.8 − 0.5 = 0.22 (one γ, not γ²); A = 0.22 + 0.72·0.2 = 0.364; R = 0.864
    (advantages,), (returns,) = compute_gae([rewards], [values], [mask], GAMMA, LAMBD)
    torch.testing.assert_close(advantages, _t(0.364, 0.0, 0.2))
    torch.testing.assert_close(returns, _t(0.864, 0.0, 1.0))
    # Same as GAE on the sequence with the masked token removed.
    (compressed,), _ = compute_gae([_t(0.0, 1.0)], [_t(0.5, 0.8)], [_t(1, 1)], GAMMA, LAMBD)
    torch.testing.assert_close(advantages[mask.bool()], compressed)


def test_gae_trailing_masked_tokens_bootstrap_from_zero():
    rewards, values = _t(0.0, 1.0, 7.0, 7.0), _t(0.5, 0.8, 7.0, 7.0)
    (advantages,), (returns,) = compute_gae([rewards], [values], [_t(1, 1, 0, 0)], GAMMA, LAMBD)
    # Identical to the 2-token sequence [0, 1] / [0.5, 0.8]: A = [0.364, 0.2], R = [0.864, 1.0]
    torch.testing.assert_close(advantages, _t(0.364, 0.2, 0.0, 0.0))
    torch.testing.assert_close(returns, _t(0.864, 1.0, 0.0, 0.0))


def test_gae_fully_masked_and_empty_samples_are_zero_not_nan():
    advantages, returns = compute_gae(
        [_t(1.0, 2.0), torch.zeros(0), _t(0.0, 1.0)],
        [_t(3.0, 4.0), torch.zeros(0), _t(0.5, 0.8)],
        [_t(0, 0), torch.zeros(0), _t(1, 1)],
        GAMMA,
        LAMBD,
    )
    assert [a.shape[0] for a in advantages] == [2, 0, 2]
    assert torch.equal(advantages[0], torch.zeros(2)) and torch.equal(returns[0], torch.zeros(2))
    assert all(torch.isfinite(x).all() for x in advantages + returns)
    torch.testing.assert_close(advantages[2], _t(0.364, 0.2))
    assert compute_gae([], [], [], GAMMA, LAMBD) == ([], [])


def test_gae_ragged_batch_matches_one_sample_at_a_time():
    torch.manual_seed(1)
    lengths = [5, 2, 7]
    rewards = [torch.randn(n) for n in lengths]
    values = [torch.randn(n) for n in lengths]
    masks = [(torch.rand(n) > 0.3).float() for n in lengths]
    batched = compute_gae(rewards, values, masks, GAMMA, LAMBD)
    for i in range(3):
        single = compute_gae([rewards[i]], [values[i]], [masks[i]], GAMMA, LAMBD)
        torch.testing.assert_close(batched[0][i], single[0][0])
        torch.testing.assert_close(batched[1][i], single[1][0])


def test_gae_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="sample 0"):
        compute_gae([_t(1.0, 2.0)], [_t(1.0)], [_t(1, 1)], GAMMA, LAMBD)
    with pytest.raises(ValueError, match="equal \\[B, T\\]"):
        compute_gae_batch(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), GAMMA, LAMBD)


def test_ppo_token_rewards_put_kl_penalty_on_valid_tokens_and_reward_on_the_last():
    rewards = _t(1.0, 0.5, 2.0)
    masks = [_t(1, 1, 0), _t(1, 0, 1, 1), _t(0, 0)]
    kl = [_t(0.1, 0.2, 0.3), _t(0.5, 0.5, 0.5, -0.2), _t(1.0, 1.0)]
    out = ppo_token_rewards(rewards, masks, kl, kl_coef=0.1)
    # sample 0: −0.1·[0.1, 0.2, masked] = [−0.01, −0.02, 0]; +1 on t=1 (last valid) -> [−0.01, 0.98, 0]
    torch.testing.assert_close(out[0], _t(-0.01, 0.98, 0.0))
    # sample 1: −0.1·[0.5, masked, 0.5, −0.2] = [−0.05, 0, −0.05, 0.02]; +0.5 on t=3 -> 0.52
    torch.testing.assert_close(out[1], _t(-0.05, 0.0, -0.05, 0.52))
    # sample 2: no valid token -> zeros, the reward is dropped
    assert torch.equal(out[2], torch.zeros(2))
    sparse = ppo_token_rewards(rewards, masks, None, kl_coef=0.1)
    assert [x.tolist() for x in sparse] == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.5], [0.0, 0.0]]
    with pytest.raises(ValueError, match="3 rewards for 2 masks"):
        ppo_token_rewards(rewards, masks[:2])


def test_gae_with_zero_values_and_unit_gamma_lambda_matches_reinforce_plus_plus_returns():
    rewards = _t(1.0, -1.0)
    masks = [_t(1, 0, 1, 1), _t(1, 1, 0)]
    kl = [_t(0.5, 0.5, 0.5, -0.2), _t(0.1, 0.2, 0.3)]
    token_rewards = ppo_token_rewards(rewards, masks, kl, kl_coef=0.1)
    advantages, _ = compute_gae(token_rewards, [torch.zeros_like(m) for m in masks], masks, 1.0, 1.0)
    expected = reinforce_plus_plus_returns(AdvantageInputs(rewards, 1, masks, kl=kl, kl_coef=0.1, gamma=1.0))
    for a, e, m in zip(advantages, expected, masks):
        torch.testing.assert_close(a[m.bool()], e[m.bool()])


def test_value_loss_clipped_and_unclipped_cases_and_clipfrac():
    values = torch.tensor([[1.0, 1.0, 0.0, 2.0]])
    old_values = torch.tensor([[0.5, 0.5, 0.0, 2.0]])
    returns = torch.tensor([[2.0, 0.0, 1.0, 2.0]])
    loss, clipped = compute_value_loss(values, old_values, returns, value_clip=0.2)
    # t0: V_clip = 0.5 + clip(0.5, ±0.2) = 0.7; (1−2)² = 1, (0.7−2)² = 1.69 -> 0.5·1.69 = 0.845, clipped
    # t1: V_clip = 0.7; (1−0)² = 1, (0.7−0)² = 0.49 -> 0.5·1 = 0.5; moved past the clip but not binding
    # t2: V = V_old = 0; both (0−1)² = 1 -> 0.5, a tie is not clipped
    # t3: V = R -> 0
    torch.testing.assert_close(loss, torch.tensor([[0.845, 0.5, 0.5, 0.0]]))
    assert clipped.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert clipped.mean().item() == 0.25  # the clip fraction over 4 valid tokens

    plain, none_clipped = compute_value_loss(values, old_values, returns, value_clip=None)
    torch.testing.assert_close(plain, torch.tensor([[0.5, 0.5, 0.5, 0.0]]))  # 0.5·(V − R)²
    assert torch.equal(none_clipped, torch.zeros(1, 4))


def test_value_loss_gradient_flows_through_the_active_branch():
    values = torch.tensor([[1.0, 1.0]], requires_grad=True)
    loss, _ = compute_value_loss(values, torch.tensor([[0.5, 0.5]]), torch.tensor([[2.0, 0.0]]), value_clip=0.2)
    loss.sum().backward()
    # t0: clipped branch active and V_clip is constant in V (outside the clip range) -> 0
    # t1: unclipped branch, d/dV 0.5·(V − 0)² = V = 1
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 1.0]]))
