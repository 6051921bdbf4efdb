"""Multi-agent episodes (`relax.rollout.agentic.multi_agent`): a proposer and a verifier (one policy in two roles) on
the real tiny engine, through the rollout's per-sample generation: one sample per agent in the prompt's group, loss
mask 1 exactly on that agent's own turns, what it was shown with mask 0, per-agent rewards; environment errors and
silent agents fail their samples, naming why."""

from __future__ import annotations

import asyncio

import pytest

from relax.config import RelaxConfig
from relax.data.sample import Sample, SampleStatus
from relax.rollout.agentic import multi_agent
from relax.rollout.agentic.multi_agent import AgentTurn, MultiAgentEnv
from relax.rollout.generation.context import PerSampleGeneration
from tests.rollout.agentic.test_agentic_multi_turn import RecordingEngine, letter_ids

HERE = "tests.rollout.agentic.test_multi_agent"
PATH = "relax.rollout.agentic.multi_agent:generate"


class ProposeVerifyRevise(MultiAgentEnv):
    """The proposer answers, the verifier judges the proposal, the proposer revises after seeing the verdict."""

    agents = ("proposer", "verifier")

    def __init__(self, sample):
        self.question = sample.prompt
        self.turns = 0

    def reset(self):
        return {"proposer": [{"role": "user", "content": f"answer: {self.question}"}],
                "verifier": [{"role": "system", "content": "check the proposal."}]}, "proposer"

    def step(self, agent, response_text):
        self.turns += 1
        if agent == "proposer" and self.turns == 1:
            return AgentTurn("verifier", {"verifier": {"role": "user", "content": f"proposal: {response_text}"}})
        if agent == "verifier":
            return AgentTurn("proposer", {"proposer": {"role": "user", "content": f"verdict: {response_text}"}},
                             rewards={"verifier": 0.25})
        return AgentTurn(None, rewards={"proposer": 1.0, "verifier": 0.5})


class SilentVerifier(ProposeVerifyRevise):
    def step(self, agent, response_text):
        return AgentTurn(None, rewards={"proposer": 1.0})


class BrokenStep(ProposeVerifyRevise):
    def step(self, agent, response_text):
        raise RuntimeError("the judge crashed")


def build_env(sample, args):
    return {"revise": ProposeVerifyRevise, "silent": SilentVerifier, "broken": BrokenStep}[sample.metadata["env"]](
        sample)


def _episodes(engine, tokenizer, kind: str, count: int = 2):
    from relax.backends.inference.base import SamplingParams

    cfg = RelaxConfig(rollout_interaction_env_path=HERE, custom_generate_function_path=PATH, max_turns=6,
                      rollout_max_response_len=200)
    samples = [Sample(index=i, group_index=i, prompt=f"{i}+2=", tokens=[1, 2], metadata={"env": kind})
               for i in range(count)]
    recording = RecordingEngine(engine)
    generation = PerSampleGeneration(multi_agent.generate, PATH, cfg, tokenizer)
    sampling = SamplingParams(max_new_tokens=6, stop_token_ids=letter_ids(tokenizer), seed=5)
    return asyncio.run(generation.run(recording, samples, sampling)), recording


def test_each_agent_gets_its_own_sample_with_exactly_its_own_turns_trained(engine, tokenizer):
    samples, recording = _episodes(engine, tokenizer, "revise")
    assert [(s.group_index, s.metadata["agent"]) for s in samples] == [
        (0, "proposer"), (0, "verifier"), (1, "proposer"), (1, "verifier")]
    for sample in samples:
        agent = sample.metadata["agent"]
        # every turn this agent took in this episode, from the engine's own record
        turns = [(request, output) for request, output in recording.turns(f"ma-{sample.group_index}-")
                 if f"-{agent}-t" in request.request_id]
        assert len(turns) == (2 if agent == "proposer" else 1)
        response = sample.tokens[-sample.response_length:] if sample.response_length else []
        trained = [token for token, mask in zip(response, sample.loss_mask) if mask]
        assert trained == [token for _, output in turns for token in output.output_ids]  # its turns, no one else's
        assert [lp for lp, mask in zip(sample.rollout_log_probs, sample.loss_mask) if mask] == pytest.approx(
            [lp for _, output in turns for lp in output.output_log_probs])
        # each turn saw this agent's context only: its request is the sample's tokens up to that turn
        for request, _ in turns:
            assert sample.tokens[:len(request.input_ids)] == request.input_ids
        shown = tokenizer.decode([t for t, m in zip(response, sample.loss_mask) if not m])
        assert ("verdict" in shown) == (agent == "proposer")  # the proposer was shown the verdict, masked
        assert sample.status is SampleStatus.COMPLETED
    rewards = {(s.group_index, s.metadata["agent"]): s.reward for s in samples}
    assert rewards == {(0, "proposer"): 1.0, (0, "verifier"): 0.75, (1, "proposer"): 1.0, (1, "verifier"): 0.75}
    verifier = samples[1]
    prompt = tokenizer.decode(verifier.tokens[:len(verifier.tokens) - verifier.response_length])
    assert "check the proposal" in prompt and "user\nproposal" in prompt  # shown before it first spoke: its prompt


def test_a_silent_agent_and_a_broken_environment_fail_their_samples_naming_why(engine, tokenizer):
    silent, _ = _episodes(engine, tokenizer, "silent", count=1)
    assert [s.metadata["agent"] for s in silent] == ["proposer", "verifier"]
    assert silent[0].status is SampleStatus.COMPLETED and silent[0].reward == 1.0
    assert silent[1].status is SampleStatus.FAILED and "never took a turn" in silent[1].metadata["error"]
    broken, _ = _episodes(engine, tokenizer, "broken", count=1)
    assert all(s.status is SampleStatus.FAILED and "the judge crashed" in s.metadata["error"] for s in broken)
    assert all(not any(s.loss_mask) for s in broken)


def test_metrics_are_reported_per_agent(engine, tokenizer):
    from relax.components.rollout import summarize_samples

    samples, _ = _episodes(engine, tokenizer, "revise", count=3)
    samples += _episodes(engine, tokenizer, "silent", count=1)[0]
    metrics = summarize_samples(samples, "eval/set")
    assert metrics["eval/set/agent/proposer/reward_mean"] == 1.0  # 4 proposers, each rewarded 1.0
    assert metrics["eval/set/agent/proposer/accuracy"] == 1.0
    assert metrics["eval/set/agent/verifier/reward_mean"] == pytest.approx(0.75 * 3 / 4)  # the silent one: 0
    assert metrics["eval/set/agent/verifier/accuracy"] == 0.75
    assert metrics["eval/set/reward_mean"] == pytest.approx((4 * 1.0 + 3 * 0.75) / 8)
    assert not any("/agent/" in key for key in summarize_samples(samples[:0] + [_plain()], "rollout"))


def _plain() -> Sample:
    sample = Sample(index=0, prompt="1+1=", tokens=[1, 2], response_length=1, reward=1.0)
    return sample


def test_the_environment_rewards_the_samples_so_no_reward_function_is_configured_or_accepted():
    from relax.config import ConfigError
    from relax.core.rollout_parts import build_reward_computer

    base = dict(rollout_interaction_env_path=HERE, custom_generate_function_path=PATH, max_turns=4)
    rewards = build_reward_computer(RelaxConfig(**base))  # no --rm-type, no --custom-rm-path: accepted
    for extra, named in (({"rm_type": "exact_match"}, "--rm-type"),
                         ({"custom_rm_path": "tests.rollout.agentic.test_multi_agent:build_env"}, "--custom-rm-path")):
        with pytest.raises(ConfigError, match=f"sets every sample's reward itself; {named} would never run"):
            build_reward_computer(RelaxConfig(**base, **extra))
    # a sample that somehow arrives without a reward is not scored by accident: it fails, named
    sample = Sample(index=0, prompt="1+1=", tokens=[1, 2], response_length=1)
    asyncio.run(rewards.score([sample]))
    assert sample.reward == 0.0 and rewards.pop_metrics()["reward/num_errors"] == 1
    assert "returned a sample without a reward" in next(iter(rewards.error_counts))
    # without the multi-agent generate function a reward is still required
    with pytest.raises(ConfigError, match="no reward configured"):
        build_reward_computer(RelaxConfig(max_turns=4))
