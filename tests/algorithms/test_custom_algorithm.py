"""The algorithm hooks: a custom advantage function (--custom-advantage-function-path) and a custom policy loss
(--custom-policy-loss-function-path) by dotted path, checked before any work, used by a real run."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.algorithms.advantages import AdvantageInputs
from relax.algorithms.loss import MicroBatchTensors, build_policy_loss_fn
from relax.algorithms.policy_loss import PolicyLossSettings
from relax.cli.args import parse_config
from relax.config import ConfigError
from relax.core.run_settings import algorithm_spec, checked_advantage_function, custom_policy_loss
from relax.telemetry.metrics_file import read_metrics
from tests.support.custom_algorithm import sign_of_reward
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


# What a custom advantage function may get wrong, applied to a good answer: the estimator's output had gone into the
# trainer unchecked (a list one short failed in an IndexError, another shape in a size mismatch, a NaN trained the
# weights into NaN and the run failed later in sampling).
DAMAGE = {
    "one short": lambda out: out[:-1],
    "one more": lambda out: [*out, out[0]],
    "a tensor, not a list": lambda out: torch.stack([a.sum() for a in out]),
    "None": lambda out: None,
    "lists of numbers": lambda out: [a.tolist() for a in out],
    "a longer sample": lambda out: [torch.cat([out[0], out[0][:1]]), *out[1:]],
    "a [T, 1] sample": lambda out: [out[0][:, None], *out[1:]],
    "a NaN": lambda out: [out[0].float().fill_(float("nan")), *out[1:]],
    "an infinity": lambda out: [*out[:-1], out[-1].float().fill_(float("inf"))],
    "booleans": lambda out: [a > 0 for a in out],
    "complex numbers": lambda out: [a.to(torch.complex64) for a in out],
}


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 6), min_size=2, max_size=8), damage=st.sampled_from([None, *DAMAGE]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64, torch.int64]))
def test_a_custom_advantage_function_s_answer_is_checked_at_every_call(lengths, damage, dtype):
    inputs = AdvantageInputs(rewards=torch.arange(len(lengths), dtype=torch.float32), group_size=len(lengths),
                             response_masks=[torch.ones(n) for n in lengths])

    def estimator(given: AdvantageInputs) -> list[torch.Tensor]:
        out = [a.to(dtype) for a in sign_of_reward(given)]
        return DAMAGE[damage](out) if damage else out

    checked = checked_advantage_function(estimator, "--custom-advantage-function-path m:f")
    if damage is None:
        result = checked(inputs)
        assert [a.dtype for a in result] == [torch.float32] * len(lengths)
        assert all(torch.equal(a, b.to(dtype).float()) for a, b in zip(result, sign_of_reward(inputs)))
        return
    with pytest.raises(ConfigError, match=r"^--custom-advantage-function-path m:f: "):
        checked(inputs)


def test_a_run_whose_custom_advantages_are_nan_ends_naming_the_flag(tiny_workspace, tmp_path):
    result = run_relax("train", *tiny_train_args(tiny_workspace, tmp_path / "run", "--num-rollout", "2",
                                                 "--custom-advantage-function-path",
                                                 "tests.support.custom_algorithm:nan_advantages"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "--custom-advantage-function-path tests.support.custom_algorithm:nan_advantages: sample 0's advantages " \
           "hold NaN or infinite values" in result.stderr
