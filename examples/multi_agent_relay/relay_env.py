"""The relay: two agents (one policy in two roles) add three numbers together, each seeing only its own part.

``first`` is asked ``a+b=``; what it answers is handed to ``second`` as ``s+c=`` (an observation in second's context,
never trained on); second's answer is the episode's result. Each agent is rewarded for what it controls:

- first: 1.0 when its sum is a + b;
- second: 1.0 when its answer is a + b + c, the team's result (so it also carries first's mistakes, as the last
  member of any pipeline does: its reward is the task's).

A first answer that is not a number ends the episode: second never speaks and its sample is FAILED, so it trains on
nothing (and counts as wrong in the metrics). Run with ``--custom-generate-function-path
relax.rollout.agentic.multi_agent:generate --rollout-interaction-env-path relay_env`` (this folder on PYTHONPATH).
"""

from __future__ import annotations

import re
from typing import Any

from relax.data.sample import Sample
from relax.rollout.agentic.multi_agent import AgentTurn, MultiAgentEnv

PROBLEM = re.compile(r"\s*(\d+)\+(\d+)\+(\d+)\s*")


def read_number(text: str) -> int | None:
    """The answer as a number, or None: ASCII digits only (``str.isdigit`` also accepts "²", which ``int`` refuses)."""
    text = text.strip()
    return int(text) if re.fullmatch(r"[0-9]+", text) else None


class AdditionRelay(MultiAgentEnv):
    agents = ("first", "second")

    def __init__(self, problem: str):
        match = PROBLEM.fullmatch(problem)
        if match is None:
            raise ValueError(f"a relay prompt is 'a+b+c', got {problem!r:.60}")
        self.a, self.b, self.c = map(int, match.groups())

    def reset(self) -> tuple[dict[str, list[dict]], str]:
        return {"first": [{"role": "user", "content": f"{self.a}+{self.b}="}], "second": []}, "first"

    def step(self, agent: str, response_text: str) -> AgentTurn:
        answer = read_number(response_text)
        if agent == "first":
            reward = {"first": float(answer == self.a + self.b)}
            if answer is None:
                return AgentTurn(None, rewards=reward)
            return AgentTurn("second", {"second": {"role": "user", "content": f"{answer}+{self.c}="}}, reward)
        return AgentTurn(None, rewards={"second": float(answer == self.a + self.b + self.c)})


def build_env(sample: Sample, args: Any) -> AdditionRelay:
    return AdditionRelay(sample.prompt if isinstance(sample.prompt, str) else str(sample.prompt))
