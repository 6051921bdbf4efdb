"""Issue 28, item 10: the answers of `relax serve` say what they mean.

- the log-probs' tokens of a completion join to its text (a final EOS, which the text leaves out, is not listed;
  a stop string cut from the text ends the list there), plain and streamed, for any prompt and length;
- a body that is not JSON names the body (and the character where parsing stopped), not a field called "12";
- 404 and 405 are request errors, never `server_error`;
- messages the served chat template refuses (its `raise_exception`, as Qwen3's without a user message) are a 400
  naming `messages`, plain and streamed, and the server goes on answering;
- a failed `/init_weights_update_group` is one line, without C++ stack frames (checked in the log of the `relax
  serve` subprocess of `tests/serving/test_serving_fuzz.py`, which calls it).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from relax.backends.inference.embedded import EmbeddedEngine
from relax.serving.responses import text_tokens, token_pieces
from tests.support.http_servers import Server
from tests.support.tiny_assets import REFUSING_CHATML

PROPERTY = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck),
                    phases=(Phase.explicit, Phase.generate))  # no shrinking: each case is a real server call


@pytest.fixture(scope="module")
def server(tiny_workspace):
    server = Server(tiny_workspace / "model")
    yield server
    server.stop()


@PROPERTY
@given(prompt=st.text(alphabet="abc0123456789 +=\u00fc\u4e2d", min_size=1, max_size=12),
       max_tokens=st.integers(1, 24), seed=st.integers(0, 50), stop=st.sampled_from([None, "1", " ", "=", "\u00fc"]))
def test_completion_log_prob_tokens_join_to_the_text(server, prompt, max_tokens, seed, stop):
    body = {"prompt": prompt, "max_tokens": max_tokens, "seed": seed, "logprobs": 1, "temperature": 1.0}
    if stop is not None:
        body["stop"] = stop
    choice = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"])
    assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:i])) for i in range(len(logprobs["tokens"]))]
    if choice["finish_reason"] == "stop" and stop is None:  # ended by EOS: the EOS is not a token of the text
        assert len(logprobs["tokens"]) < max_tokens or choice["text"]


def test_an_eos_the_text_leaves_out_is_not_listed(server):
    eos = server.engine.tokenizer.eos_token_id
    for seed in range(200):  # find a sample that ends with EOS
        choice = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": "1", "max_tokens": 8, "seed": seed, "logprobs": 1}).json()["choices"][0]
        if choice["finish_reason"] == "stop":
            break
    else:
        pytest.skip("the tiny model never ended with EOS in 200 tries")
    generated = httpx.post(f"{server.url}/generate", timeout=60, json={
        "text": "1", "sampling_params": {"max_new_tokens": 8, "seed": seed}, "return_logprob": True}).json()
    assert generated["output_ids"][-1] == eos  # /generate keeps it (the trainer trains on it)
    assert len(choice["logprobs"]["tokens"]) < len(generated["output_ids"])


def test_streamed_chat_log_probs_join_to_the_content(server):
    events = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "seed": 1, "logprobs": True,
        "stream": True}).text.split("\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    tokens = [t["token"] for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
              for t in c["choices"][0]["logprobs"]["content"]]
    assert "".join(tokens) == content


@PROPERTY
@given(ids=st.lists(st.integers(0, 511), max_size=30))
def test_token_pieces_join_to_the_decoded_text(server, ids):
    tokenizer = server.engine.tokenizer
    pieces = token_pieces(tokenizer, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


@PROPERTY
@given(pieces=st.lists(st.text(max_size=4), max_size=10), cut=st.integers(0, 40))
def test_text_tokens_cover_a_prefix_exactly(pieces, cut):
    text = "".join(pieces)[:cut]
    tokens, offsets = text_tokens(pieces, text)
    assert "".join(tokens) == text
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]


@pytest.mark.parametrize("body", ['{"input_ids": [5,', "not json", '{"text": "a"} trailing', "\x00"])
def test_a_body_that_is_not_json_names_the_body(server, body):
    response = httpx.post(f"{server.url}/generate", content=body, timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "body" and "not valid JSON" in error["message"]


@pytest.mark.parametrize(("method", "path", "status", "kind"), [
    ("GET", "/no/such/endpoint", 404, "not_found_error"), ("GET", "/generate", 405, "invalid_request_error"),
    ("DELETE", "/health", 405, "invalid_request_error")])
def test_404_and_405_are_request_errors(server, method, path, status, kind):
    response = httpx.request(method, f"{server.url}{path}", timeout=30)
    assert response.status_code == status and response.json()["error"]["type"] == kind


def test_the_chat_template_refuses_messages_with_a_400_and_takes_the_clients_variables(tiny_workspace):
    engine = EmbeddedEngine.from_pretrained(str(tiny_workspace / "model"))
    engine.tokenizer.chat_template = REFUSING_CHATML + "{% if greeting is defined %}{{ greeting }}{% endif %}"
    server = Server(tiny_workspace / "model", engine=engine)
    url = f"{server.url}/v1/chat/completions"

    def chat(messages, **extra):
        return httpx.post(url, json={"model": "tiny", "messages": messages, "max_tokens": 2, **extra}, timeout=30)

    user = [{"role": "user", "content": "1+1="}]
    try:
        refused = [chat(messages, stream=stream) for messages in ([{"role": "system", "content": "be brief"}], [])
                   for stream in (False, True)]
        plain, greeted = chat(user), chat(user, chat_template_kwargs={"greeting": "abc"})
        bad_variables = [chat(user, chat_template_kwargs=kwargs) for kwargs in (
            {"tokenize": True}, {"chat_template": "{% for i in range(99999) %}x{% endfor %}"}, {"messages": []}, [1])]
        after = chat(user)
    finally:
        server.stop()
    for answer in refused:
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages", answer.text
    assert "No user query found in messages." in refused[0].json()["error"]["message"]
    # the variable reaches the template: three more prompt tokens ("abc" in the character tokenizer)
    assert greeted.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"] + 3
    for answer in bad_variables:
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "chat_template_kwargs", answer.text
    assert after.status_code == 200
