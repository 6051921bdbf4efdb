"""The reward of the search task: exact match of the final answer, plus per-sample search figures.

Use with ``--custom-rm-path reward:search_reward`` (this folder on ``PYTHONPATH``). The reward is a dict:

- ``score`` (what GRPO uses) and ``correct``: 1.0 when the model's last turn answers ``<answer>N</answer>`` with N
  the town's code;
- ``tool_call_success``: the episode's tool-call success rate from relax's tool environment (searches that ran over
  attempted calls, 0 when the model made none);
- ``called_tool``: 1.0 when the model attempted at least one tool call;
- ``found``: 1.0 when one of its searches returned the passage holding the answer (the query named the right town),
  which tells a wrong query from an answer copied wrongly out of the results.

Each scored sample is also appended to ``<output_dir>/search_rewards.jsonl`` (weight version, split) for
``plot_curves.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agentic_common"))
from reward_log import final_answer, last_model_turn, record_reward  # noqa: E402  (shared with the calculator)

from relax.data.sample import Sample  # noqa: E402
from relax.rollout.agentic.tool_env import episode_tool_stats  # noqa: E402
from relax.rollout.agentic.tool_parser import parse_hermes_tool_calls  # noqa: E402
from relax.rollout.agentic.tools import ToolError  # noqa: E402
from search_tool import search  # noqa: E402  (this folder: the index the run's tool searches)

REWARD_LOG_NAME = "search_rewards.jsonl"


def found_answer(sample: Sample) -> bool:
    """Whether one of the episode's searches returned the passage holding the answer: its queries, run again on
    the same index (the search is deterministic)."""
    queries = [call.arguments.get("query") for trace in sample.metadata.get("rollout_traces") or []
               for call in parse_hermes_tool_calls(trace["response_text"]).tool_calls if call.name == "search"]
    return any(isinstance(query, str) and f"code {sample.label}." in search_results(query) for query in queries)


def search_results(query: str) -> str:
    try:
        return search(query)
    except ToolError:
        return ""


def search_reward(args: Any, sample: Sample) -> dict[str, float]:
    """Exact match of the final answer."""
    stats = episode_tool_stats(sample) or {}
    correct = float(final_answer(last_model_turn(sample)) == str(sample.label))
    reward = {"score": correct, "correct": correct,
              "tool_call_success": float(stats.get("success_rate", 0.0)),
              "called_tool": float(stats.get("calls", 0) + stats.get("parse_errors", 0) > 0),
              "found": float(found_answer(sample))}
    record_reward(args, sample, reward, REWARD_LOG_NAME)
    return reward
