"""``ToolEnv``: the interaction environment of tool-calling episodes.

After each model turn the environment parses the text with the ``--tool-call-parser``. Without a tool call the
turn is the final answer and the episode ends. Otherwise every call runs (each bounded by ``--tool-timeout``) and
the results come back as one message of ``<tool_response>`` blocks, in call order; a malformed call gets its parse
error as its response, so the model sees what went wrong.

Statistics: ``env.stats`` holds the episode's totals, and every ``step`` (and ``reset``) returns them in its info
under ``"tool_stats"`` (``calls``, ``successful_calls``, ``parse_errors``, ``success_rate``). The multi-turn loop
keeps each step's info in ``sample.metadata["rollout_traces"][turn]["env_info"]``; ``episode_tool_stats(sample)``
reads the totals from there for a reward function or a metric.

Use it with ``--rollout-interaction-env-path relax.rollout.agentic.tool_env``.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import Any

from relax.data.sample import Sample
from relax.rollout.agentic.env import BaseInteractionEnv, Observation
from relax.rollout.agentic.tool_parser import ToolCall, ToolCallParser, get_tool_call_parser, tool_results_message
from relax.rollout.agentic.tools import Tool, ToolError, available_tools, default_tool_names, select_tools

# Beyond --tool-timeout a tool gets this long to clean up (the python tool kills and reaps its process group).
CLEANUP_GRACE_S = 5.0
# Calls of one turn run at once; more than this many would be a fork bomb by other means.
MAX_CALLS_PER_TURN = 8


@dataclass
class ToolStats:
    """Totals over an episode. ``calls`` counts well-formed calls, ``parse_errors`` malformed ones;
    ``success_rate`` is successful calls over all attempted calls (0 when none were made)."""

    calls: int = 0
    successful_calls: int = 0
    parse_errors: int = 0

    @property
    def success_rate(self) -> float:
        attempts = self.calls + self.parse_errors
        return self.successful_calls / attempts if attempts else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "success_rate": self.success_rate}


class ToolEnv(BaseInteractionEnv):
    def __init__(self, tools: list[Tool], parser: ToolCallParser, timeout_s: float,
                 chat_template: str | None = None):
        self.tools = {tool.name: tool for tool in tools}
        self.parser = parser
        self.timeout_s = timeout_s
        self.chat_template = chat_template  # decides the role of result messages (see tool_results_message)
        self.stats = ToolStats()

    def reset(self) -> tuple[Observation, dict[str, Any]]:
        return {}, {"tool_stats": self.stats.as_dict()}

    async def step(self, response_text: str) -> tuple[Observation, bool, dict[str, Any]]:
        parsed = self.parser(response_text)
        if not parsed.tool_calls and not parsed.errors:
            return {}, True, {"tool_stats": self.stats.as_dict()}
        calls = parsed.tool_calls[:MAX_CALLS_PER_TURN]
        outcomes = await asyncio.gather(*(self._run(call) for call in calls))
        outcomes += [(False, f"Error: at most {MAX_CALLS_PER_TURN} tool calls per turn; this one did not run")
                     for _ in parsed.tool_calls[MAX_CALLS_PER_TURN:]]
        self.stats.calls += len(outcomes)
        self.stats.successful_calls += sum(ok for ok, _ in outcomes)
        self.stats.parse_errors += len(parsed.errors)
        results = [f"Error: could not parse the tool call: {error}" for error in parsed.errors]
        results += [text for _, text in outcomes]
        message = tool_results_message(results, self.chat_template)
        observation = {"obs_str": message["content"], "role": message["role"]}
        return observation, False, {"tool_stats": self.stats.as_dict()}

    async def _run(self, call: ToolCall) -> tuple[bool, str]:
        """(succeeded, the text the model is shown) for one call; every failure becomes text."""
        tool = self.tools.get(call.name)
        if tool is None:
            return False, f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(self.tools)) or 'none'}"
        try:
            return True, await asyncio.wait_for(tool.call(call.arguments), self.timeout_s + CLEANUP_GRACE_S)
        except ToolError as err:
            return False, f"Error: {err}"
        except TimeoutError:
            return False, f"Error: {call.name} timed out after {self.timeout_s:g} s"
        except Exception as err:  # a user tool's bug is the model's feedback, not the end of the rollout
            return False, f"Error: {call.name} failed: {type(err).__name__}: {err}"


def episode_tool_stats(sample: Sample) -> dict[str, float] | None:
    """The tool statistics of a finished multi-turn sample (from its last step's info), or None without any."""
    for trace in reversed(sample.metadata.get("rollout_traces") or []):
        stats = (trace.get("env_info") or {}).get("tool_stats")
        if stats is not None:
            return stats
    return None


def build_env(sample: Sample, args: Any) -> ToolEnv:
    """The environment of one sample: its tools are the specs the dataset stored in ``sample.metadata["tools"]``
    (from the ``--tool-key`` column), else ``--tools``."""
    entries = sample.metadata.get("tools") or default_tool_names(args)
    tools = select_tools(entries, available_tools(args), where=f"sample {sample.index}: metadata['tools']")
    tokenizer = getattr(args, "tokenizer", None)
    return ToolEnv(tools, get_tool_call_parser(args.tool_call_parser), args.tool_timeout,
                   chat_template=getattr(tokenizer, "chat_template", None))
