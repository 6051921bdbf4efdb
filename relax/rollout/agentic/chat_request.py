"""The chat form of an agent's turn: what the gateway reads of an OpenAI Chat Completions request, and what the
other protocols (Responses, Anthropic Messages) are translated into before the session runs the turn."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class GatewayError(Exception):
    """An HTTP error, answered in the shape of the protocol the request came in (OpenAI's or Anthropic's)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # agents send many OpenAI options that do not apply here


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class AgentMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise GatewayError(400, f"messages[{index}].content: parts of type {part.get('type')!r} are not "
                                        "supported (text only)", f"messages.{index}.content")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class StreamOptions(_Body):
    include_usage: bool = False


class AgentChatRequest(_Body):
    """The fields of an OpenAI chat request that the gateway reads. Temperature and top-p are accepted and ignored:
    the training config decides how the policy samples."""

    messages: list[AgentMessage] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1)  # one session records one trajectory
    tools: list[dict[str, Any]] | None = None
    logprobs: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
