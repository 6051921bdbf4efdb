"""The algorithm family beyond GRPO (issue 3): estimators, policy losses, TIS and aggregation
pinned on hand-computed numbers, config rules, and a two-step in-process run per algorithm."""

import asyncio
import math

import pytest
import torch

from relax.algorithms.advantages import (
    AdvantageInputs,
    compute_grpo_advantages,
    group_leave_one_out,
    group_mean_baseline,
    reinforce_plus_plus_returns,
    whiten_over_valid_tokens,
)
from relax.algorithms.aggregation import aggregate_loss
from relax.algorithms.loss import MicroBatchTensors, build_policy_loss_fn
from relax.algorithms.policy_loss import (
    POLICY_LOSSES,
    PolicyLossSettings,
    compute_cispo_loss,
    compute_gspo_loss,
    compute_m2po_loss,
    compute_rloo_loss,
    compute_sapo_loss,
    compute_tis_weights,
    water_fill_cap,
)
from relax.algorithms.spec import ALGORITHM_SPECS, get_algorithm
from relax.cli.args import parse_config
from relax.config import ConfigError
from tests.support.runs import tiny_train_args

SQRT2 = math.sqrt(2.0)
NEW_ALGORITHMS = ("gspo", "sapo", "cispo", "m2po", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def _inputs(rewards, group_size, masks=None, **kwargs):
    rewards = torch.tensor(rewards, dtype=torch.float32)
    masks = masks if masks is not None else [torch.ones(2) for _ in rewards]
    return AdvantageInputs(rewards=rewards, group_size=group_size, response_masks=masks, **kwargs)


# ---- advantage estimators ----------------------------------------------------------------
def test_rloo_leave_one_out_baseline():
    # group [1, 0, 0, 0]: mean 0.25; A = 4/3·(r - 0.25) = [1, -1/3, -1/3, -1/3],
    # i.e. r_0 - mean(0, 0, 0) = 1 and r_1 - mean(1, 0, 0) = -1/3.
    advantages = group_leave_one_out(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4)
    torch.testing.assert_close(advantages, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))


def test_group_mean_baseline_keeps_the_scale():
    # groups [3, 1] (mean 2) and [2, 2] (mean 2): r - mean, no std division
    advantages = group_mean_baseline(torch.tensor([3.0, 1.0, 2.0, 2.0]), group_size=2)
    torch.testing.assert_close(advantages, torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_reinforce_plus_plus_discounted_return_with_kl_shaping():
    # mask [1, 1, 0], kl [0.5, 1, 2], kl_coef 0.1: token rewards [-0.05, -0.1, 0] (the masked KL drops);
    # reward 1 on the last valid token (index 1): [-0.05, 0.9, 0];
    # γ = 0.5: G_2 = 0, G_1 = 0.9, G_0 = -0.05 + 0.5·0.9 = 0.4
    inputs = _inputs([1.0], 1, masks=[torch.tensor([1, 1, 0])], kl=[torch.tensor([0.5, 1.0, 2.0])],
                     kl_coef=0.1, gamma=0.5)
    (returns,) = reinforce_plus_plus_returns(inputs)
    torch.testing.assert_close(returns, torch.tensor([0.4, 0.9, 0.0]))


def test_global_token_whitening_over_valid_tokens_only():
    # valid tokens 1, 3, 5: mean 3, population variance 8/3 -> scale sqrt(3/8); masked tokens -> 0
    out = whiten_over_valid_tokens([torch.tensor([1.0, 3.0]), torch.tensor([5.0, 100.0])],
                                   [torch.tensor([1, 1]), torch.tensor([1, 0])])
    scale = math.sqrt(3 / 8)
    torch.testing.assert_close(out[0], torch.tensor([-2 * scale, 0.0]))
    torch.testing.assert_close(out[1], torch.tensor([2 * scale, 0.0]))


def test_reinforce_plus_plus_baseline_pipeline():
    # groups [1, 0] -> [0.5, -0.5] and [1, 1] -> [0, 0], two tokens each: tokens ±0.5 (4) and 0 (4);
    # mean 0, variance 4·0.25/8 = 0.125 -> ±0.5/sqrt(0.125) = ±sqrt(2)
    out = get_algorithm("reinforce_plus_plus_baseline").compute_advantages(_inputs([1.0, 0.0, 1.0, 1.0], 2))
    torch.testing.assert_close(torch.stack(out), torch.tensor([[SQRT2] * 2, [-SQRT2] * 2, [0.0] * 2, [0.0] * 2]))


def test_grpo_family_broadcasts_the_grpo_values_unchanged():
    rewards = [1.0, 0.0, 0.0, 1.0]
    expected = compute_grpo_advantages(torch.tensor(rewards), 2)
    for name in ("grpo", "gspo", "sapo", "cispo", "m2po"):
        out = get_algorithm(name).compute_advantages(_inputs(rewards, 2, masks=[torch.ones(3)] * 4))
        torch.testing.assert_close(torch.stack(out), expected[:, None].expand(4, 3))


@pytest.mark.parametrize("name", ["gspo", "sapo", "cispo", "rloo", "reinforce_plus_plus_baseline"])
def test_all_equal_group_rewards_give_zero_advantages(name):
    out = get_algorithm(name).compute_advantages(_inputs([1.0, 1.0, 0.0, 0.0], 2))
    assert torch.equal(torch.stack(out), torch.zeros(4, 2))


@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus_baseline", "gspo"])
def test_groups_too_small_are_rejected(name):
    with pytest.raises(ValueError, match="at least 2 samples per prompt"):
        get_algorithm(name).compute_advantages(_inputs([1.0, 0.0], 1))


@pytest.mark.parametrize("name", NEW_ALGORITHMS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_rewards_are_rejected(name, bad):
    with pytest.raises(ValueError, match="non-finite rewards at sample positions \\[1\\]"):
        get_algorithm(name).compute_advantages(_inputs([1.0, bad], 2))


@pytest.mark.parametrize("name", NEW_ALGORITHMS)
def test_fully_masked_sequences_contribute_zero(name):
    masks = [torch.zeros(2), torch.ones(2), torch.zeros(2), torch.ones(2)]
    kl = [torch.ones(2)] * 4
    out = get_algorithm(name).compute_advantages(_inputs([1.0, 0.0, 0.0, 1.0], 2, masks=masks, kl=kl, kl_coef=0.1))
    assert all(torch.isfinite(a).all() for a in out)
    if get_algorithm(name).whiten_advantages:
        assert torch.equal(out[0], torch.zeros(2)) and torch.equal(out[2], torch.zeros(2))
    # nothing valid at all: zeros, not NaN
    all_masked = [torch.zeros(2)] * 4
    out = get_algorithm(name).compute_advantages(_inputs([1.0, 0.0, 0.0, 1.0], 2, masks=all_masked))
    assert all(torch.isfinite(a).all() for a in out)


# ---- policy losses -------------------------------------------------------------------------
def test_gspo_clips_the_sequence_level_ratio():
    log_probs = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.5, -2.5, 9.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    advantages = torch.ones(2, 3)
    terms = compute_gspo_loss(log_probs, old, advantages, mask, eps_clip=0.2, eps_clip_high=0.2)
    # row 0: mean(old - new) over the 2 valid tokens = -0.5 -> ratio e^0.5 = 1.65 -> clipped: -1.2 per token.
    # row 1 is fully masked: ppo_kl 0, ratio 1 -> -1.
    torch.testing.assert_close(terms.ppo_kl, torch.tensor([[-0.5] * 3, [0.0] * 3]))
    torch.testing.assert_close(terms.loss, torch.tensor([[-1.2] * 3, [-1.0] * 3]))
    assert terms.clipped.tolist() == [[1.0] * 3, [0.0] * 3]


def test_sapo_soft_gate_values_and_gradient():
    log_probs = torch.log(torch.tensor([[1.0, 1.0, 2.0]])).requires_grad_()
    advantages = torch.tensor([[1.0, -1.0, 1.0]])
    terms = compute_sapo_loss(log_probs, torch.zeros(1, 3), advantages, tau_pos=1.0, tau_neg=2.0)
    # r=1, A=1, τ=1: f = 4·σ(0) = 2 -> -2; r=1, A=-1, τ=2: f = (4/2)·0.5 = 1 -> +1;
    # r=2, A=1, τ=1: f = 4·σ(1) = 2.92423 -> -2.92423
    sig1 = 1 / (1 + math.exp(-1))
    torch.testing.assert_close(terms.loss, torch.tensor([[-2.0, 1.0, -4 * sig1]]))
    # gate slope 4σ(1-σ): 1 at r=1, 4·0.731·0.269 = 0.786 < 0.9 at r=2 (the clipfrac proxy)
    assert terms.clipped.tolist() == [[0.0, 0.0, 1.0]]
    terms.loss.sum().backward()
    # dloss/dlogp = -A·f'(r)·r: -1, +1, -(4σ(1)(1-σ(1)))·2
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-1.0, 1.0, -8 * sig1 * (1 - sig1)]]))


def test_cispo_clips_the_weight_and_keeps_every_gradient():
    ratios = torch.tensor([[1.5, 0.5, 1.5]])
    log_probs = torch.log(ratios).requires_grad_()
    advantages = torch.tensor([[1.0, -1.0, -1.0]])
    terms = compute_cispo_loss(log_probs, torch.zeros(1, 3), advantages, eps_clip=0.2, eps_clip_high=0.28)
    # MiniMax-M1 eq. 5: coef = clip(r, 0.8, 1.28) whatever the sign of A: [1.28, 0.8, 1.28]
    coef = torch.tensor([[1.28, 0.8, 1.28]])
    torch.testing.assert_close(terms.loss, -coef * advantages * torch.log(ratios))
    assert terms.clipped.tolist() == [[1.0, 1.0, 1.0]]
    terms.loss.sum().backward()
    # sg(coef)·sg(A): the gradient on log π is exactly -coef·A, also on the truncated tokens
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-1.28, 0.8, 1.28]]))


def test_rloo_loss_is_unclipped_reinforce():
    log_probs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    terms = compute_rloo_loss(log_probs, torch.tensor([[-3.0, 0.0]]), torch.tensor([[2.0, -1.0]]))
    torch.testing.assert_close(terms.loss, torch.tensor([[2.0, -2.0]]))  # -A·logp
    assert terms.clipped.sum().item() == 0.0
    terms.loss.sum().backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-2.0, 1.0]]))


def test_water_filling_cap():
    # [1, 4, 9] to a total of 6: keep 1, cap the rest at c with 1 + 2c = 6 -> c = 2.5
    assert water_fill_cap(torch.tensor([4.0, 1.0, 9.0]), 6.0) == pytest.approx(2.5)


def test_m2po_band_from_the_second_moment_budget():
    # harmful (A>0, r>1): log-ratios 0.05, 0.2, 0.3 -> δ² 0.0025, 0.04, 0.09; M2 = 0.04417 > 0.01.
    # Water-fill to 0.01·3 = 0.03: keep 0.0025, cap the others at (0.03 - 0.0025)/2 = 0.01375; τ = 0.11726.
    # Token 3 (A<0, r>1) is not harmful; token 4 is masked (its drift must not count).
    log_ratio = torch.tensor([[0.05, 0.2, 0.3, 0.5, 3.0]])
    advantages = torch.tensor([[1.0, 1.0, 1.0, -1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    terms = compute_m2po_loss(log_ratio, torch.zeros(1, 5), advantages, mask, 0.01, miniclip_low=0.3,
                              miniclip_high=0.05)
    tau = math.sqrt(0.01375)
    assert terms.m2_before == pytest.approx(0.1325 / 3)
    assert terms.m2_after == pytest.approx(0.01)  # the budget exactly
    assert terms.eps_low == pytest.approx(0.3)  # max(1 - e^-τ = 0.11, 0.3)
    assert terms.eps_high == pytest.approx(math.exp(tau) - 1)  # max(0.124, 0.05)
    # r = e^0.05 is inside the band; e^0.2 and e^0.3 are clipped to e^τ; A<0 with r = e^0.5: max(r, clip) = r
    expected = torch.tensor([[-math.exp(0.05), -math.exp(tau), -math.exp(tau), math.exp(0.5), -math.exp(tau)]])
    torch.testing.assert_close(terms.loss, expected)
    assert terms.clipped.tolist() == [[0.0, 1.0, 1.0, 0.0, 1.0]]


def test_m2po_within_budget_clips_nothing():
    log_ratio = torch.tensor([[0.01, -0.02]])
    terms = compute_m2po_loss(log_ratio, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2),
                              0.01, 0.3, 0.5)
    # M2 = (1e-4 + 4e-4)/2 ≤ 0.01: band = miniclip, loss = -r·A
    assert (terms.eps_low, terms.eps_high) == (pytest.approx(0.3), pytest.approx(0.5))
    torch.testing.assert_close(terms.loss, torch.tensor([[-math.exp(0.01), math.exp(-0.02)]]))
    assert terms.clipped.sum().item() == 0.0


def test_tis_weights_are_truncated_and_detached():
    old = torch.zeros(1, 3, requires_grad=True)
    rollout = torch.tensor([[-math.log(3.0), math.log(2.0), 0.0]])
    tis = compute_tis_weights(old, rollout, clip_low=0.6, clip_high=2.0)
    # exp(old - rollout) = [3, 0.5, 1] -> clamp to [0.6, 2]: [2, 0.6, 1]
    torch.testing.assert_close(tis.weights, torch.tensor([[2.0, 0.6, 1.0]]))
    assert tis.clipped.tolist() == [[1.0, 1.0, 0.0]] and not tis.weights.requires_grad


def _settings(**overrides):
    base = dict(policy_loss="ppo_clip", eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None,
                aggregation="seq-mean-token-mean")
    return PolicyLossSettings(**{**base, **overrides})


def test_loss_fn_weights_the_policy_loss_by_tis():
    log_probs = torch.zeros(1, 3, requires_grad=True)
    mb = MicroBatchTensors(
        mask=torch.ones(1, 3),
        fields={"advantages": torch.ones(1, 3),
                "rollout_log_probs": torch.tensor([[-math.log(3.0), math.log(2.0), 0.0]])},
    )
    loss, metrics = build_policy_loss_fn(_settings(use_tis=True, tis_clip=2.0, tis_clip_low=0.6))(
        mb, log_probs, torch.zeros(1, 3))
    # on-policy ratio 1, A = 1: per token -w = [-2, -0.6, -1], mean -1.2
    assert loss.item() == pytest.approx(-1.2)
    assert metrics["tis"].item() == pytest.approx(1.2) and metrics["tis_clipfrac"].item() == pytest.approx(2 / 3)
    loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-2 / 3, -0.2, -1 / 3]]))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_dispatches_and_is_finite_on_padding(name):
    log_probs = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    mb = MicroBatchTensors(mask=torch.tensor([[1, 1], [0, 0]]),
                           fields={"advantages": torch.tensor([[1.0, 1.0], [0.0, 0.0]]),
                                   "old_log_probs": torch.tensor([[-1.1, -1.9], [0.0, 0.0]])},
                           global_num_samples=2, global_num_tokens=2)
    loss, metrics = build_policy_loss_fn(_settings(policy_loss=name))(mb, log_probs, torch.zeros(2, 2))
    assert all(math.isfinite(v.item()) for v in metrics.values())
    loss.backward()
    assert torch.isfinite(log_probs.grad).all() and log_probs.grad[1].abs().sum() == 0


def test_m2po_micro_batch_scalars_sum_to_the_step_mean():
    fn = build_policy_loss_fn(_settings(policy_loss="m2po", m2po_miniclip_low=0.3, m2po_miniclip_high=0.5))
    mb = MicroBatchTensors(mask=torch.ones(1, 1), fields={"advantages": torch.ones(1, 1)}, global_num_samples=2)
    # two micro-batches of one sample each, both within budget: eps_high = 0.5 each, the step's mean 0.5
    total = sum(fn(mb, torch.zeros(1, 1), torch.zeros(1, 1))[1]["m2po_eps_high"] for _ in range(2))
    assert total.item() == pytest.approx(0.5)


# ---- aggregation ---------------------------------------------------------------------------
def test_token_sum_aggregation_modes():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    # token sums 6, 4, 0 over 3 samples
    assert aggregate_loss(values, mask, "seq-mean-token-sum", 3, 4).item() == pytest.approx(10 / 3)
    # Dr.GRPO: divided by the constant 4 (max response length) too
    normed = aggregate_loss(values, mask, "seq-mean-token-sum-norm", 3, 4, max_response_len=4)
    assert normed.item() == pytest.approx(10 / 12)
    for mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        full = aggregate_loss(values, mask, mode, 3, 4, 4)
        parts = (aggregate_loss(values[:1], mask[:1], mode, 3, 4, 4)
                 + aggregate_loss(values[1:], mask[1:], mode, 3, 4, 4))
        torch.testing.assert_close(full, parts)
    with pytest.raises(ValueError, match="max_response_len"):
        aggregate_loss(values, mask, "seq-mean-token-sum-norm", 3, 4)


# ---- registry and config ---------------------------------------------------------------------
def test_registry_entries_name_their_paper_and_known_losses():
    for name in NEW_ALGORITHMS:
        spec = ALGORITHM_SPECS[name]
        assert spec.paper and spec.policy_loss in POLICY_LOSSES


GOOD = ["--n-samples-per-prompt", "4", "--num-rollout", "3", "--rollout-batch-size", "2"]


def _config_error(*extra):
    with pytest.raises(ConfigError) as err:
        parse_config(GOOD + list(extra))
    return str(err.value)


def test_config_rules_name_the_flags():
    message = _config_error("--advantage-estimator", "rloo", "--n-samples-per-prompt", "1")
    assert "--n-samples-per-prompt >= 2" in message
    message = _config_error("--advantage-estimator", "rloo", "--global-batch-size", "4")
    assert "one optimizer step per rollout" in message and "--global-batch-size" in message
    message = _config_error("--advantage-estimator", "reinforce_plus_plus", "--kl-coef", "0.1", "--use-kl-loss",
                            "--kl-loss-coef", "0.1")
    assert "--kl-coef" in message and "--kl-loss-coef" in message
    assert "--kl-coef" in _config_error("--kl-coef", "0.1")  # grpo ignores a reward KL
    message = _config_error("--calculate-per-token-loss", "--loss-agg-mode", "seq-mean-token-sum")
    assert "--calculate-per-token-loss" in message and "--loss-agg-mode" in message


def test_loss_agg_mode_defaults_keep_todays_behaviour():
    assert parse_config(GOOD).loss_aggregation == "seq-mean-token-mean"
    assert parse_config(GOOD + ["--calculate-per-token-loss"]).loss_aggregation == "token-mean"
    both = parse_config(GOOD + ["--calculate-per-token-loss", "--loss-agg-mode", "token-mean"])
    assert both.loss_aggregation == "token-mean"
    dr_grpo = parse_config(GOOD + ["--loss-agg-mode", "seq-mean-token-sum-norm"])
    assert dr_grpo.loss_aggregation == "seq-mean-token-sum-norm"


# ---- two real steps per algorithm, in-process ----------------------------------------------------
SMOKE_CASES = {
    "gspo": [],
    "sapo": [],
    "cispo": ["--use-tis"],
    "m2po": ["--global-batch-size", "8"],  # two optimizer steps: off-policy on the second
    "rloo": ["--loss-agg-mode", "seq-mean-token-sum-norm"],
    "reinforce_plus_plus": ["--kl-coef", "0.01", "--gamma", "0.99"],
    "reinforce_plus_plus_baseline": ["--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "k2"],
    "ppo": ["--lambd", "0.95", "--critic-lr", "1e-3", "--kl-coef", "0.01", "--global-batch-size", "8"],
    "ppo-critic-only-first": ["--num-critic-only-steps", "1", "--value-clip", "0.5"],
    "grpo-opd-reverse-kl-advantage": ["--use-opd", "--teacher-hf-checkpoint", "{teacher}"],
    "grpo-opd-forward-kl-loss": ["--use-opd", "--teacher-hf-checkpoint", "{teacher}", "--opd-kl-type", "forward_kl",
                                 "--opd-loss-coef", "0.5", "--opd-log-prob-top-k", "5", "--global-batch-size", "8"],
    "grpo-opd-forward-kl-advantage-engine": ["--use-opd", "--teacher-hf-checkpoint", "{teacher}", "--opd-type", "sglang",
                                             "--opd-kl-type", "forward_kl", "--opd-norm-mode", "norm"],
    "grpo-opd-low-var-kl-loss-engine": ["--use-opd", "--teacher-hf-checkpoint", "{teacher}", "--opd-type", "engine",
                                        "--opd-kl-type", "low_var_kl", "--opd-loss-coef", "1.0"],
}


@pytest.mark.parametrize("name", sorted(SMOKE_CASES))
def test_two_training_steps_give_finite_losses(name, tiny_workspace, tmp_path):
    from relax.core.build import build_roles
    from relax.core.loops.sync import SyncController
    from relax.core.placement.in_process import InProcessPlacement
    from relax.telemetry.tracking import Tracker

    estimator = name.split("-")[0]
    # The teacher is the student's own starting point: the divergence starts at 0 and grows as the student moves.
    extra = [arg.format(teacher=tiny_workspace / "model") for arg in SMOKE_CASES[name]]
    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, "--advantage-estimator", estimator,
                                       "--num-rollout", "2", "--dump-samples", "0", *extra))
    roles = build_roles(cfg)
    with Tracker(tmp_path, use_tensorboard=False) as tracker:
        controller = SyncController(cfg, InProcessPlacement(cfg, roles), tracker)
        per_step = []
        for step in range(2):
            metrics = asyncio.run(controller.train_step(step))
            losses = {k: v for k, v in metrics.items() if k.startswith(("train/", "critic/"))}
            assert losses and all(math.isfinite(v) for v in losses.values()), losses
            per_step.append(metrics)
    if "--use-tis" in SMOKE_CASES[name]:
        assert "train/tis" in metrics and "train/tis_mismatch_kl" in metrics
    if estimator == "ppo":
        assert metrics["critic/value_loss"] > 0 and math.isfinite(metrics["critic/values"])
    if "--num-critic-only-steps" in SMOKE_CASES[name]:
        # the first step trains the critic alone; the policy and the engine's weights wait
        assert "train/pg_loss" not in per_step[0] and "train/pg_loss" in per_step[1]
        assert roles.rollout.engine.weight_version == 2
    if "--use-opd" in SMOKE_CASES[name]:
        # Step 1: the student is the teacher, so the divergence is 0 (up to the top-k truncation of the forward KL).
        # Step 2: the student moved; the per-token estimate at the sampled tokens is unbiased but may be negative for
        # one small batch, so only its being finite and no longer 0 is certain.
        assert abs(per_step[0]["train/opd_kl"]) < 1e-3, per_step[0]["train/opd_kl"]
        assert math.isfinite(metrics["train/opd_kl"]) and metrics["train/opd_kl"] != 0
