"""`--rm-path` (issue 34): a sequence-classification model's score as the reward, through the real `RewardComputer`.
Concurrent samples are scored in a few batched forwards, each score equal to the model's own forward on the sample
alone (right padding changes nothing); a sample longer than the model's positions, or one whose forward fails, fails alone (0, counted); a model
that is not a one-label reward model, or whose tokenizer is not the policy's, is refused at load naming the flag."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from relax.data.sample import Sample, SampleStatus
from relax.rollout.rewards import reward_model
from relax.rollout.rewards.compute import RewardComputer
from relax.rollout.rewards.reward_model import RewardModelScorer
from tests.support.tiny_assets import build_tiny_model_dir, build_tokenizer


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A tiny Qwen3 sequence classifier with one label, saved with the tiny tokenizer (pad 0)."""
    folder = tmp_path_factory.mktemp("rm")
    build_tiny_model_dir(folder / "policy")
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_pretrained(folder / "policy", num_labels=1, pad_token_id=0)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # scores that differ from sample to sample
    model.save_pretrained(folder / "rm")
    AutoTokenizer.from_pretrained(folder / "policy").save_pretrained(folder / "rm")
    return folder


def _samples(count: int, seed: int, vocab: int) -> list[Sample]:
    rng = random.Random(seed)
    return [Sample(index=i, tokens=[rng.randrange(3, vocab) for _ in range(rng.randint(2, 40))], response_length=1,
                   status=SampleStatus.COMPLETED) for i in range(count)]


def test_scores_are_batched_and_equal_the_model_on_each_sample_alone(reward_model_dir, monkeypatch):
    scorer = RewardModelScorer(reward_model_dir / "rm", "cpu", torch.float32,
                               AutoTokenizer.from_pretrained(reward_model_dir / "policy"))
    forwards = []
    original = scorer._score
    monkeypatch.setattr(scorer, "_score", lambda sequences: forwards.append(len(sequences)) or original(sequences))
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir / "rm").eval()
    samples = _samples(48, seed=0, vocab=model.config.vocab_size)
    computer = RewardComputer(remote=scorer, timeout_s=60)
    asyncio.run(computer.score(samples))
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([s.tokens])).logits.item() for s in samples]
    assert [s.reward for s in samples] == pytest.approx(alone, rel=1e-4, abs=1e-5)
    assert sum(forwards) == 48 and len(forwards) < 48 / 4  # concurrent samples share forwards
    assert computer.pop_metrics()["reward/rm_scores"] == 48
    computer.close()


def test_the_batch_is_bounded_by_padded_tokens(reward_model_dir, monkeypatch):
    monkeypatch.setattr(reward_model, "MAX_BATCH_TOKENS", 100)
    scorer = RewardModelScorer(reward_model_dir / "rm", "cpu", torch.float32)
    widths = []
    original = scorer._score
    monkeypatch.setattr(scorer, "_score", lambda sequences: widths.append(len(sequences) * max(map(len, sequences)))
                        or original(sequences))
    samples = _samples(30, seed=1, vocab=scorer.vocab_size)
    computer = RewardComputer(remote=scorer, timeout_s=60)
    asyncio.run(computer.score(samples))
    assert all(s.reward is not None for s in samples)
    assert max(widths) <= 100 and len(widths) > 1
    computer.close()


def test_a_sample_that_cannot_be_scored_fails_alone(reward_model_dir, monkeypatch):
    scorer = RewardModelScorer(reward_model_dir / "rm", "cpu", torch.float32)
    samples = _samples(12, seed=2, vocab=scorer.vocab_size)
    samples[1].tokens = [5] * (scorer.max_positions + 1)  # refused before any forward
    samples[4].tokens = [scorer.vocab_size + 3, 5]  # not a token of the model
    samples[7].tokens = [4, 4, 4, 4, 4, 4, 4, 9]  # its forward fails (below): its batch is scored again one by one
    original = scorer._score

    def failing(sequences):
        if [4, 4, 4, 4, 4, 4, 4, 9] in sequences:
            raise RuntimeError("the forward failed")
        return original(sequences)

    monkeypatch.setattr(scorer, "_score", failing)
    computer = RewardComputer(remote=scorer, timeout_s=60)
    asyncio.run(computer.score(samples))
    assert [s.index for s in samples if s.reward == 0.0] == [1, 4, 7]
    assert computer.pop_metrics()["reward/num_errors"] == 3
    assert all(isinstance(s.reward, float) and s.reward != 0.0 for i, s in enumerate(samples) if i not in (1, 4, 7))
    computer.close()


def test_what_is_not_a_reward_model_of_the_policy_is_refused(reward_model_dir, tmp_path):
    with pytest.raises(ValueError, match="--rm-path .*not a Hugging Face model folder"):
        RewardModelScorer(tmp_path, "cpu", torch.float32)
    classifier = AutoModelForSequenceClassification.from_pretrained(reward_model_dir / "policy", num_labels=3)
    classifier.save_pretrained(tmp_path / "three")
    with pytest.raises(ValueError, match="--rm-path .*one label"):
        RewardModelScorer(tmp_path / "three", "cpu", torch.float32)
    other = build_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="--rm-path .*not the policy's"):
        RewardModelScorer(reward_model_dir / "rm", "cpu", torch.float32, other)


@pytest.fixture(scope="module")
def second_reward_model_dir(reward_model_dir):
    """Another head on the same body: a member that ranks samples differently, on another scale and offset."""
    torch.manual_seed(2)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir / "rm")
    with torch.no_grad():
        model.score.weight.normal_(0, 3.0)
    model.save_pretrained(reward_model_dir / "rm_b")
    AutoTokenizer.from_pretrained(reward_model_dir / "policy").save_pretrained(reward_model_dir / "rm_b")
    return reward_model_dir / "rm_b"


@pytest.mark.parametrize("reduce", ["mean", "min", "mean_minus_std"])
def test_an_ensemble_reduces_its_members_standardised_scores(reward_model_dir, second_reward_model_dir, reduce):
    """Scored one after the other, each sample's reward is the reduction of the members' scores standardised by the
    moments of everything that member scored so far (itself included), whatever the members' shifts and scales."""
    paths = [reward_model_dir / "rm", second_reward_model_dir]
    members = [RewardModelScorer(path, "cpu", torch.float32) for path in paths]
    ensemble = reward_model.RewardModelEnsemble(members, reduce, std_coef=0.5)
    samples = _samples(10, seed=5, vocab=members[0].vocab_size)
    models = [AutoModelForSequenceClassification.from_pretrained(path).eval() for path in paths]
    with torch.no_grad():
        raw = [[model(input_ids=torch.tensor([s.tokens])).logits.item() for s in samples] for model in models]

    async def one_by_one():
        return [await ensemble(None, sample) for sample in samples]

    rewards = asyncio.run(one_by_one())
    for position, reward in enumerate(rewards):
        standardised = []
        for scores in raw:
            seen = torch.tensor(scores[:position + 1], dtype=torch.float64)
            std = seen.std().item() if position else 0.0
            standardised.append((scores[position] - seen.mean().item()) / (std if std > 0 else 1.0))
        mean = sum(standardised) / 2
        spread = abs(standardised[0] - standardised[1]) / 2
        expected = {"mean": mean, "min": min(standardised), "mean_minus_std": mean - 0.5 * spread}[reduce]
        assert reward == pytest.approx(expected, rel=1e-4, abs=1e-5), position
    metrics = ensemble.pop_metrics()
    assert metrics["reward/rm_scores"] == 10 and metrics["reward/rm_disagreement"] > 0
    # Shifting and scaling a member's scores leaves its standardised scores, so the rewards, unchanged.
    shifted = reward_model.RunningMoments(), reward_model.RunningMoments()
    for value in raw[1]:
        shifted[0].add(value)
        shifted[1].add(7.0 + 3.0 * value)
    assert shifted[0].standardise(raw[1][-1]) == pytest.approx(shifted[1].standardise(7.0 + 3.0 * raw[1][-1]))


def test_an_ensemble_member_that_cannot_score_fails_the_sample_alone(reward_model_dir, second_reward_model_dir):
    paths = (reward_model_dir / "rm", second_reward_model_dir)
    members = [RewardModelScorer(path, "cpu", torch.float32) for path in paths]
    computer = RewardComputer(remote=reward_model.RewardModelEnsemble(members, "mean"), timeout_s=60)
    samples = _samples(6, seed=6, vocab=members[0].vocab_size)
    samples[2].tokens = [members[0].vocab_size + 1, 4]
    asyncio.run(computer.score(samples))
    assert samples[2].reward == 0.0 and all(s.reward is not None for s in samples)
    assert computer.pop_metrics()["reward/num_errors"] == 1
    computer.close()


@pytest.mark.parametrize("flags, message", [
    (["--rm-path", "a", "--rm-ensemble-reduce", "min"], "--rm-ensemble-reduce: settings of an ensemble .* names 1"),
    (["--rm-path", "a", "b", "--rm-ensemble-std-coef", "2"], "weighs the disagreement of --rm-ensemble-reduce"),
])
def test_ensemble_settings_without_an_ensemble_are_refused(flags, message):
    from relax.cli.args import parse_config
    from relax.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_config(["--num-rollout", "1", *flags])


def test_one_folder_is_a_string_or_a_list():
    from relax.cli.args import parse_config
    from relax.config import RelaxConfig

    assert parse_config(["--num-rollout", "1", "--rm-path", "a"]).rm_path == ["a"]
    assert parse_config(["--num-rollout", "1", "--rm-path", "a", "b"]).rm_path == ["a", "b"]
    assert RelaxConfig(num_rollout=1, rm_path="a").rm_path == ["a"]
