"""The agent gateway's Responses (`relax.rollout.agentic.responses_api`) and Anthropic Messages
(`relax.rollout.agentic.messages_api`) protocols, driven by the official `openai` and `anthropic` clients against a
real uvicorn server on 127.0.0.1 in front of the real tiny embedded engine: plain turns, streaming, tool calls and
multi-turn state land in the same token-in/token-out trajectory as Chat Completions; bad requests get 4xx naming the
field, in each protocol's error shape; the schema the gateway publishes is fuzzed."""

from __future__ import annotations

import asyncio
import json
import threading

import anthropic
import httpx
import openai
import pytest
import schemathesis

# Imported here, not lazily by `schemathesis.openapi.from_url` while a server thread runs: pytest rewrites a
# plugin's modules with ast.parse as they import, and CPython 3.11's AST conversion keeps its recursion depth
# per interpreter, not per thread, so two threads parsing at once failed a CI run with "SystemError: AST
# constructor recursion depth mismatch" (python/cpython#106905, fixed in 3.12). pyproject's addopts no longer
# autoload plugins, so pytest leaves schemathesis unrewritten; the import stays for a run that loads it (-p).
import schemathesis.specs.openapi.schemas  # noqa: F401
from anthropic import AsyncAnthropic
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, status_code_conformance

from relax.backends.inference.base import SamplingParams
from relax.backends.inference.batcher import RequestBatcher
from relax.rollout.agentic.gateway import AgentGateway, openai_tool_calls
from relax.rollout.agentic.tool_parser import parse_hermes_tool_calls
from tests.rollout.agentic.test_agent_gateway import client_of, run_with_gateway

ADD_CALL = openai_tool_calls(parse_hermes_tool_calls)(
    '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')[1][0]
ADD_TOOL = {"name": "add", "description": "adds two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}


def anthropic_of(gateway: AgentGateway, key: str) -> AsyncAnthropic:
    return AsyncAnthropic(base_url=gateway.base_url.removesuffix("/v1"), api_key=key, max_retries=0, timeout=30)


def _model_text(engine, trajectory, count: int) -> str:
    """The text of the last ``count`` model tokens of the trajectory, as the gateway answers it."""
    return engine.tokenizer.decode(trajectory.response_ids[-count:], skip_special_tokens=True)


# ----------------------------------------------------------------------------- Responses


def test_responses_plain_turns_and_both_kinds_of_multi_turn_state_give_one_trajectory(engine):
    """A turn through `client.responses`; then a second turn once with previous_response_id and new items only,
    and once (another session, same seed) with the whole conversation sent again: the same trajectory, equal to the
    Chat Completions one of the same conversation."""
    tool_output = {"type": "function_call_output", "call_id": "call_1", "output": "3"}

    async def by_previous_id(gateway, session):
        client = client_of(gateway, session.session_id)
        first = await client.responses.create(model="policy", instructions="be brief", input="1+2=",
                                              max_output_tokens=4)
        assert first.previous_response_id is None and first.status in ("completed", "incomplete")
        text_1 = _model_text(engine, session.trajectory, first.usage.output_tokens)
        second = await client.responses.create(model="policy", instructions="be brief", input=[tool_output],
                                               previous_response_id=first.id)
        retry = await client.responses.create(model="policy", input=[tool_output], previous_response_id=first.id)
        return first, text_1, second, retry, session.trajectory

    async def by_replay(gateway, session):
        client = client_of(gateway, session.session_id)
        first = await client.responses.create(model="policy", instructions="be brief", input="1+2=",
                                              max_output_tokens=4)
        replay = [{"role": "user", "content": "1+2="}, *[item.model_dump() for item in first.output], tool_output]
        await client.responses.create(model="policy", instructions="be brief", input=replay)
        return session.trajectory

    async def by_chat(gateway, session):
        client = client_of(gateway, session.session_id)
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}]
        first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "tool", "content": "3", "tool_call_id": "call_1"}]
        await client.chat.completions.create(model="policy", messages=messages)
        return session.trajectory

    first, text_1, second, retry, trajectory = run_with_gateway(engine, by_previous_id)
    assert first.output_text == text_1 and first.usage.output_tokens >= 1
    assert second.previous_response_id == first.id and trajectory.turns == 2
    assert second.output_text == _model_text(engine, trajectory, second.usage.output_tokens)
    assert retry.id == second.id and retry.output_text == second.output_text  # a retry: nothing recorded twice
    replayed, chat = run_with_gateway(engine, by_replay), run_with_gateway(engine, by_chat)
    for other in (replayed, chat):
        assert other.tokens == trajectory.tokens and other.loss_mask == trajectory.loss_mask


def test_responses_stream_tool_calls_and_their_replay(engine):
    async def scenario(gateway, session):
        gateway.split_tool_calls = lambda model_text: (model_text, [ADD_CALL])  # as if the model called "add"
        client = client_of(gateway, session.session_id)
        stream = await client.responses.create(model="policy", input="3+4=", tools=[{"type": "function", **ADD_TOOL}],
                                               stream=True)
        events = [event async for event in stream]
        final = events[-1].response
        calls = [item for item in final.output if item.type == "function_call"]
        result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "7"}
        edited = [item.model_dump() for item in final.output]
        edited[-1]["arguments"] = '{"a": 3, "b": 5}'
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model="policy", input=[{"role": "user", "content": "3+4="}, *edited, result])
        await client.responses.create(model="policy", input=[result], previous_response_id=final.id)
        return events, final, refused.value, session.trajectory

    events, final, refused, trajectory = run_with_gateway(engine, scenario)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed",
                                                                                       "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "response.function_call_arguments.done" in kinds
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text
    call = next(item for item in final.output if item.type == "function_call")
    assert call.name == "add" and json.loads(call.arguments) == {"a": 3, "b": 4}
    assert "differs from what the model generated" in str(refused) and trajectory.turns == 2


# ----------------------------------------------------------------------------- Anthropic Messages


def test_messages_plain_streaming_and_tool_use_turns(engine):
    async def scenario(gateway, session):
        gateway.split_tool_calls = lambda model_text: (model_text, [ADD_CALL])
        client = anthropic_of(gateway, session.session_id)
        tools = [{"name": "add", "description": "adds", "input_schema": ADD_TOOL["parameters"]}]
        messages = [{"role": "user", "content": "3+4="}]
        first = await client.messages.create(model="policy", max_tokens=4, system="be brief", messages=messages,
                                             tools=tools)
        first_count = first.usage.output_tokens
        text_1 = _model_text(engine, session.trajectory, first_count)
        use = next(block for block in first.content if block.type == "tool_use")
        messages += [{"role": "assistant", "content": [block.model_dump() for block in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "7"},
                                                  {"type": "text", "text": "go on"}]}]
        async with client.messages.stream(model="policy", max_tokens=5, system="be brief", messages=messages,
                                          tools=tools) as stream:
            streamed = [event.type async for event in stream]
            second = await stream.get_final_message()
        return first, text_1, use, streamed, second, session.trajectory

    first, text_1, use, streamed, second, trajectory = run_with_gateway(engine, scenario)
    assert first.type == "message" and first.role == "assistant"
    assert "".join(block.text for block in first.content if block.type == "text") == text_1
    assert use.name == "add" and use.input == {"a": 3, "b": 4}
    assert first.stop_reason in ("tool_use", "max_tokens")
    assert streamed[0] == "message_start" and "content_block_start" in streamed and streamed[-1] == "message_stop"
    assert trajectory.turns == 2 and second.usage.output_tokens >= 1
    assert second.usage.input_tokens == len(trajectory.tokens) - second.usage.output_tokens
    # the tool result and the user's text after it: one tool message, then one user message, both loss mask 0
    observation = engine.tokenizer.decode([t for t, m in zip(trajectory.response_ids, trajectory.loss_mask) if not m])
    assert observation.index("7") < observation.index("go on")


def test_messages_and_responses_refuse_bad_requests_naming_the_field(engine):
    async def scenario(gateway, session):
        key = session.session_id
        claude, gpt = anthropic_of(gateway, key), client_of(gateway, key)
        failures = {}
        for name, call in {
            "no max_tokens": lambda: claude.post("/v1/messages", cast_to=object,
                                                 body={"messages": [{"role": "user", "content": "hi"}]}),
            "image block": lambda: claude.messages.create(model="p", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]),
            "tool_result without id": lambda: claude.messages.create(model="p", max_tokens=4, messages=[
                {"role": "user", "content": [{"type": "tool_result", "content": "7"}]}]),
            "bad role": lambda: claude.messages.create(model="p", max_tokens=4,
                                                       messages=[{"role": "system", "content": "hi"}]),
            "reasoning item": lambda: gpt.responses.create(model="p", input=[{"type": "reasoning", "summary": []}]),
            "unknown previous": lambda: gpt.responses.create(model="p", input="hi", previous_response_id="resp_x"),
            "image part": lambda: gpt.responses.create(model="p", input=[{"role": "user", "content": [
                {"type": "input_image", "image_url": "http://127.0.0.1/x.png"}]}]),
            "web search tool": lambda: gpt.responses.create(model="p", input="hi", tools=[{"type": "web_search"}]),
            "zero output tokens": lambda: gpt.responses.create(model="p", input="hi", max_output_tokens=0),
        }.items():
            with pytest.raises((anthropic.APIStatusError, openai.APIStatusError)) as caught:
                await call()
            failures[name] = caught.value
        async with httpx.AsyncClient() as http:  # each protocol's own error shape for a bad key
            bad_key = await http.post(f"{gateway.base_url}/messages", headers={"x-api-key": "nope"},
                                      json={"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        return failures, bad_key, session.trajectory.turns

    failures, bad_key, turns = run_with_gateway(engine, scenario)
    expected = {"no max_tokens": "max_tokens", "image block": "messages.0.content.0", "tool_result without id":
                "tool_use_id", "bad role": "messages.0.role", "reasoning item": "input.0.type", "unknown previous":
                "previous_response_id", "image part": "input.0.content.0", "web search tool": "tools.0",
                "zero output tokens": "max_output_tokens"}
    for name, field in expected.items():
        error = failures[name]
        assert error.status_code == 400 and field in str(error), (name, str(error))
    assert isinstance(failures["image block"], anthropic.BadRequestError)
    assert failures["image block"].body["type"] == "error"  # Anthropic's shape
    assert bad_key.status_code == 401 and bad_key.json()["error"]["type"] == "authentication_error"
    assert turns == 0  # nothing was recorded


# ----------------------------------------------------------------------------- fuzzing


FUZZ = settings(max_examples=20, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def test_the_protocols_survive_fuzzing_from_the_published_schema(engine):
    """schemathesis over /v1/responses and /v1/messages of the gateway's OpenAPI schema (valid and invalid bodies,
    with the session's key): no 5xx, and only the status codes the schema documents."""
    ready, stop = threading.Event(), threading.Event()
    state: dict = {}

    async def serve():
        batcher = RequestBatcher(engine)
        batcher.start()
        gateway = AgentGateway(engine.tokenizer)
        await gateway.start()
        # a long context budget: every generated valid body may add a turn or be refused as a bad history
        session = gateway.open_session(batcher, SamplingParams(max_new_tokens=2, seed=3), max_context_len=100_000)
        state.update(url=gateway.base_url.removesuffix("/v1"), key=session.session_id)
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await gateway.close()
        await batcher.stop()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    try:
        assert ready.wait(60)
        schema = schemathesis.openapi.from_url(f"{state['url']}/openapi.json")
        headers = {"Authorization": f"Bearer {state['key']}"}
        fuzzed = 0
        for result in schema.get_all_operations():
            operation = result.ok()
            if operation.path not in ("/v1/responses", "/v1/messages"):
                continue
            fuzzed += 1
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                @FUZZ
                @given(case=operation.as_strategy(generation_mode=mode))
                def run_case(case):
                    case.call_and_validate(base_url=state["url"], headers=headers, timeout=60,
                                           checks=[not_a_server_error, status_code_conformance])
                run_case()
        assert fuzzed == 2
    finally:
        stop.set()
        thread.join(30)


# ----------------------------------------------------------------------------- the session's K/V


def test_a_gateway_session_keeps_its_kv_between_turns_and_lets_go_at_its_end(engine):
    """--agentic-session-lifecycle: the engine holds the session's K/V from one turn to the next (the second turn
    computes only the tokens the first did not leave in the pool), and closing the session (the episode's end)
    returns the pool to its idle level."""
    system = "You are a careful assistant. " * 3  # a prompt of several full blocks (the tiny model has 256 positions)

    async def main():
        batcher = RequestBatcher(engine)
        batcher.start()
        gateway = AgentGateway(engine.tokenizer, session_lifecycle=True)
        await gateway.start()
        core = engine.core
        idle = core.blocks.num_free
        session = gateway.open_session(batcher, SamplingParams(max_new_tokens=5, seed=7), max_context_len=400)
        try:
            client = client_of(gateway, session.session_id)
            messages = [{"role": "system", "content": system}, {"role": "user", "content": "1+2="}]
            first = await client.chat.completions.create(model="policy", messages=messages)
            pinned = engine.pinned_sessions
            before = core.runner.prefill_tokens
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "and 2+2="}]
            await client.chat.completions.create(model="policy", messages=messages)
            second_prefill = core.runner.prefill_tokens - before
            trajectory = session.trajectory
            inserted = sum(1 for m in trajectory.loss_mask if not m)
        finally:
            await gateway.close_session(session)
            await gateway.close()
            await batcher.stop()
        return pinned, second_prefill, inserted, len(trajectory.tokens), idle, core.blocks.num_free

    pinned, second_prefill, inserted, total, idle, free_after = asyncio.run(main())
    page = engine.core.blocks.block_size
    assert pinned == 1 and engine.pinned_sessions == 0
    assert second_prefill <= inserted + page + 1 < total // 2  # the new messages (and a partial block), not all
    assert free_after == idle
