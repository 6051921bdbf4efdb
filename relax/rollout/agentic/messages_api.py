"""Anthropic's Messages protocol (``POST /v1/messages``) on the agent gateway: Claude-Code-style agents.

A request is translated into the gateway's chat form (`AgentChatRequest`), the session runs the turn exactly as for
Chat Completions (token-in/token-out, the same trajectory and loss masks), and the chat completion is rendered back
as a Messages response or as its event stream. The mapping:

- ``system`` (a string or text blocks) is the first, system message;
- a user message's ``text`` blocks are a user message, each ``tool_result`` block a tool message answering the
  ``tool_use_id``, in the order they come;
- an assistant message's ``text`` blocks are its content and its ``tool_use`` blocks its tool calls (``input``
  as the arguments);
- ``tools`` (``name``, ``description``, ``input_schema``) reach the chat template as functions;
- ``max_tokens`` (required by the protocol) caps the turn, as ``max_tokens`` of a chat request does.

The response's ``stop_reason`` is ``end_turn``, ``max_tokens`` or ``tool_use``; ``usage`` counts the turn's context
and new tokens. With ``stream: true`` the events are Anthropic's (``message_start``, one ``content_block_start`` /
``_delta`` / ``_stop`` per block, ``message_delta``, ``message_stop``), ``ping`` while the turn generates. Errors
are Anthropic's ``{"type": "error", "error": {...}}``. Images, documents and thinking blocks are refused by name.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from relax.rollout.agentic.chat_request import (
    AgentChatRequest,
    AgentMessage,
    FunctionCall,
    GatewayError,
    ToolCall,
)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 409: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # temperature, metadata, ...: the training config decides


class MessagesTool(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class MessagesMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Body):
    """The fields of an Anthropic Messages request that the gateway reads."""

    messages: list[MessagesMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    model: str | None = None
    system: str | list[dict[str, Any]] | None = None
    tools: list[MessagesTool] | None = None
    stream: bool = False

    def to_chat(self) -> AgentChatRequest:
        messages: list[AgentMessage] = []
        if self.system:
            messages.append(AgentMessage(role="system", content=_text_of(self.system, "system")))
        for index, message in enumerate(self.messages):
            messages += _chat_messages(message, index)
        tools = [{"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                                   "parameters": tool.input_schema}} for tool in self.tools or ()]
        return AgentChatRequest(messages=messages, max_tokens=self.max_tokens, tools=tools or None)


def _text_of(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for index, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise GatewayError(400, f"{where}.{index}: blocks of type {kind!r} are not supported here (text only)",
                               f"{where}.{index}.type")
        parts.append(str(block.get("text", "")))
    return "".join(parts)


def _chat_messages(message: MessagesMessage, index: int) -> list[AgentMessage]:
    where = f"messages.{index}.content"
    if isinstance(message.content, str):
        return [AgentMessage(role=message.role, content=message.content)]
    if message.role == "assistant":
        text, calls = [], []
        for position, block in enumerate(message.content):
            kind = block.get("type")
            if kind == "text":
                text.append(str(block.get("text", "")))
            elif kind == "tool_use":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                    raise GatewayError(400, f"{where}.{position}: a tool_use block needs a name and an input object",
                                       f"{where}.{position}")
                calls.append(ToolCall(id=block.get("id"), function=FunctionCall(name=block["name"],
                                                                                 arguments=block.get("input", {}))))
            else:
                raise GatewayError(400, f"{where}.{position}: assistant blocks of type {kind!r} are not supported "
                                        "(text and tool_use)", f"{where}.{position}.type")
        return [AgentMessage(role="assistant", content="".join(text), tool_calls=calls or None)]
    out: list[AgentMessage] = []
    text: list[str] = []
    for position, block in enumerate(message.content):
        kind = block.get("type")
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_result":
            if text:
                out.append(AgentMessage(role="user", content="".join(text)))
                text = []
            if not isinstance(block.get("tool_use_id"), str):
                raise GatewayError(400, f"{where}.{position}: a tool_result block needs its tool_use_id",
                                   f"{where}.{position}.tool_use_id")
            result = block.get("content", "")
            out.append(AgentMessage(role="tool", content=_text_of(result, f"{where}.{position}.content"),
                                    tool_call_id=block["tool_use_id"]))
        else:
            raise GatewayError(400, f"{where}.{position}: user blocks of type {kind!r} are not supported (text and "
                                    "tool_result)", f"{where}.{position}.type")
    if text or not out:
        out.append(AgentMessage(role="user", content="".join(text)))
    return out


def message_response(completion: dict[str, Any]) -> dict[str, Any]:
    """The chat completion of a turn as an Anthropic message."""
    choice = completion["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    for call in message.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"])})
    usage = completion["usage"]
    return {"id": "msg_" + completion["id"].removeprefix("chatcmpl-"), "type": "message", "role": "assistant",
            "model": completion["model"], "content": content,
            "stop_reason": STOP_REASONS.get(choice["finish_reason"], "end_turn"), "stop_sequence": None,
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def stream_events(completion: dict[str, Any]) -> list[str]:
    """A finished turn as Anthropic's event stream (one delta per block: the turn is generated whole)."""
    message = message_response(completion)
    start = {**message, "content": [], "stop_reason": None,
             "usage": {"input_tokens": message["usage"]["input_tokens"], "output_tokens": 0}}
    events = [_event("message_start", {"message": start})]
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            opened, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            opened = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += [_event("content_block_start", {"index": index, "content_block": opened}),
                   _event("content_block_delta", {"index": index, "delta": delta}),
                   _event("content_block_stop", {"index": index})]
    events += [_event("message_delta", {"delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                                        "usage": {"output_tokens": message["usage"]["output_tokens"]}}),
               _event("message_stop", {})]
    return events


PING = _event("ping", {})


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def stream_error(error: GatewayError) -> str:
    return _event("error", {"error": error_body(error.status, error.message)["error"]})
