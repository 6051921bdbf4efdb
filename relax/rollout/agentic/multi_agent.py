"""Multi-agent episodes: several agents (or one policy in several roles: a proposer and a verifier, a debate) take
turns in one episode, each in a context of its own, and every agent's context becomes a training sample.

``--custom-generate-function-path relax.rollout.agentic.multi_agent:generate`` with ``--rollout-interaction-env-path
module`` whose ``build_env(sample, args)`` returns a `MultiAgentEnv`:

1. ``reset()`` returns each agent's opening chat messages (its context's prompt) and the agent who speaks first;
2. the agent whose turn it is generates on its own context; ``step(agent, response_text)`` returns an `AgentTurn`:
   who speaks next (None ends the episode), the chat messages to show the agents (appended to their contexts,
   loss mask 0: what the proposer wrote shown to the verifier, the verifier's verdict shown to the proposer), and
   rewards to add to agents' totals;
3. ``close()`` always.

The episode yields one sample per agent of ``agents``, in that order, in the prompt's group (`splice_group_
members`: a group of n episodes becomes n samples per agent): its context's tokens, loss mask 1 exactly on that
agent's own model turns (never another agent's, never an observation), its log-probs and weight versions, reward the
agent's total, ``metadata["agent"]`` its name and ``metadata["agent_index"]`` its position. An agent that never spoke
gives a FAILED sample (nothing to train on); an environment error fails every agent's sample, naming the call.
The environment's rewards are the samples' rewards, so such a run configures no reward function (one given is refused:
it would never run); eval and rollout metrics are also reported per agent (``.../agent/<name>/reward_mean`` and
``.../accuracy``). ``--max-turns`` bounds the model turns of the whole episode; ``--rollout-max-context-len`` (default: an agent's
prompt + ``--rollout-max-response-len``) bounds each context.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.data.sample import Sample, SampleStatus
from relax.rollout.agentic.env import EnvCallError, Message, call_env, load_env_builder
from relax.rollout.agentic.multi_turn import ObservationEncoder, Trajectory, context_budget, turn_seed


@dataclass
class AgentTurn:
    """What an environment answers after an agent's turn."""

    next_agent: str | None
    observations: dict[str, Message | list[Message]] = field(default_factory=dict)
    rewards: dict[str, float] = field(default_factory=dict)


class MultiAgentEnv:
    """Subclass: name ``agents`` and implement ``reset`` and ``step`` (module doc)."""

    agents: tuple[str, ...] = ()

    def reset(self) -> tuple[dict[str, list[Message]], str]:
        raise NotImplementedError

    def step(self, agent: str, response_text: str) -> AgentTurn:
        raise NotImplementedError

    def close(self) -> None:
        return None


@dataclass
class _Context:
    """One agent's context: its opening messages until it first speaks, then its trajectory."""

    opening: list[Message]
    pending: list[Message] = field(default_factory=list)  # shown to it since it last spoke
    trajectory: Trajectory | None = None
    last_output: list[int] = field(default_factory=list)

    def tokens_for_turn(self, tokenizer: Any, encoder: ObservationEncoder, template_kwargs: dict) -> list[int]:
        """Its context, ready for its next turn: the opening (and anything shown before it spoke) as its prompt;
        later, what it was shown since its last turn appended with loss mask 0."""
        if self.trajectory is None:
            text = tokenizer.apply_chat_template([*self.opening, *self.pending], tokenize=False,
                                                 add_generation_prompt=True, **template_kwargs)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            self.trajectory = Trajectory(tokens=list(ids), prompt_length=len(ids))
        elif self.pending:
            ids = encoder.close_turn(self.last_output) + encoder.encode_messages(self.pending)
            self.trajectory.add_observation_tokens(ids, None)
        self.pending = []
        return self.trajectory.tokens


async def generate(args: Any, sample: Sample, sampling_params: SamplingParams) -> list[Sample]:
    """Play one multi-agent episode (module doc); one sample per agent."""
    timeout = args.env_step_timeout
    env: MultiAgentEnv | None = None
    contexts: dict[str, _Context] = {}
    rewards: dict[str, float] = {}
    error: str | None = None
    stop_reason = "max_turns"
    try:
        env = await call_env(load_env_builder(args.rollout_interaction_env_path), sample, args, timeout=timeout)
        if not isinstance(env, MultiAgentEnv) or not env.agents:
            raise EnvCallError(f"build_env returned {type(env).__name__}, not a MultiAgentEnv with its agents named")
        opening, speaker = await call_env(env.reset, timeout=timeout)
        missing = [agent for agent in env.agents if agent not in opening]
        if missing or speaker not in env.agents:
            raise EnvCallError(f"reset: every agent needs its opening messages (missing {missing}) and the first "
                               f"speaker must be one of {list(env.agents)}, got {speaker!r}")
        contexts = {agent: _Context(list(opening[agent])) for agent in env.agents}
        rewards = dict.fromkeys(env.agents, 0.0)
        stop_reason = await _play(args, env, contexts, rewards, speaker, sampling_params, sample)
    except EnvCallError as err:
        stop_reason, error = "env_error", str(err)
    finally:
        if env is not None:
            try:
                await call_env(env.close, timeout=timeout)
            except EnvCallError as err:
                sample.metadata["close_error"] = str(err)
    agents = tuple(contexts) or (getattr(env, "agents", None) or ("agent",))
    return [_agent_sample(sample, index, agent, contexts.get(agent), rewards.get(agent, 0.0), stop_reason, error,
                          args.tokenizer) for index, agent in enumerate(agents)]


generate.sets_rewards = True  # every sample leaves with its agent's reward: no reward function runs (module doc)


async def _play(args: Any, env: MultiAgentEnv, contexts: dict[str, _Context], rewards: dict[str, float],
                speaker: str | None, sampling: SamplingParams, sample: Sample) -> str:
    encoder = ObservationEncoder(args.tokenizer, args.chat_template_kwargs, None)
    prefix = f"ma-{sample.group_index}-{sample.index}-{uuid.uuid4().hex[:8]}"
    for turn in range(args.max_turns):
        if speaker is None:
            return "env_done"
        context = contexts[speaker]
        tokens = context.tokens_for_turn(args.tokenizer, encoder, args.chat_template_kwargs)
        room = context_budget(args, context.trajectory.prompt_length) - len(tokens)
        if room <= 0:
            return "budget_exhausted"
        request = GenerationRequest(f"{prefix}-{speaker}-t{turn}", list(tokens),
                                    replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room),
                                            seed=turn_seed(sampling.seed, turn)))
        output = (await args.engine.generate([request]))[0]
        context.trajectory.add_model_tokens(output)
        context.last_output = list(output.output_ids)
        context.trajectory.traces.append({"turn": turn, "agent": speaker, "response_text": output.text,
                                          "finish_reason": output.finish_reason})
        if output.finish_reason == "abort":
            return "finish_abort"
        result = await call_env(env.step, speaker, output.text, timeout=args.env_step_timeout)
        if not isinstance(result, AgentTurn):
            raise EnvCallError(f"step returned {type(result).__name__}, not an AgentTurn")
        unknown = sorted({*result.observations, *result.rewards} - set(contexts))
        if unknown or (result.next_agent is not None and result.next_agent not in contexts):
            raise EnvCallError(f"step named agents that are not in the episode: {unknown or [result.next_agent]}")
        for agent, reward in result.rewards.items():
            rewards[agent] += float(reward)
        for agent, shown in result.observations.items():
            contexts[agent].pending += shown if isinstance(shown, list) else [shown]
        speaker = result.next_agent
    return "env_done" if speaker is None else "max_turns"


def _agent_sample(sample: Sample, index: int, agent: str, context: _Context | None, reward: float, stop_reason: str,
                  error: str | None, tokenizer: Any) -> Sample:
    member = copy.deepcopy(sample)
    member.metadata.update(agent=agent, agent_index=index)
    trajectory = context.trajectory if context is not None else None
    if trajectory is None or not trajectory.loss_mask:  # never spoke: nothing of its own to train on
        member.response_length, member.loss_mask, member.rollout_log_probs = 0, [], []
        member.status = SampleStatus.FAILED
        member.metadata["error"] = error or f"agent {agent!r} never took a turn"
        member.reward = 0.0
        return member
    trajectory.write_to(member, stop_reason, tokenizer)
    if error is not None:
        member.metadata["error"] = error
    member.reward = 0.0 if error is not None else reward
    return member
