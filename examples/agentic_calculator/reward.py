"""The reward of the calculator task: exact match of the final answer, plus per-sample tool-call figures.

Use with ``--custom-rm-path reward:calculator_reward`` (this folder on ``PYTHONPATH``). The reward is a dict:

- ``score`` (what GRPO uses): ``correct``, plus ``CALL_BONUS`` times ``tool_call_success`` with
  ``reward:calculator_reward_with_call_bonus``;
- ``correct``: 1.0 when the model's last turn answers ``<answer>N</answer>`` with N the exact product;
- ``tool_call_success``: the episode's tool-call success rate from relax's tool environment (successful calculator
  runs over attempted calls, 0 when the model made none);
- ``called_tool``: 1.0 when the model attempted at least one tool call;
- ``correct_call``: 1.0 when one of its calculator calls computes the labelled product (the operands were copied
  right), which tells a wrong call from a result copied wrongly into the answer.

Only the model's own last turn is graded, never the text the environment inserted: a tool result (or an error
message echoing the model's call) may contain digits or tags that must not count as the model's answer.

The rollout logs only ``score``, so each scored sample is also appended to ``<output_dir>/calculator_rewards.jsonl``
with the weight version that produced it and whether it is a held-out sample (``metadata["split"] == "test"``);
``plot_curves.py`` turns that file into the held-out accuracy and tool-call success curves.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agentic_common"))
from reward_log import final_answer, last_model_turn, record_reward  # noqa: E402  (shared with search_r1)

from relax.data.sample import Sample  # noqa: E402
from relax.rollout.agentic.tool_env import episode_tool_stats  # noqa: E402
from relax.rollout.agentic.tool_parser import parse_hermes_tool_calls  # noqa: E402
from relax.rollout.agentic.tools import ToolError, evaluate_arithmetic  # noqa: E402

__all__ = ["final_answer", "calculator_reward", "calculator_reward_with_call_bonus"]

REWARD_LOG_NAME = "calculator_rewards.jsonl"

# Exact match scores a broken call like a well-formed call with a wrong operand, so nothing in it favours the call
# format. This bonus for calls that ran was the attempt to change that. Measured (README.md, runs 2 and 3), it did not
# raise the sampled call success and it cost held-out accuracy, so config.yaml uses plain exact match.
CALL_BONUS = 0.1


def made_correct_call(sample: Sample) -> bool:
    """Whether a calculator call of any model turn evaluates to the label."""
    calls = [call for trace in sample.metadata.get("rollout_traces") or []
             for call in parse_hermes_tool_calls(trace["response_text"]).tool_calls if call.name == "calculator"]
    return any(calculator_value(call.arguments.get("expression")) == str(sample.label) for call in calls)


def calculator_value(expression: Any) -> str | None:
    try:
        return str(evaluate_arithmetic(str(expression)))
    except ToolError:
        return None


def episode_figures(sample: Sample) -> dict[str, float]:
    stats = episode_tool_stats(sample) or {}
    attempts = stats.get("calls", 0) + stats.get("parse_errors", 0)
    return {
        "correct": float(final_answer(last_model_turn(sample)) == str(sample.label)),
        "tool_call_success": float(stats.get("success_rate", 0.0)),
        "called_tool": float(attempts > 0),
        "correct_call": float(made_correct_call(sample)),
    }


def calculator_reward(args: Any, sample: Sample) -> dict[str, float]:
    """Exact match of the final answer."""
    figures = episode_figures(sample)
    reward = {"score": figures["correct"], **figures}
    record_reward(args, sample, reward, REWARD_LOG_NAME)
    return reward


def calculator_reward_with_call_bonus(args: Any, sample: Sample) -> dict[str, float]:
    """Exact match plus ``CALL_BONUS`` times the episode's tool-call success rate."""
    figures = episode_figures(sample)
    reward = {"score": figures["correct"] + CALL_BONUS * figures["tool_call_success"], **figures}
    record_reward(args, sample, reward, REWARD_LOG_NAME)
    return reward
