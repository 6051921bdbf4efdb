"""The algorithm hooks: a custom advantage function (--custom-advantage-function-path) and a custom policy loss
(--custom-policy-loss-function-path) by dotted path, checked before any work, used by a real run."""

from __future__ import annotations

import pytest
import torch

from relax.algorithms.advantages import AdvantageInputs
from relax.algorithms.loss import MicroBatchTensors, build_policy_loss_fn
from relax.algorithms.policy_loss import PolicyLossSettings
from relax.cli.args import parse_config
from relax.config import ConfigError
from relax.core.run_settings import algorithm_spec, custom_policy_loss
from relax.telemetry.metrics_file import read_metrics
from tests.support.runs import run_relax, tiny_train_args

ADVANTAGE = "tests.support.custom_algorithm:sign_of_reward"
POLICY_LOSS = "tests.support.custom_algorithm:clipped_with_a_metric"


def test_the_custom_advantage_replaces_the_estimators_and_keeps_the_rest():
    cfg = parse_config(["--advantage-estimator", "gspo", "--custom-advantage-function-path", ADVANTAGE])
    spec = algorithm_spec(cfg)
    assert spec.policy_loss == "gspo" and not spec.group_local  # the estimator's loss stays; never streamed
    masks = [torch.ones(3), torch.tensor([1.0, 1.0, 0.0])]
    advantages = spec.compute_advantages(AdvantageInputs(torch.tensor([1.0, 0.0]), 2, masks))
    assert [a.tolist() for a in advantages] == [[0.5, 0.5, 0.5], [-0.5, -0.5, 0.0]]  # on the raw rewards


def test_a_custom_policy_loss_runs_inside_the_common_loss_with_its_own_metric():
    cfg = parse_config(["--custom-policy-loss-function-path", POLICY_LOSS])
    settings = PolicyLossSettings(policy_loss="ppo_clip", eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None,
                                  aggregation="token-mean")
    log_probs = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    batch = MicroBatchTensors(mask=torch.ones(2, 2), fields={"advantages": torch.tensor([[1.0, 1.0], [-1.0, 0.5]])},
                              global_num_samples=4, global_num_tokens=8)
    custom_loss, custom_metrics = build_policy_loss_fn(settings, custom=custom_policy_loss(cfg))(batch, log_probs,
                                                                                               torch.zeros(2, 2))
    builtin_loss, builtin_metrics = build_policy_loss_fn(settings)(batch, log_probs, torch.zeros(2, 2))
    assert torch.equal(custom_loss, builtin_loss)  # the same PPO-clip, aggregated the same way
    assert custom_metrics["custom_loss_calls"].item() == pytest.approx(0.5)  # this micro-batch holds half the step
    assert "custom_loss_calls" not in builtin_metrics


def test_a_loss_that_returns_no_terms_is_named():
    cfg = parse_config(["--custom-policy-loss-function-path", "tests.support.custom_algorithm:not_terms"])
    settings = PolicyLossSettings("ppo_clip", 0.2, 0.2, None, "token-mean")
    loss_fn = build_policy_loss_fn(settings, custom=custom_policy_loss(cfg))
    batch = MicroBatchTensors(mask=torch.ones(1, 2), fields={"advantages": torch.ones(1, 2)})
    with pytest.raises(TypeError, match="returned Tensor, not PolicyLossTerms"):
        loss_fn(batch, torch.zeros(1, 2), torch.zeros(1, 2))


@pytest.mark.parametrize("name, path, message", [
    ("custom_advantage_function_path", "tests.support.custom_algorithm:nope", "has no attribute 'nope'"),
    ("custom_policy_loss_function_path", "no_such_module:fn", "importing 'no_such_module' failed"),
    ("custom_policy_loss_function_path", "fn", "expected 'package.module:function'"),
])
def test_bad_paths_fail_naming_the_flag(name, path, message):
    cfg = parse_config([f"--{name.replace('_', '-')}", path])
    with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} {path!r}.*{message}"):
        algorithm_spec(cfg) if name.startswith("custom_advantage") else custom_policy_loss(cfg)


def test_a_run_trains_with_both_hooks_and_a_bad_one_fails_before_any_output(tiny_workspace, tmp_path):
    run_dir = tmp_path / "run"
    result = run_relax("train", *tiny_train_args(
        tiny_workspace, run_dir, "--num-rollout", "2", "--skip-eval-before-train", "--dump-samples", "0",
        "--no-use-tensorboard", "--custom-advantage-function-path", ADVANTAGE,
        "--custom-policy-loss-function-path", POLICY_LOSS))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [row for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row]
    assert len(steps) == 2
    for row in steps:
        assert row["train/custom_loss_calls"] == pytest.approx(1.0)  # every micro-batch used the custom loss
        assert row["train/advantage_abs_mean"] in (pytest.approx(0.5), 0.0)  # |±0.5|, or 0 if all rewards tie

    bad = run_relax("train", *tiny_train_args(tiny_workspace, tmp_path / "bad", "--num-rollout", "1",
                                              "--custom-advantage-function-path", "tests.support.custom_algorithm:x"))
    assert bad.returncode == 2 and "--custom-advantage-function-path" in bad.stderr
    assert not (tmp_path / "bad").exists()
