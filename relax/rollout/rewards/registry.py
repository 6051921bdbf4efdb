"""Rule rewards by name: the table that ``--rm-type`` and ``metadata["rm_type"]`` look up.

A rule reward compares a response with a label and needs nothing else. It has two parts: ``extract`` finds the
response's final answer (None: the response states none, e.g. it was cut off inside its answer), and ``grade``
compares an answer with the label. ``boxed_<type>`` keeps the grading and takes the answer from the last
``\\boxed{}`` instead, so each reward decides what a boxed answer means to it (``math`` hands math-verify a LaTeX
box, ``dapo`` compares the box content, not an ``Answer:`` line it never holds). Registering by name keeps datasets
and configs free of import paths; ``--custom-rm-path`` covers everything else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from relax.rollout.rewards.boxed import last_boxed_content

Grader = Callable[[str, Any, dict[str, Any]], float]  # (answer, label, metadata) -> reward
Extractor = Callable[[str], "str | None"]  # response -> its final answer, or None when it gives none

BOXED_PREFIX = "boxed_"


def whole_response(response: str) -> str:
    return response


@dataclass(frozen=True)
class RuleReward:
    """``reward(response, label, metadata)``: ``grade`` of the extracted answer, or ``no_answer`` without one.

    ``isolated`` marks rewards that may compute without bound on adversarial answers (math-verify's symbolic
    comparison of ``9^{9^{9^9}}``): `relax.rollout.rewards.compute.RewardComputer` runs them in worker processes
    it can kill at ``--reward-timeout``.
    """

    name: str
    grade: Grader
    extract: Extractor = whole_response
    extract_boxed: Extractor = last_boxed_content
    no_answer: float = 0.0
    isolated: bool = False

    def __call__(self, response: str, label: Any, metadata: dict[str, Any]) -> float:
        answer = self.extract(response)
        return self.no_answer if answer is None else self.grade(answer, label, metadata)

    def on_boxed_answer(self) -> RuleReward:
        """The ``boxed_`` variant: the same grading of the last ``\\boxed{}`` (no box, or a box never closed,
        is no answer)."""
        return replace(self, name=BOXED_PREFIX + self.name, extract=self.extract_boxed)


_RULE_REWARDS: dict[str, RuleReward] = {}


def register_reward(name: str, *, extract: Extractor = whole_response, extract_boxed: Extractor = last_boxed_content,
                    no_answer: float = 0.0, isolated: bool = False) -> Callable[[Grader], Grader]:
    """Decorator that makes ``grade(answer, label, metadata) -> float`` available as reward type ``name``.

    Without ``extract`` the whole response is the answer, so a plain ``fn(response, label, metadata)`` registers
    as it is. Registering a name twice raises, so two plugins cannot silently replace each other's reward.
    """

    def decorator(grade: Grader) -> Grader:
        if name in _RULE_REWARDS:
            raise ValueError(f"reward type {name!r} is already registered (by {_RULE_REWARDS[name].grade.__module__})")
        _RULE_REWARDS[name] = RuleReward(name, grade, extract, extract_boxed, no_answer, isolated)
        return grade

    return decorator


def get_reward_fn(name: str) -> RuleReward:
    """The rule reward registered as ``name``, or the ``boxed_`` variant of one."""
    if name in _RULE_REWARDS:
        return _RULE_REWARDS[name]
    if name.startswith(BOXED_PREFIX) and name[len(BOXED_PREFIX) :] in _RULE_REWARDS:
        return _RULE_REWARDS[name[len(BOXED_PREFIX) :]].on_boxed_answer()
    known = ", ".join(sorted(_RULE_REWARDS))
    raise ValueError(
        f"unknown reward type {name!r}; known types: {known} (each also with the {BOXED_PREFIX!r} prefix); "
        "for anything else pass a function with --custom-rm-path"
    )
