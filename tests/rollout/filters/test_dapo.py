"""DAPO pieces: dynamic sampling (group filter + refill) and the soft overlong penalty."""

import asyncio

import pytest

from relax.cli.args import parse_config
from relax.components.rollout import DynamicSampling, OverlongPenalty, overlong_penalty, scalar_reward
from relax.config import ConfigError
from relax.core.build import build_roles
from relax.core.rollout_parts import build_dynamic_sampling
from relax.data.sample import Sample
from relax.rollout.filters.dynamic_sampling import DynamicFilterOutput, apply_filter, check_reward_nonzero_std
from relax.rollout.generation.data_source import PromptDataSource
from tests.support.runs import tiny_train_args

FILTER = "relax.rollout.filters.dynamic_sampling:check_reward_nonzero_std"


def group(*rewards):
    return [Sample(index=0, reward=r) for r in rewards]


def reject_all(args, samples):
    return False


# ---- the filter on hand-made groups ------------------------------------------------------
def test_nonzero_std_filter_keeps_only_groups_with_reward_spread():
    assert check_reward_nonzero_std(None, group(0.0, 1.0, 0.0, 0.0)).keep
    assert check_reward_nonzero_std(None, group(0.25, 0.5)).keep
    assert not check_reward_nonzero_std(None, group(1.0, 1.0, 1.0, 1.0)).keep
    assert not check_reward_nonzero_std(None, group(0.0, 0.0)).keep
    assert not check_reward_nonzero_std(None, group(1.0)).keep  # one sample has no spread
    # dict rewards use their score; None counts as 0
    assert check_reward_nonzero_std(None, group({"score": 1.0}, {"score": 0.0})).keep
    assert not check_reward_nonzero_std(None, group(None, 0.0)).keep
    dropped = check_reward_nonzero_std(None, group(1.0, 1.0))
    assert isinstance(dropped, DynamicFilterOutput) and dropped.reason


def test_filter_answers_are_normalised():
    assert apply_filter(lambda args, s: True, None, group(1.0)) == DynamicFilterOutput(True)
    assert apply_filter(lambda args, s: DynamicFilterOutput(False, "x"), None, group(1.0)).reason == "x"
    with pytest.raises(TypeError, match="dynamic-sampling-filter-path"):
        apply_filter(lambda args, s: 1, None, group(1.0))


def test_bad_filter_path_fails_at_config_time(tiny_workspace, tmp_path):
    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, "--num-rollout", "1",
                                       "--dynamic-sampling-filter-path", "tests.support.e2e_rewards:no_such_filter"))
    with pytest.raises(ConfigError, match="--dynamic-sampling-filter-path .*no attribute 'no_such_filter'"):
        build_dynamic_sampling(cfg)


def test_data_source_cursor_round_trips():
    prompts = [Sample(index=i, tokens=[i]) for i in range(5)]
    source = PromptDataSource(prompts, rollout_batch_size=2, shuffle=True, seed=3)
    start, first = source.take(3)
    assert start == 0 and source.consumed == 3
    resumed = PromptDataSource(prompts, rollout_batch_size=2, shuffle=True, seed=3)
    resumed.load_state_dict(source.state_dict())
    assert [s.index for s in resumed.take(4)[1]] == [s.index for s in source.take(4)[1]]
    assert [s.index for s in first] == [s.index for s in source.prompts_at(0, 3)]


# ---- a real run with the tiny model ------------------------------------------------------
@pytest.fixture(scope="module")
def dapo_roles(tiny_workspace, tmp_path_factory):
    cfg = parse_config(tiny_train_args(
        tiny_workspace, tmp_path_factory.mktemp("dapo"), "--num-rollout", "2",
        "--custom-rm-path", "tests.support.e2e_rewards:constant_on_even_rows", "--dynamic-sampling-filter-path", FILTER,
    ))
    return cfg, build_roles(cfg)


def test_dynamic_sampling_refills_a_full_batch_of_groups_with_reward_spread(dapo_roles):
    cfg, roles = dapo_roles
    rollout = roles.rollout
    samples, metrics = asyncio.run(rollout.generate(0))
    n, batch = cfg.n_samples_per_prompt, cfg.rollout_batch_size
    assert len(samples) == batch * n  # the batch is full
    groups = [samples[i:i + n] for i in range(0, len(samples), n)]
    for g in groups:
        assert len({s.group_index for s in g}) == 1
        assert len({scalar_reward(s) for s in g}) > 1  # every kept group has reward spread
        assert g[0].index % 2 == 1  # even rows score a constant: always filtered
    assert metrics["rollout/dynamic_filter_dropped_groups"] > 0
    assert metrics["rollout/dynamic_sampling_rounds"] > 1
    assert metrics["rollout/zero_std_group_ratio"] == 0
    consumed = rollout.data_source.consumed
    # one prompt per generated group: kept, filtered or surplus
    assert consumed == metrics["rollout/generated_groups"] == (
        batch + metrics["rollout/dynamic_filter_dropped_groups"] + metrics["rollout/dropped_surplus_groups"])
    # the next step continues at the cursor: no prompt position is reused
    next_samples, _ = asyncio.run(rollout.generate(1))
    assert min(s.group_index for s in next_samples) >= consumed


def test_overlong_penalty_in_a_real_rollout(tiny_workspace, tmp_path):
    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, "--num-rollout", "1",
                                       "--custom-rm-path", "tests.support.e2e_rewards:constant_on_even_rows",
                                       "--overlong-buffer-len", "2", "--overlong-penalty-factor", "0.5"))
    samples, metrics = asyncio.run(build_roles(cfg).rollout.generate(0))
    # M = 4, L = 2, F = 0.5; even rows score 0 before the penalty, so their reward is the penalty
    penalties = [s.metadata["overlong_penalty"] for s in samples]
    assert penalties == [min(0.0, (4 - 2 - s.response_length) / 2) * 0.5 for s in samples]
    assert any(penalties)
    assert all(s.reward == pytest.approx(p) for s, p in zip(samples, penalties) if s.index % 2 == 0)
    assert metrics["rollout/overlong_penalty_mean"] == pytest.approx(sum(penalties) / len(penalties))


def test_dynamic_sampling_stops_after_max_rounds(dapo_roles):
    cfg, roles = dapo_roles
    rollout = roles.rollout
    saved = rollout.dynamic_sampling
    rollout.dynamic_sampling = DynamicSampling(reject_all, max_rounds=2)
    try:
        before = rollout.data_source.consumed
        samples, metrics = asyncio.run(rollout.generate(5))
    finally:
        rollout.dynamic_sampling = saved
    batch = cfg.rollout_batch_size
    assert metrics["rollout/dynamic_sampling_rounds"] == 2
    assert metrics["rollout/dynamic_filter_dropped_groups"] == 2 * batch
    assert rollout.data_source.consumed == before + 2 * batch
    # nothing kept: the step trains on the last round's groups instead of an empty batch
    assert len(samples) == batch * cfg.n_samples_per_prompt


# ---- the overlong penalty by hand -------------------------------------------------------
def test_overlong_penalty_numbers():
    # M = 20, L = 5: no penalty up to 15 tokens, then linear down to -F at 20
    assert overlong_penalty(10, 20, 5, 1.0) == 0.0
    assert overlong_penalty(15, 20, 5, 1.0) == 0.0
    assert overlong_penalty(16, 20, 5, 1.0) == pytest.approx(-0.2)
    assert overlong_penalty(20, 20, 5, 1.0) == pytest.approx(-1.0)
    assert overlong_penalty(18, 20, 5, 0.5) == pytest.approx(-0.3)


def test_overlong_penalty_is_added_to_float_and_dict_rewards():
    samples = [Sample(index=0, reward=1.0, response_length=18), Sample(index=1, reward={"score": 1.0, "acc": 1.0},
                                                                     response_length=20),
               Sample(index=2, reward=0.5, response_length=3)]
    penalties = OverlongPenalty(max_response_len=20, buffer_len=5, factor=0.5).apply(samples)
    assert penalties == pytest.approx([-0.3, -0.5, 0.0])
    assert samples[0].reward == pytest.approx(0.7)
    assert samples[1].reward == pytest.approx({"score": 0.5, "acc": 1.0})
    assert samples[2].reward == 0.5


def test_overlong_buffer_longer_than_max_response_is_rejected(tiny_workspace, tmp_path):
    with pytest.raises(Exception, match="--overlong-buffer-len"):
        parse_config(tiny_train_args(tiny_workspace, tmp_path, "--num-rollout", "1", "--overlong-buffer-len", "5"))
