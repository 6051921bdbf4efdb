"""OpenAI's Responses protocol (``POST /v1/responses``) on the agent gateway: Codex-style agents.

A request is translated into the gateway's chat form (`AgentChatRequest`), the session runs the turn exactly as for
Chat Completions (token-in/token-out, the same trajectory and loss masks), and the chat completion is rendered back
as a Responses object or as its event stream. The mapping:

- ``instructions`` is the first, system message; ``input`` a string (one user message) or a list of items: messages
  (``role`` system, developer, user or assistant; string content or ``input_text`` / ``output_text`` parts),
  ``function_call`` items (the model's tool calls; those that follow an assistant message, or each other, belong
  to that one model turn) and ``function_call_output`` items (a tool message answering ``call_id``);
- ``tools`` of type ``function`` (``name``, ``description``, ``parameters``) reach the chat template; ``max_output_
  tokens`` caps the turn.

Multi-turn state, either way a Responses client keeps it: it sends the whole conversation again (the items of the
earlier responses included), or it sends ``previous_response_id`` (the session's last response) and only the new
items; the session keeps its history, so both give the same trajectory. A session is one linear trajectory, so
``previous_response_id`` must name its last response. The output holds a ``message`` item (``output_text``) when the
turn wrote text and one ``function_call`` item per tool call; ``status`` is ``incomplete`` (``max_output_tokens``)
when the length limit cut the turn. With ``stream: true`` the events are the protocol's (``response.created``,
``response.output_item.added``, ``response.output_text.delta``, ..., ``response.completed``).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from relax.rollout.agentic.chat_request import (
    AgentChatRequest,
    AgentMessage,
    FunctionCall,
    GatewayError,
    ToolCall,
)

_MESSAGE_ROLES = ("system", "developer", "user", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # store, reasoning, temperature, ...: the training config decides


class ResponsesRequest(_Body):
    """The fields of a Responses request that the gateway reads."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    previous_response_id: str | None = None
    stream: bool = False

    def to_chat(self, history: list[AgentMessage]) -> AgentChatRequest:
        """The chat request of this turn; ``history``: the session's messages so far (previous_response_id)."""
        if isinstance(self.input, str):
            if not self.input and self.previous_response_id is None:
                raise GatewayError(400, "input: an empty string; send the user's message", "input")
            new = [AgentMessage(role="user", content=self.input)]
        else:
            new = _chat_messages(self.input)
        if not new:
            raise GatewayError(400, "input: no items; send at least one message", "input")
        if self.previous_response_id is None:
            messages = ([AgentMessage(role="system", content=self.instructions)] if self.instructions else []) + new
        else:
            first = history[0] if history else None
            if self.instructions and not (first is not None and first.role == "system"
                                          and first.content == self.instructions):
                raise GatewayError(400, "instructions differ from the session's first ones; with "
                                        "previous_response_id the conversation keeps its start", "instructions")
            messages = list(history) + new
        return AgentChatRequest(messages=messages, max_tokens=self.max_output_tokens, tools=self._chat_tools())

    def _chat_tools(self) -> list[dict[str, Any]] | None:
        tools = []
        for index, tool in enumerate(self.tools or ()):
            if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                raise GatewayError(400, f"tools.{index}: only function tools (type function, with a name) are "
                                        f"served, got type {tool.get('type')!r}", f"tools.{index}")
            tools.append({"type": "function", "function": {"name": tool["name"],
                                                           "description": tool.get("description") or "",
                                                           "parameters": tool.get("parameters") or {}}})
        return tools or None


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise GatewayError(400, f"{where}: expected a string or a list of text parts", where)
    parts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise GatewayError(400, f"{where}.{index}: parts of type {kind!r} are not supported (text only)",
                               f"{where}.{index}.type")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _chat_messages(items: list[dict[str, Any]]) -> list[AgentMessage]:
    messages: list[AgentMessage] = []
    for index, item in enumerate(items):
        where = f"input.{index}"
        if not isinstance(item, dict):
            raise GatewayError(400, f"{where}: expected an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise GatewayError(400, f"{where}.role: {role!r} is not one of {list(_MESSAGE_ROLES)}", f"{where}.role")
            messages.append(AgentMessage(role=role, content=_text(item.get("content"), f"{where}.content")))
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", "{}"), str):
                raise GatewayError(400, f"{where}: a function_call item needs a name and arguments (a JSON string)",
                                   where)
            call = ToolCall(id=item.get("call_id"), function=FunctionCall(name=item["name"],
                                                                          arguments=item.get("arguments", "{}")))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # the same model turn: its text, then its calls
                last.tool_calls = [*(last.tool_calls or ()), call]
            else:
                messages.append(AgentMessage(role="assistant", content="", tool_calls=[call]))
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise GatewayError(400, f"{where}.call_id: a function_call_output item needs the call_id it answers",
                                   f"{where}.call_id")
            output = item.get("output", "")
            messages.append(AgentMessage(role="tool", content=_text(output, f"{where}.output"),
                                         tool_call_id=item["call_id"]))
        else:
            raise GatewayError(400, f"{where}.type: items of type {kind!r} are not supported (message, "
                                    "function_call, function_call_output)", f"{where}.type")
    return messages


def response_id(completion: dict[str, Any]) -> str:
    return "resp_" + completion["id"].removeprefix("chatcmpl-")


def response_object(completion: dict[str, Any], request: ResponsesRequest) -> dict[str, Any]:
    """The chat completion of a turn as a Responses object."""
    choice = completion["choices"][0]
    message, suffix = choice["message"], completion["id"].removeprefix("chatcmpl-")
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append({"type": "message", "id": f"msg_{suffix}", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": message["content"], "annotations": [],
                                    "logprobs": []}]})
    for index, call in enumerate(message.get("tool_calls") or ()):
        output.append({"type": "function_call", "id": f"fc_{suffix}_{index}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    cut = choice["finish_reason"] == "length"
    usage = completion["usage"]
    return {"id": response_id(completion), "object": "response", "created_at": completion["created"],
            "status": "incomplete" if cut else "completed", "model": completion["model"], "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "instructions": request.instructions, "previous_response_id": request.previous_response_id,
            "max_output_tokens": request.max_output_tokens, "tools": request.tools or [], "tool_choice": "auto",
            "parallel_tool_calls": True, "text": {"format": {"type": "text"}}, "metadata": {},
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                      "total_tokens": usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


def stream_events(completion: dict[str, Any], request: ResponsesRequest) -> list[str]:
    """A finished turn as the Responses event stream (one delta per item: the turn is generated whole)."""
    final = response_object(completion, request)
    events: list[dict[str, Any]] = []
    pending = {**final, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    events += [{"type": "response.created", "response": pending},
               {"type": "response.in_progress", "response": pending}]
    for index, item in enumerate(final["output"]):
        common = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            part = item["content"][0]
            events += [
                {"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "status": "in_progress", "content": []}},
                {"type": "response.content_part.added", **common, "content_index": 0,
                 "part": {**part, "text": ""}},
                {"type": "response.output_text.delta", **common, "content_index": 0, "delta": part["text"],
                 "logprobs": []},
                {"type": "response.output_text.done", **common, "content_index": 0, "text": part["text"],
                 "logprobs": []},
                {"type": "response.content_part.done", **common, "content_index": 0, "part": part},
            ]
        else:
            events += [
                {"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "status": "in_progress", "arguments": ""}},
                {"type": "response.function_call_arguments.delta", **common, "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", **common, "arguments": item["arguments"],
                 "name": item["name"]},
            ]
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": "response.incomplete" if final["status"] == "incomplete" else "response.completed",
                   "response": final})
    return [f"event: {event['type']}\ndata: {json.dumps({**event, 'sequence_number': number})}\n\n"
            for number, event in enumerate(events)]


def stream_error(error: GatewayError) -> str:
    body = {"type": "error", "code": str(error.status), "message": error.message, "param": error.param,
            "sequence_number": 0}
    return f"event: error\ndata: {json.dumps(body)}\n\n"
