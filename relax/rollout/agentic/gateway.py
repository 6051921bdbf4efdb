"""The agent gateway: OpenAI's ``/v1/chat/completions`` and ``/v1/responses`` and Anthropic's ``/v1/messages``,
through which an external agent program drives the policy, while Relax records the session's trajectory
token-in/token-out for training. The Responses and Messages requests are translated into the chat form
(`relax.rollout.agentic.responses_api`, `relax.rollout.agentic.messages_api`) and run as the same turns.

One gateway serves many sessions. A session is opened per sample (`AgentGateway.open_session`); its id is an
unguessable token that the agent sends as its API key (``Authorization: Bearer <session id>``). Unknown or closed
sessions get 401; the token is never logged or echoed. Anthropic clients send it as ``x-api-key``, which is taken too.

Token-in/token-out: every request replays the whole conversation. The gateway checks that the history is the
recorded one (earlier assistant messages equal, as text and tool calls, to what the model generated) followed by
new non-assistant messages, and encodes only those new messages, as the chat template's rendering of
``DUMMY + new`` minus the rendering of ``DUMMY`` (so earlier tokens are never re-tokenized). The tokens the
template puts after an assistant message that the model did not generate itself (ChatML's ``"\\n"`` after
``<|im_end|>``) are added too. Inserted tokens get loss mask 0, the model's tokens loss mask 1 and their log-probs.
A history that diverges from the recording (an edited or dropped turn) is answered 400: a session is one linear
trajectory; an agent that wants a new branch opens a new session. A request that repeats the history of the last
turn (a client retry) gets that turn's response again.

Sampling follows the training config (temperature, top-p, top-k, stop); ``max_tokens`` of a request can only lower
the configured response length, and ``--rollout-max-context-len`` caps the session's total tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from relax.backends.inference.base import GenerationOutput, GenerationRequest, SamplingParams
from relax.data.chat_template import ChatTemplateError, apply_template
from relax.rollout.agentic import messages_api, responses_api
from relax.rollout.agentic.chat_request import (
    AgentChatRequest,
    AgentMessage,
    GatewayError,
    ToolCall,
)
from relax.rollout.agentic.tool_parser import ToolCallParser, parse_hermes_tool_calls
from relax.utils.http_server import EmbeddedServer, HTTPLimits, uvicorn_config, wait_unless_client_gone

logger = logging.getLogger("relax.agent_gateway")

# Rendered before new messages and cut off again, so that only the new messages' tokens remain (upstream's trick).
DUMMY_MESSAGES = [{"role": "system", "content": "dummy system"}, {"role": "user", "content": "dummy user"}]
_CONTENT_MARKER = "RELAX-CONTENT-MARKER"
START_TIMEOUT_S = 30.0
SSE_HEARTBEAT_S = 15.0  # a buffered stream sends SSE comments while the turn generates, as upstream


def _error_response(status: int, message: str, param: str | None = None, path: str = "") -> JSONResponse:
    """An error in the shape of the protocol of ``path``: Anthropic's for /v1/messages, OpenAI's otherwise."""
    if path.endswith("/v1/messages"):
        return JSONResponse(messages_api.error_body(status, message), status_code=status)
    kind = {400: "invalid_request_error", 401: "authentication_error", 409: "conflict"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


# What the routes document besides their 200 (the fuzz tests hold them to it).
_ERRORS = {400: {"description": "a bad body, or a history that does not extend the session's"},
           401: {"description": "unknown or closed session"}, 413: {"description": "body too large"}}


# ----------------------------------------------------------------------------- chat template


def _canonical_arguments(arguments: str | dict[str, Any]) -> str:
    """Tool-call arguments as canonical JSON, so a client that re-serializes them still matches."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


def _comparable(message: AgentMessage, index: int) -> tuple:
    """What must stay equal when a message is replayed (tool-call ids and names of assistants aside)."""
    calls = tuple((call.function.name, _canonical_arguments(call.function.arguments))
                  for call in message.tool_calls or ())
    if message.role == "assistant":
        return ("assistant", message.text(index), calls)
    return (message.role, message.text(index), calls, message.tool_call_id, message.name)


def _template_message(message: AgentMessage, index: int) -> dict[str, Any]:
    """The message as a dict for ``apply_chat_template``."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text(index)}
    if message.tool_calls:
        rendered["tool_calls"] = [{"type": "function", "id": call.id, "function": {
            "name": call.function.name, "arguments": _arguments_object(call.function.arguments)}}
            for call in message.tool_calls]
    for key in ("tool_call_id", "name"):
        if getattr(message, key) is not None:
            rendered[key] = getattr(message, key)
    return rendered


def _arguments_object(arguments: str | dict[str, Any]) -> Any:
    # Templates (Qwen's among them) print dict arguments as JSON and strings as they are.
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            return json.loads(arguments)
    return arguments


class ChatTemplate:
    """Token ids of chat messages by the tokenizer's chat template."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the agent gateway needs a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.assistant_end = self._assistant_end_text()

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool, tools: list | None = None) -> str:
        return apply_template(self.tokenizer, messages, tools=tools, add_generation_prompt=generation_prompt,
                              **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def prompt(self, messages: list[dict[str, Any]], tools: list | None) -> list[int]:
        """The first request: every message, then the generation prompt."""
        return self.encode(self.render(messages, True, tools))

    def continuation(self, previous_output_ids: list[int], new_messages: list[dict[str, Any]]) -> list[int]:
        """Tokens after a model turn: the end of the assistant message the model did not write, the new messages,
        and the generation prompt."""
        base = self.render(DUMMY_MESSAGES, False)
        full = self.render(DUMMY_MESSAGES + new_messages, True)
        if not full.startswith(base):
            raise GatewayError(500, "the chat template renders earlier messages differently when messages follow; "
                                    "the new messages cannot be encoded on their own")
        generated = self.tokenizer.decode(previous_output_ids, skip_special_tokens=False)
        return self.encode(_unwritten_end(generated, self.assistant_end) + full[len(base):])

    def _assistant_end_text(self) -> str:
        """What the template writes after an assistant message's content (ChatML: ``"<|im_end|>\\n"``)."""
        text = self.render(DUMMY_MESSAGES + [{"role": "assistant", "content": _CONTENT_MARKER}], False)
        return text[text.rindex(_CONTENT_MARKER) + len(_CONTENT_MARKER):]


def _unwritten_end(generated: str, assistant_end: str) -> str:
    """The part of ``assistant_end`` that the model's text does not already end with (``"\\n"`` after an EOS
    ``<|im_end|>``; all of it after a turn cut by the length limit)."""
    for written in range(len(assistant_end), 0, -1):
        if generated.endswith(assistant_end[:written]):
            return assistant_end[written:]
    return assistant_end


# ----------------------------------------------------------------------------- sessions


@dataclass
class Trajectory:
    """A session's tokens: ``prompt_ids`` (the first request, up to its generation prompt), then ``response_ids``,
    with one ``loss_mask`` (1 = model token), ``log_probs`` (0.0 for inserted tokens) and ``weight_versions``
    entry per response token. ``finish_reason`` is the last model turn's; ``stop_reason`` says why a session
    ended early (``budget_exhausted``)."""

    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    turns: int = 0
    finish_reason: str | None = None
    stop_reason: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def append(self, ids: list[int], mask: int, log_probs: list[float], versions: list[int]) -> None:
        self.response_ids += ids
        self.loss_mask += [mask] * len(ids)
        self.log_probs += log_probs
        self.weight_versions += versions


@dataclass
class _PreparedTurn:
    input_ids: list[int]  # the whole context the model sees
    inserted_ids: list[int]  # new tokens after the recorded ones (empty on the first turn)
    comparables: list[tuple]  # the request's messages, for later comparison
    max_new_tokens: int


class Session:
    """One agent episode: its recorded trajectory and the messages that produced it."""

    def __init__(self, session_id: str, name: str, engine: Any, sampling: SamplingParams,
                 max_context_len: int | None, gateway: AgentGateway, answer_room: int | None = None) -> None:
        self.session_id = session_id  # the bearer token: never logged
        self.name = name  # a public label for logs and request ids
        # The key under which the engine keeps this session's K/V between turns (--agentic-session-lifecycle); not
        # the bearer token, which must stay out of the engine's state and logs.
        self.engine_session_id = f"agent-{uuid.uuid4().hex}" if gateway.session_lifecycle else None
        self.engine = engine
        self.sampling = sampling
        # The tokens a prompt and its answer share on the engine (the model's positions, a smaller KV pool): no
        # budget passes them (the engine refuses such a turn).
        self.answer_room = answer_room
        self.max_context_len = max_context_len if max_context_len is None or answer_room is None \
            else min(max_context_len, answer_room)
        self.trajectory = Trajectory()
        self._gateway = gateway
        self._messages: list[tuple] = []  # comparable forms of the recorded messages
        self._last_turn: tuple[list[tuple], dict[str, Any]] | None = None  # (request history, response)
        self._lock = asyncio.Lock()  # one turn at a time: each turn extends the previous one
        self._in_flight: str | None = None
        self._last_output_ids: list[int] = []  # the previous model turn, to close its assistant message
        # The messages after each of the last two turns, by the turn's completion id: a Responses client names the
        # last one in previous_response_id, or the one before when it retries the last turn.
        self._histories: dict[str, list[AgentMessage]] = {}
        self.closed = False

    async def run_turn(self, body: AgentChatRequest) -> dict[str, Any]:
        """Check and extend the trajectory by one model turn; the chat.completion response."""
        async with self._lock:
            comparables = [_comparable(message, i) for i, message in enumerate(body.messages)]
            if self._last_turn is not None and comparables == self._last_turn[0]:
                return self._last_turn[1]  # a retry of the last turn: same answer, nothing recorded twice
            turn = self._prepare(body, comparables)
            output = await self._generate(turn)
            content, tool_calls = self._gateway.split_tool_calls(output.text)
            assistant = self._record(turn, output, content, tool_calls)
            response = _chat_completion(self._gateway.model_name, turn, output, content, tool_calls,
                                        body.logprobs, self._gateway.template.tokenizer)
            self._last_turn = (comparables, response)
            if assistant is not None:
                self._histories = {**{key: value for key, value in list(self._histories.items())[-1:]},
                                   response["id"]: [*body.messages, assistant]}
            return response

    def history_after(self, completion_id: str, param: str) -> list[AgentMessage]:
        """The messages after the turn ``completion_id`` (one of the last two); 400 naming ``param`` otherwise."""
        history = self._histories.get(completion_id)
        if history is None:
            raise GatewayError(400, f"{param}: not this session's last response (a session is one linear "
                                    "trajectory: continue from its last response, or open a new session)", param)
        return list(history)

    def _prepare(self, body: AgentChatRequest, comparables: list[tuple]) -> _PreparedTurn:
        template = self._gateway.template
        first_turn = self.trajectory.turns == 0
        new_start = 0 if first_turn else self._check_history(comparables)
        new = [_template_message(m, new_start + i) for i, m in enumerate(body.messages[new_start:])]
        try:
            if first_turn:
                inserted, context = [], template.prompt(new, body.tools)
            else:
                inserted = template.continuation(self._last_output_ids, new)
                context = self.trajectory.tokens + inserted
        except ChatTemplateError as error:  # the template's own refusal of these messages (or tools)
            raise GatewayError(400, f"messages: {error}", "messages") from None
        requested = body.max_completion_tokens or body.max_tokens or self.sampling.max_new_tokens
        max_new_tokens = min(requested, self.sampling.max_new_tokens)
        if self.max_context_len is None:  # the multi-turn loop's default budget: the prompt + one response length
            self.max_context_len = len(context) + self.sampling.max_new_tokens
            if self.answer_room is not None:  # (a long first prompt's would pass it, as the loop's did)
                self.max_context_len = min(self.max_context_len, self.answer_room)
        if self.max_context_len - len(context) < 1:
            self.trajectory.stop_reason = "budget_exhausted"
            raise GatewayError(400, f"context budget exhausted: this turn would start at {len(context)} tokens of "
                                    f"the session's {self.max_context_len} (--rollout-max-context-len)", "messages")
        max_new_tokens = min(max_new_tokens, self.max_context_len - len(context))
        return _PreparedTurn(context, inserted, comparables, max_new_tokens)

    def _check_history(self, comparables: list[tuple]) -> int:
        """Index of the first new message; 400 unless the request extends the recorded history."""
        recorded = self._messages
        if len(comparables) <= len(recorded):
            raise GatewayError(400, f"messages: {len(comparables)} messages but the session has recorded "
                                    f"{len(recorded)}; send the whole history plus at least one new message",
                               "messages")
        for index, (sent, kept) in enumerate(zip(comparables, recorded)):
            if sent != kept:
                what = "what the model generated" if kept[0] == "assistant" else "the message recorded earlier"
                raise GatewayError(400, f"messages[{index}] ({sent[0]}) differs from {what} in this session: "
                                        "token-in/token-out needs the history replayed unchanged (open a new "
                                        "session for a new branch)", f"messages.{index}")
        for index in range(len(recorded), len(comparables)):
            if comparables[index][0] == "assistant":
                raise GatewayError(400, f"messages[{index}]: a new assistant message; in a session only the model "
                                        "writes assistant turns", f"messages.{index}")
        return len(recorded)

    async def _generate(self, turn: _PreparedTurn) -> GenerationOutput:
        request_id = f"agent-{self.name}-t{self.trajectory.turns}-{uuid.uuid4().hex[:8]}"
        params = replace(self.sampling, max_new_tokens=turn.max_new_tokens)
        self._in_flight = request_id
        try:
            [output] = await self.engine.generate([GenerationRequest(request_id, turn.input_ids, params,
                                                                     session_id=self.engine_session_id)])
        except (ValueError, TypeError) as error:  # the engine's request validation
            raise GatewayError(400, str(error)) from error
        finally:
            self._in_flight = None
        return output

    def _record(self, turn: _PreparedTurn, output: GenerationOutput, content: str,
                tool_calls: list[dict[str, Any]]) -> AgentMessage | None:
        """Append the turn to the trajectory; the model's message (None when the session was closed meanwhile)."""
        trajectory = self.trajectory
        if self.closed:
            return None  # the agent was stopped while this turn generated: the sample is already built
        versions = list(output.output_weight_versions or [output.weight_version] * len(output.output_ids))
        if trajectory.turns == 0:
            trajectory.prompt_ids = list(turn.input_ids)
        # Inserted tokens carry the version of the model tokens before them, as in the multi-turn loop.
        previous_version = trajectory.weight_versions[-1] if trajectory.weight_versions else output.weight_version
        trajectory.append(turn.inserted_ids, 0, [0.0] * len(turn.inserted_ids),
                          [previous_version] * len(turn.inserted_ids))
        trajectory.append(list(output.output_ids), 1, list(output.output_log_probs), versions)
        trajectory.turns += 1
        trajectory.finish_reason = output.finish_reason
        self._last_output_ids = list(output.output_ids)
        assistant = AgentMessage(role="assistant", content=content,
                                 tool_calls=[ToolCall.model_validate(call) for call in tool_calls] or None)
        self._messages = turn.comparables + [_comparable(assistant, len(turn.comparables))]
        return assistant

    async def abort(self) -> None:
        self.closed = True
        await self.abort_turn()

    async def abort_turn(self) -> None:
        """Abort the turn being generated (its agent went away); the session stays open."""
        if self._in_flight is not None:
            await self.engine.abort([self._in_flight])


def _chat_completion(model: str, turn: _PreparedTurn, output: GenerationOutput, content: str,
                     tool_calls: list[dict[str, Any]], want_logprobs: bool, tokenizer: Any) -> dict[str, Any]:
    finish = "tool_calls" if tool_calls and output.finish_reason == "stop" else output.finish_reason
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    logprobs = None
    if want_logprobs:
        logprobs = {"content": [{"token": tokenizer.decode([token]), "logprob": log_prob, "bytes": None,
                                 "top_logprobs": []}
                                for token, log_prob in zip(output.output_ids, output.output_log_probs)]}
    prompt_tokens, completion_tokens = len(turn.input_ids), len(output.output_ids)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                         "logprobs": logprobs}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


# ----------------------------------------------------------------------------- the gateway


def openai_tool_calls(parser: ToolCallParser) -> Callable[[str], tuple[str, list[dict[str, Any]]]]:
    """A splitter of model text into OpenAI ``content`` and ``tool_calls`` by ``parser`` (relax.rollout.agentic.
    tool_parser). A turn with a malformed call stays plain content, so the agent sees exactly what the model wrote."""

    def split(text: str) -> tuple[str, list[dict[str, Any]]]:
        parsed = parser(text)
        if not parsed.tool_calls or parsed.errors:
            return text, []
        return parsed.content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                 "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                                for call in parsed.tool_calls]

    return split


class AgentGateway:
    """Serves ``/v1/chat/completions``, ``/v1/responses``, ``/v1/messages`` and ``/v1/models`` (and its OpenAPI
    schema at ``/openapi.json``) on 127.0.0.1 (a free port) in the running event loop.

    ``tokenizer`` (with a chat template) encodes the messages; ``split_tool_calls(text) -> (content, tool_calls)``
    turns a model turn into an OpenAI message (default: Hermes/Qwen ``<tool_call>`` blocks, `openai_tool_calls`).
    """

    def __init__(self, tokenizer: Any, *, model_name: str = "relax-policy",
                 chat_template_kwargs: dict[str, Any] | None = None,
                 split_tool_calls: Callable[[str], tuple[str, list[dict[str, Any]]]] | None = None,
                 http_limits: HTTPLimits | None = None, session_lifecycle: bool = False) -> None:
        self.template = ChatTemplate(tokenizer, chat_template_kwargs)
        self.session_lifecycle = session_lifecycle  # the engine keeps each session's K/V until it closes
        self.http_limits = http_limits  # what one client may take (`relax.utils.http_server.HTTPLimits`)
        self.model_name = model_name
        self.split_tool_calls = split_tool_calls or openai_tool_calls(parse_hermes_tool_calls)
        self.sessions: dict[str, Session] = {}
        self.app = self._build_app()
        self.port: int | None = None
        self._server: Any = None
        self._task: asyncio.Task | None = None

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("the agent gateway is not started")
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._server = EmbeddedServer(uvicorn_config(self.app, self.http_limits, log_level="warning", access_log=False,
                                                     lifespan="off"))
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while not self._server.started:
            if self._task.done() or asyncio.get_running_loop().time() > deadline:
                problem = self._task.exception() if self._task.done() else "timeout"
                raise RuntimeError(f"the agent gateway did not start on 127.0.0.1:{self.port}: {problem}")
            await asyncio.sleep(0.01)
        logger.debug("agent gateway on %s", self.base_url)  # once per rollout step: debug, not info

    async def close(self) -> None:
        for session in list(self.sessions.values()):
            await session.abort()
        self.sessions.clear()
        if self._task is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(self._task, 10)
            except Exception as error:  # noqa: BLE001 - a failed start or stop must not mask the run's own error
                logger.warning("agent gateway on port %s: %s: %s", self.port, type(error).__name__, error)
            self._task = None

    def open_session(self, engine: Any, sampling: SamplingParams, *, max_context_len: int | None = None,
                     name: str | None = None, answer_room: int | None = None) -> Session:
        """A new session that generates with ``engine`` (``generate(requests)`` and ``abort(ids)``; a
        `RequestBatcher` merges the concurrent turns of many sessions) and ``sampling`` (its ``max_new_tokens``
        caps every turn). ``max_context_len`` caps the session's tokens (None: the first prompt's length plus
        ``sampling.max_new_tokens``, the multi-turn loop's default, within ``answer_room`` tokens,
        `relax.backends.inference.answer_room`)."""
        session_id = secrets.token_urlsafe(32)
        session = Session(session_id, name or uuid.uuid4().hex[:8], engine, sampling, max_context_len, self,
                          answer_room)
        self.sessions[session_id] = session
        return session

    async def close_session(self, session: Session) -> Trajectory:
        """Stop serving the session (its token gets 401 from now on), let the engine drop its K/V, and return its
        trajectory."""
        self.sessions.pop(session.session_id, None)
        await session.abort()
        close = getattr(session.engine, "close_session", None)
        if session.engine_session_id is not None and close is not None:
            await close(session.engine_session_id)
        return session.trajectory

    # ------------------------------------------------------------------------- HTTP

    def _session_of(self, request: Request) -> Session:
        """The session whose id the request carries as its API key: ``Authorization: Bearer`` (OpenAI clients) or
        ``x-api-key`` (Anthropic clients)."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        key = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "").strip()
        session = self.sessions.get(key) if key else None
        if session is None:
            raise GatewayError(401, "unknown or closed session: send Authorization: Bearer $RELAX_SESSION_ID (or "
                                    "x-api-key: $RELAX_SESSION_ID)")
        return session

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="relax agent gateway", docs_url=None, redoc_url=None)

        @app.exception_handler(RequestValidationError)
        async def _invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
            problems = [(".".join(str(p) for p in item.get("loc", ()) if p != "body") or "body",
                         str(item.get("msg", "")).removeprefix("Value error, ")) for item in error.errors()]
            message = "; ".join(f"{where}: {what}" for where, what in problems) or "invalid request body"
            return _error_response(400, message, problems[0][0] if problems else None, request.url.path)

        @app.exception_handler(GatewayError)
        async def _gateway_error(request: Request, error: GatewayError) -> JSONResponse:
            return _error_response(error.status, error.message, error.param, request.url.path)

        @app.get("/v1/models", responses=_ERRORS)
        async def models(request: Request) -> dict[str, Any]:
            self._session_of(request)
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "relax"}]}

        @app.post("/v1/chat/completions", responses=_ERRORS)
        async def chat_completions(body: AgentChatRequest, request: Request) -> Any:
            session = self._session_of(request)
            if body.stream:
                include_usage = body.stream_options is not None and body.stream_options.include_usage
                return await _buffered_stream(session, body, lambda done: [
                    f"data: {json.dumps(chunk)}\n\n" for chunk in _stream_chunks(done, include_usage)
                ] + ["data: [DONE]\n\n"], _chat_stream_error)
            return await _turn_unless_gone(session, body, request)

        @app.post("/v1/responses", responses=_ERRORS)
        async def responses(body: responses_api.ResponsesRequest, request: Request) -> Any:
            session = self._session_of(request)
            history = [] if body.previous_response_id is None else session.history_after(
                "chatcmpl-" + body.previous_response_id.removeprefix("resp_"), "previous_response_id")
            chat = body.to_chat(history)
            if body.stream:
                return await _buffered_stream(session, chat, lambda done: responses_api.stream_events(done, body),
                                              responses_api.stream_error)
            completion = await _turn_unless_gone(session, chat, request)
            return completion if isinstance(completion, Response) else responses_api.response_object(completion, body)

        @app.post("/v1/messages", responses=_ERRORS)
        async def messages(body: messages_api.MessagesRequest, request: Request) -> Any:
            session = self._session_of(request)
            chat = body.to_chat()
            if body.stream:
                return await _buffered_stream(session, chat, messages_api.stream_events, messages_api.stream_error,
                                              heartbeat=messages_api.PING)
            completion = await _turn_unless_gone(session, chat, request)
            return completion if isinstance(completion, Response) else messages_api.message_response(completion)

        return app


async def _turn_unless_gone(session: Session, body: AgentChatRequest, request: Request) -> dict[str, Any] | Response:
    """The turn's chat completion; an agent that goes away mid-turn (killed, timed out) leaves no one to read the
    turn: it is aborted (recorded as it stands, finish "abort"), not decoded to its end, and answered 499."""
    turn = asyncio.ensure_future(session.run_turn(body))
    try:
        await wait_unless_client_gone(turn, request.receive)
    finally:
        if not turn.done():
            await session.abort_turn()
    if not turn.done():
        await asyncio.wait({turn}, timeout=SSE_HEARTBEAT_S)
        return Response(status_code=499)
    return turn.result()


_ABORTS: set[asyncio.Task] = set()  # aborts started from cancelled streams, kept until they end


async def _buffered_stream(session: Session, body: AgentChatRequest,
                           events_of: Callable[[dict[str, Any]], list[str]],
                           error_event: Callable[[GatewayError], str], heartbeat: str = ": keep-alive\n\n") -> Any:
    """``stream: true``: the whole turn as the protocol's events (``events_of`` the turn's chat completion: SSE
    text), ``heartbeat`` while it generates. Errors found before the first heartbeat (a bad history) are still plain
    HTTP errors; later ones are ``error_event``."""
    turn = asyncio.ensure_future(session.run_turn(body))
    done, _ = await asyncio.wait({turn}, timeout=SSE_HEARTBEAT_S)
    if done and turn.exception() is not None:
        raise turn.exception()  # type: ignore[misc]

    async def events() -> AsyncIterator[str]:
        try:
            while not turn.done():
                yield heartbeat
                await asyncio.wait({turn}, timeout=SSE_HEARTBEAT_S)
        finally:  # the agent went away mid-turn (the response was cancelled): the turn is aborted
            if not turn.done():  # in a task of its own: an await here would be cancelled with the response
                task = asyncio.get_running_loop().create_task(session.abort_turn())
                _ABORTS.add(task)
                task.add_done_callback(_ABORTS.discard)
        try:
            response = turn.result()
        except GatewayError as error:
            yield error_event(error)
            return
        for event in events_of(response):
            yield event

    return StreamingResponse(events(), media_type="text/event-stream")


def _chat_stream_error(error: GatewayError) -> str:
    return f"data: {json.dumps({'error': {'message': error.message, 'code': error.status}})}\n\n"


def _stream_chunks(response: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    choice = response["choices"][0]
    delta = dict(choice["message"])
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
    base = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"]}
    chunks = [{**base, "choices": [{"index": 0, "delta": delta, "finish_reason": choice["finish_reason"],
                                    "logprobs": choice["logprobs"]}]}]
    if include_usage:
        chunks.append({**base, "choices": [], "usage": response["usage"]})
    return chunks
