"""Parse tool calls out of a model's text, and render tool results back, in the Hermes / Qwen format.

Qwen2.5 and Qwen3 (and Hermes 2 Pro, whose format they adopted) emit each call as

    <tool_call>
    {"name": "python", "arguments": {"code": "print(1)"}}
    </tool_call>

and their chat templates show each result to the model as ``<tool_response>\\n...\\n</tool_response>`` inside one
user turn. A malformed call becomes a parse error in the result, never an exception: the episode goes on and the
model is told what was wrong. Parsers are registered by name for ``--tool-call-parser``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, get_args

from relax.config import ToolCallParserName

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedMessage:
    """``content``: the text before the first call (all of it without calls); ``errors``: one line per malformed
    call, in order."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


ToolCallParser = Callable[[str], ParsedMessage]


def parse_hermes_tool_calls(text: str) -> ParsedMessage:
    """Every ``<tool_call>{json}</tool_call>`` block of ``text``; an unclosed last block (the response was cut)
    is a parse error."""
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return ParsedMessage(content=text.strip())
    calls, errors = [], []
    for number, match in enumerate(_HERMES_BLOCK.finditer(text, start), start=1):
        if not match.group(2):
            errors.append(f"tool call {number}: missing {TOOL_CALL_CLOSE}")
            continue
        try:
            calls.append(_tool_call_from_json(match.group(1)))
        except ValueError as err:
            errors.append(f"tool call {number}: {err}")
    return ParsedMessage(content=text[:start].strip(), tool_calls=calls, errors=errors)


def _tool_call_from_json(body: str) -> ToolCall:
    """``{"name": str, "arguments": object or JSON string of an object}``; ValueError says what is wrong."""
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as err:
        raise ValueError(f"invalid JSON ({err.msg} at character {err.pos})") from None
    if not isinstance(payload, dict):
        raise ValueError(f"expected a JSON object, got {type(payload).__name__}")
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError('missing "name" (a string)')
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models emit the OpenAI wire form: arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            raise ValueError(f'"arguments" of {name!r} is a string but not valid JSON ({err.msg})') from None
    if not isinstance(arguments, dict):
        raise ValueError(f'"arguments" of {name!r} must be an object, got {type(arguments).__name__}')
    return ToolCall(name=name, arguments=arguments)


# Every name the config takes (`--tool-call-parser`) reads the Hermes format: Qwen's names are aliases of it.
TOOL_CALL_PARSERS: dict[str, ToolCallParser] = dict.fromkeys(get_args(ToolCallParserName), parse_hermes_tool_calls)


def get_tool_call_parser(name: str) -> ToolCallParser:
    try:
        return TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(f"--tool-call-parser {name!r}: unknown parser; choose from "
                         f"{', '.join(sorted(TOOL_CALL_PARSERS))}") from None


def format_tool_responses(results: list[str]) -> str:
    """The results as Qwen's template renders consecutive ``tool`` messages: one ``<tool_response>`` block each."""
    return "\n".join(f"<tool_response>\n{result}\n</tool_response>" for result in results)


def tool_results_message(results: list[str], chat_template: str | None) -> dict[str, str]:
    """One chat message holding all results of a turn.

    A template that wraps ``tool`` messages in ``<tool_response>`` itself (Qwen2.5, Qwen3) renders N tool messages
    as one user turn of N blocks; a ``user`` message with the blocks already in it renders to exactly those bytes,
    where one ``tool`` message would be wrapped twice. Other templates get a ``tool`` message with the blocks."""
    role = "user" if chat_template and "<tool_response>" in chat_template else "tool"
    return {"role": role, "content": format_tool_responses(results)}
