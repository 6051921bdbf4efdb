"""The agent gateway (relax.rollout.agentic.gateway) and the agent rollout (relax.rollout.agentic.agent_rollout):
the official `openai` client and real agent subprocesses talk to a real uvicorn server on 127.0.0.1 in front of
the real tiny embedded engine."""

from __future__ import annotations

import asyncio
import copy
import json
import sys
import textwrap
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from relax.backends.inference.base import SamplingParams, ScoreRequest
from relax.backends.inference.batcher import RequestBatcher
from relax.config import RelaxConfig
from relax.data.sample import Sample, SampleStatus
from relax.rollout.agentic import agent_rollout
from relax.rollout.agentic.gateway import AgentGateway, openai_tool_calls
from relax.rollout.agentic.tool_parser import parse_hermes_tool_calls
from relax.rollout.generation.context import PerSampleGeneration
from tests.support.tiny_assets import REFUSING_CHATML

TOOL_MESSAGE = {"role": "tool", "content": "3", "tool_call_id": "call_1"}


def run_with_gateway(engine, scenario, max_new_tokens: int = 5, max_context_len: int | None = 200, tokenizer=None):
    """Run ``scenario(gateway, session)`` on a fresh loop beside a started gateway and batcher."""

    async def main():
        batcher = RequestBatcher(engine)
        batcher.start()
        gateway = AgentGateway(tokenizer or engine.tokenizer)
        await gateway.start()
        session = gateway.open_session(batcher, SamplingParams(max_new_tokens=max_new_tokens, seed=7),
                                       max_context_len=max_context_len)
        try:
            return await scenario(gateway, session)
        finally:
            await gateway.close()
            await batcher.stop()

    return asyncio.run(main())


def client_of(gateway: AgentGateway, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gateway.base_url, api_key=key, max_retries=0, timeout=30)


def test_two_turns_are_recorded_token_in_token_out(engine):
    tokenizer = engine.tokenizer

    async def scenario(gateway, session):
        client = client_of(gateway, session.session_id)
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}]
        first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4, logprobs=True)
        after_first = list(session.trajectory.tokens), list(session.trajectory.loss_mask)
        messages += [{"role": "assistant", "content": first.choices[0].message.content}, TOOL_MESSAGE]
        second = await client.chat.completions.create(model="policy", messages=messages, logprobs=True)
        scores = await engine.score([ScoreRequest(session.trajectory.tokens, len(session.trajectory.response_ids))])
        return first, second, after_first, session.trajectory, scores[0].log_probs

    first, second, (tokens_1, mask_1), trajectory, rescored = run_with_gateway(engine, scenario)
    prompt_text = tokenizer.apply_chat_template([{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": "1+2="}],
                                                add_generation_prompt=True, tokenize=False)
    assert trajectory.prompt_ids == tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    n1, n2 = first.usage.completion_tokens, second.usage.completion_tokens
    assert 1 <= n1 <= 4 and 1 <= n2 <= 5  # max_tokens of the request, capped by the session's 5
    assert trajectory.tokens[:len(tokens_1)] == tokens_1 and trajectory.loss_mask[:len(mask_1)] == mask_1

    # Model turns: mask 1, exactly the returned tokens and log-probs; the observation between them: mask 0.
    mask, response, log_probs = trajectory.loss_mask, trajectory.response_ids, trajectory.log_probs
    turn_1, turn_2 = response[:n1], response[-n2:]
    observation = response[n1:-n2]
    assert mask == [1] * n1 + [0] * len(observation) + [1] * n2
    assert tokenizer.decode(turn_1, skip_special_tokens=True) == first.choices[0].message.content
    assert tokenizer.decode(turn_2, skip_special_tokens=True) == second.choices[0].message.content
    returned = [item.logprob for item in first.choices[0].logprobs.content + second.choices[0].logprobs.content]
    assert [lp for lp, m in zip(log_probs, mask) if m] == pytest.approx(returned)
    assert all(lp == 0.0 for lp, m in zip(log_probs, mask) if not m)
    closing = "\n" if turn_1[-1] == tokenizer.eos_token_id else "<|im_end|>\n"  # what the model did not write
    assert tokenizer.decode(observation) == closing + "<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"
    assert second.usage.prompt_tokens == len(trajectory.prompt_ids) + n1 + len(observation)

    # The engine re-scores the recorded model tokens to the recorded log-probs.
    for recorded, scored, m in zip(log_probs, rescored, mask):
        if m:
            assert abs(recorded - scored) < 1e-4


def test_history_must_replay_the_recorded_trajectory(engine):
    async def scenario(gateway, session):
        client = client_of(gateway, session.session_id)
        messages = [{"role": "user", "content": "2+2="}]
        first = await client.chat.completions.create(model="policy", messages=messages)
        recorded = list(session.trajectory.tokens)
        retry = await client.chat.completions.create(model="policy", messages=messages)  # a client retry
        assistant = {"role": "assistant", "content": first.choices[0].message.content}
        errors = []
        for history in ([{"role": "assistant", "content": "edited"}, TOOL_MESSAGE],  # an edited model turn
                        [assistant, {"role": "assistant", "content": "fake"}],  # a made-up model turn
                        [assistant]):  # nothing new
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="policy", messages=messages + history)
            errors.append(caught.value)
        unchanged = session.trajectory.tokens == recorded
        # A streamed turn (buffered SSE) extends the same trajectory.
        stream = await client.chat.completions.create(model="policy", messages=messages + [assistant, TOOL_MESSAGE],
                                                      stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        return first, retry, errors, unchanged, chunks, session.trajectory

    first, retry, errors, unchanged, chunks, trajectory = run_with_gateway(engine, scenario)
    assert retry.choices[0].message.content == first.choices[0].message.content and retry.id == first.id
    assert all(error.status_code == 400 for error in errors)
    assert "messages[1] (assistant) differs from what the model generated" in str(errors[0])
    assert "messages[2]: a new assistant message" in str(errors[1])
    assert "at least one new message" in str(errors[2])
    assert unchanged
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert trajectory.turns == 2 and chunks[-1].usage.completion_tokens >= 1
    n2 = chunks[-1].usage.completion_tokens
    assert engine.tokenizer.decode(trajectory.response_ids[-n2:], skip_special_tokens=True) == streamed


def test_auth_bad_bodies_and_context_budget(engine):
    secret = "sk-not-a-session-9f8e7d6c5b4a"
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True,
                                                  tokenize=False)
    # Room for one short turn; after it, not even the next generation prompt fits.
    budget = len(engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]) + 3

    async def scenario(gateway, session):
        url = gateway.base_url + "/chat/completions"
        body = {"model": "policy", "messages": [{"role": "user", "content": "1+1="}]}
        async with httpx.AsyncClient() as http:
            unknown = await http.post(url, json=body, headers={"Authorization": f"Bearer {secret}"})
            missing = await http.post(url, json=body)
            auth = {"Authorization": f"Bearer {session.session_id}"}
            models = await http.get(gateway.base_url + "/models", headers=auth)
            bad_role = await http.post(url, json={"messages": [{"role": "robot", "content": "x"}]}, headers=auth)
            bad_tokens = await http.post(url, json={**body, "max_tokens": 0}, headers=auth)
            first = await http.post(url, json=body, headers=auth)
            history = body["messages"] + [first.json()["choices"][0]["message"], TOOL_MESSAGE]
            exhausted = await http.post(url, json={**body, "messages": history}, headers=auth)
            trajectory = await gateway.close_session(session)
            closed = await http.post(url, json=body, headers=auth)
        return unknown, missing, models, bad_role, bad_tokens, first, exhausted, trajectory, closed

    unknown, missing, models, bad_role, bad_tokens, first, exhausted, trajectory, closed = run_with_gateway(
        engine, scenario, max_new_tokens=8, max_context_len=budget)
    assert unknown.status_code == missing.status_code == closed.status_code == 401
    assert secret not in unknown.text and "RELAX_SESSION_ID" in unknown.json()["error"]["message"]
    assert models.status_code == 200 and models.json()["data"][0]["id"]
    assert bad_role.status_code == 400 and bad_role.json()["error"]["param"] == "messages.0.role"
    assert bad_tokens.status_code == 400 and bad_tokens.json()["error"]["param"] == "max_tokens"
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] <= budget
    assert exhausted.status_code == 400 and "context budget exhausted" in exhausted.json()["error"]["message"]
    assert trajectory.stop_reason == "budget_exhausted" and len(trajectory.tokens) <= budget


@pytest.mark.parametrize("max_context_len", [None, 10_000])
def test_a_session_s_budget_stays_within_the_engine_s_room(engine, max_context_len):
    """Without --rollout-max-context-len a session's budget is its first prompt + one response length, which a long
    prompt takes past the model's positions (or a smaller KV pool); a --rollout-max-context-len can pass them too:
    the engine then refused a later turn (an error, not the session's 400 "context budget exhausted")."""
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True,
                                                tokenize=False)
    positions = len(engine.tokenizer(text, add_special_tokens=False)["input_ids"]) + 5  # as if the model had so few

    async def main():
        batcher = RequestBatcher(engine)
        batcher.start()
        gateway = AgentGateway(engine.tokenizer)
        await gateway.start()
        session = gateway.open_session(batcher, SamplingParams(max_new_tokens=20, seed=7),
                                       max_context_len=max_context_len, answer_room=positions)
        try:
            async with httpx.AsyncClient() as http:
                url, auth = gateway.base_url + "/chat/completions", {"Authorization": f"Bearer {session.session_id}"}
                body = {"model": "policy", "messages": [{"role": "user", "content": "1+1="}]}
                first = await http.post(url, json=body, headers=auth)
                history = body["messages"] + [first.json()["choices"][0]["message"], TOOL_MESSAGE]
                second = await http.post(url, json={**body, "messages": history}, headers=auth)
            return first, second, session.max_context_len, await gateway.close_session(session)
        finally:
            await gateway.close()
            await batcher.stop()

    first, second, budget, trajectory = asyncio.run(main())
    assert budget == positions and first.status_code == 200 and first.json()["usage"]["total_tokens"] <= positions
    assert second.status_code == 400 and "context budget exhausted" in second.json()["error"]["message"]
    assert trajectory.stop_reason == "budget_exhausted" and len(trajectory.tokens) <= positions


def test_messages_the_chat_template_refuses_are_a_400_and_the_session_goes_on(engine):
    tokenizer = copy.deepcopy(engine.tokenizer)
    tokenizer.chat_template = REFUSING_CHATML

    async def scenario(gateway, session):
        url, auth = gateway.base_url + "/chat/completions", {"Authorization": f"Bearer {session.session_id}"}
        async with httpx.AsyncClient(timeout=30) as http:
            refused = await http.post(url, json={"messages": [{"role": "system", "content": "be brief"}]}, headers=auth)
            streamed = await http.post(url, json={"messages": [{"role": "system", "content": "x"}], "stream": True},
                                       headers=auth)
            answered = await http.post(url, json={"messages": [{"role": "user", "content": "1+1="}]}, headers=auth)
        return refused, streamed, answered

    refused, streamed, answered = run_with_gateway(engine, scenario, tokenizer=tokenizer)
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "messages"
    assert "No user query found in messages." in error["message"]
    assert streamed.status_code == 400 and streamed.json()["error"] == error  # before the stream opens
    assert answered.status_code == 200 and answered.json()["choices"][0]["message"]["role"] == "assistant"


AGENT_SCRIPT = textwrap.dedent('''
    import json, os, subprocess, sys, time
    task = json.load(open(os.environ["RELAX_INPUT_JSON"]))
    mode = task["metadata"]["mode"]
    if mode == "hang":  # a child in the same process group, then never finish
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open(task["metadata"]["pid_file"], "w").write(f"{os.getpid()} {child.pid}")
        time.sleep(120)
    from openai import OpenAI
    client = OpenAI(base_url=os.environ["RELAX_BASE_URL"], api_key=os.environ["RELAX_SESSION_ID"], max_retries=0)
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "again"}]
    if mode == "crash":
        sys.exit("boom: the tool server is down")
    output = {"metadata": {"secret_seen": "RELAX_TEST_SECRET" in os.environ, "group": os.environ["RELAX_GROUP_ID"]}}
    if mode == "ok":
        output["reward"] = 0.75
    with open(os.environ["RELAX_OUTPUT_JSON"], "w") as f:
        f.write("{not json" if mode == "bad_json" else json.dumps(output))
''')


def run_agents(engine, tmp_path: Path, modes: list[str], timeout_s: float) -> list[Sample]:
    script = tmp_path / "agent.py"
    script.write_text(AGENT_SCRIPT)
    config = RelaxConfig(agent_command=f"{sys.executable} {script}", agent_timeout=timeout_s,
                         rollout_max_context_len=200)
    samples = [Sample(index=i, group_index=10 + i, prompt="3+4=", label="7",
                      metadata={"mode": mode, "pid_file": str(tmp_path / f"pids-{i}")})
               for i, mode in enumerate(modes)]

    # As the rollout calls a per-sample generate function: all samples at once, through one request batcher.
    generation = PerSampleGeneration(agent_rollout.generate, "agent_rollout", config, engine.tokenizer)
    return asyncio.run(generation.run(engine, samples, SamplingParams(max_new_tokens=4, seed=3)))


def test_agent_subprocesses_become_samples(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_TEST_SECRET", "do-not-pass-me")
    ok, no_reward, crash, bad_json = run_agents(engine, tmp_path, ["ok", "no_reward", "crash", "bad_json"], 60)
    tokenizer = engine.tokenizer
    for sample in (ok, no_reward):
        assert sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED), sample.metadata.get("error")
        assert sample.metadata["rollout_turns"] == 2 and sample.metadata["secret_seen"] is False
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "3+4="}], add_generation_prompt=True,
                                               tokenize=False)
        assert sample.prompt_tokens == tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length > 0
        assert 0 in sample.loss_mask and sample.loss_mask[0] == 1 and sample.loss_mask[-1] == 1
    assert ok.reward == 0.75 and ok.metadata["group"] == "10"
    assert no_reward.reward is None  # left to the run's reward function
    assert crash.status == SampleStatus.FAILED and "exited with code 1" in crash.metadata["error"]
    assert "boom: the tool server is down" in crash.metadata["error"]
    assert crash.metadata["rollout_turns"] == 2 and set(crash.loss_mask) == {0}  # kept, out of the loss
    assert bad_json.status == SampleStatus.FAILED and "not valid JSON" in bad_json.metadata["error"]
    assert agent_rollout._SHARED == {}  # the gateway closed with its last session


def test_a_hanging_agent_is_killed_with_its_process_group(engine, tmp_path):
    [hung] = run_agents(engine, tmp_path, ["hang"], timeout_s=2)
    assert hung.status == SampleStatus.FAILED
    assert "did not finish within --agent-timeout 2 s" in hung.metadata["error"]
    # SIGKILL was sent to the whole group; its delivery is asynchronous, so a busy machine may still list a
    # process for a moment: each must be gone within a few seconds, not at the very instant of the check.
    for pid in map(int, (tmp_path / "pids-0").read_text().split()):
        deadline = time.monotonic() + 10
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(pid), f"process {pid} of the agent's group survived"


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting for a parent outside this test."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_tool_calls_are_returned_and_must_be_replayed(engine):
    text = 'let me add\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    assert openai_tool_calls(parse_hermes_tool_calls)(text)[0] == "let me add"
    assert openai_tool_calls(parse_hermes_tool_calls)("<tool_call>{broken")[1] == []  # stays plain content
    [call] = openai_tool_calls(parse_hermes_tool_calls)(text)[1]

    async def scenario(gateway, session):
        gateway.split_tool_calls = lambda model_text: (model_text, [call])  # as if the model had called "add"
        client = client_of(gateway, session.session_id)
        messages = [{"role": "user", "content": "3+4="}]
        reply = await client.chat.completions.create(model="policy", messages=messages)
        assistant = reply.choices[0].message  # replayed as the client's own object, as agents do
        result = {"role": "tool", "content": "7", "tool_call_id": assistant.tool_calls[0].id}
        edited = assistant.model_dump()
        edited["tool_calls"][0]["function"]["arguments"] = '{"a": 3, "b": 5}'
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="policy", messages=messages + [edited, result])
        await client.chat.completions.create(model="policy", messages=messages + [assistant, result])
        return reply, session.trajectory.turns

    reply, turns = run_with_gateway(engine, scenario)
    assert reply.choices[0].message.tool_calls[0].function.name == "add"
    assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == {"a": 3, "b": 4}
    assert reply.choices[0].finish_reason in ("tool_calls", "length") and turns == 2
