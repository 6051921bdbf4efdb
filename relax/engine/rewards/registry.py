"""Rule rewards by name: the table that ``--rm-type`` and ``metadata["rm_type"]`` look up.

A rule reward compares a response with a label and needs nothing else, so it is a plain
function ``fn(response: str, label, metadata: dict) -> float``. Registering by name keeps
datasets and configs free of import paths; ``--custom-rm-path`` covers everything else.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from relax.engine.rewards.boxed import last_boxed_content

RuleReward = Callable[[str, Any, dict[str, Any]], float]

BOXED_PREFIX = "boxed_"

_RULE_REWARDS: dict[str, RuleReward] = {}


def register_reward(name: str) -> Callable[[RuleReward], RuleReward]:
    """Decorator that makes ``fn`` available as reward type ``name``.

    Registering a name twice raises, so two plugins cannot silently replace each other's reward.
    """

    def decorator(fn: RuleReward) -> RuleReward:
        if name in _RULE_REWARDS:
            raise ValueError(f"reward type {name!r} is already registered (by {_RULE_REWARDS[name].__module__})")
        _RULE_REWARDS[name] = fn
        return fn

    return decorator


def get_reward_fn(name: str) -> RuleReward:
    """The rule reward registered as ``name``.

    ``boxed_<type>`` is ``<type>`` applied to the content of the last ``\\boxed{}`` of the
    response (as upstream does), so any rule reward can grade a boxed answer; a response
    without a box is scored as an empty answer.
    """
    if name in _RULE_REWARDS:
        return _RULE_REWARDS[name]
    if name.startswith(BOXED_PREFIX) and name[len(BOXED_PREFIX) :] in _RULE_REWARDS:
        return _on_boxed_answer(_RULE_REWARDS[name[len(BOXED_PREFIX) :]])
    known = ", ".join(sorted(_RULE_REWARDS))
    raise ValueError(
        f"unknown reward type {name!r}; known types: {known} (each also with the {BOXED_PREFIX!r} prefix); "
        "for anything else pass a function with --custom-rm-path"
    )


def _on_boxed_answer(score: RuleReward) -> RuleReward:
    @functools.wraps(score)
    def score_boxed_answer(response: str, label: Any, metadata: dict[str, Any]) -> float:
        return score(last_boxed_content(response) or "", label, metadata)

    return score_boxed_answer
