"""`relax serve`: the embedded engine behind real HTTP (uvicorn on 127.0.0.1, a tiny model)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from openai import OpenAI
from safetensors.torch import load_file

from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.embedded import EmbeddedEngine
from relax.distributed.weight_disk import DiskPublisher
from relax.serving.app import create_app
from tests.support.http_servers import API_KEY, ServeProcess, ThreadServer, free_port
from tests.support.tiny_assets import build_tiny_model_dir
from tests.support.waits import wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def model_dir(tiny_workspace) -> Path:
    return tiny_workspace / "model"


@pytest.fixture(scope="module")
def server(model_dir):
    """A real uvicorn server in a background thread; yields its base URL."""
    engine = EmbeddedEngine.from_pretrained(str(model_dir))
    app = create_app(engine, engine.tokenizer, model_name="tiny", model_path=str(model_dir), api_key=API_KEY,
                     batch_window_s=0.05)
    server = ThreadServer(uvicorn.Config(app, log_level="warning"))
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server, timeout=30) as http:
        yield http


@pytest.fixture(scope="module")
def reference(model_dir) -> EmbeddedEngine:
    return EmbeddedEngine.from_pretrained(str(model_dir))


def greedy(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def reference_generate(engine: EmbeddedEngine, input_ids: list[int], n: int):
    request = GenerationRequest("ref", input_ids, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
    return asyncio.run(engine.generate([request]))[0]


def test_generate_input_ids_text_and_batch_match_the_engine(client, reference):
    prompt = reference.tokenizer("3+4=")["input_ids"]
    expected = reference_generate(reference, prompt, 6)

    by_ids = client.post("/generate", json={"input_ids": prompt, "sampling_params": greedy(6),
                                            "return_logprob": True, "rid": "ids-1"}).json()
    assert by_ids["output_ids"] == expected.output_ids
    assert by_ids["text"] == expected.text
    meta = by_ids["meta_info"]
    assert meta["id"] == "ids-1" and meta["weight_version"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(prompt), 6)
    assert [entry[1] for entry in meta["output_token_logprobs"]] == expected.output_ids
    assert [entry[0] for entry in meta["output_token_logprobs"]] == pytest.approx(expected.output_log_probs, abs=1e-5)

    by_text = client.post("/generate", json={"text": "3+4=", "sampling_params": greedy(6)}).json()
    assert by_text["output_ids"] == expected.output_ids and "output_token_logprobs" not in by_text["meta_info"]

    batch = client.post("/generate", json={"input_ids": [prompt, prompt[:2]], "sampling_params": greedy(3),
                                           "rid": ["a", "b"]}).json()
    assert [item["meta_info"]["id"] for item in batch] == ["a", "b"]
    assert batch[0]["output_ids"] == expected.output_ids[:3]
    texts = client.post("/generate", json={"text": ["3+4=", "1+1="], "sampling_params": greedy(2)}).json()
    assert isinstance(texts, list) and len(texts) == 2

    stopped = client.post("/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "stop_token_ids": [expected.output_ids[1]]}}).json()
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": expected.output_ids[1]}


def test_concurrent_clients_share_engine_batches(server, client):
    before = client.get("/health").json()
    prompts = [[5 + i, 6, 7 + i] for i in range(8)]

    async def all_at_once():
        async with httpx.AsyncClient(base_url=server, timeout=30) as http:
            return await asyncio.gather(*[
                http.post("/generate", json={"input_ids": p, "sampling_params": greedy(8)}) for p in prompts])

    responses = asyncio.run(all_at_once())
    assert all(r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 8 for r in responses)
    after = client.get("/health").json()
    # One after another would take 8 engine calls and 64 decode steps.
    assert after["engine_calls"] - before["engine_calls"] <= 2
    assert after["batched_requests"] - before["batched_requests"] == 8
    assert after["decode_steps"] - before["decode_steps"] <= 16


def test_pause_continue_and_abort(client, server):
    results = {}

    def post(name: str, body: dict) -> threading.Thread:
        def target():
            with httpx.Client(base_url=server, timeout=30) as http:
                results[name] = http.post("/generate", json=body).json()
        thread = threading.Thread(target=target)
        thread.start()
        return thread

    assert client.post("/pause_generation", headers=AUTH).status_code == 200
    try:
        # One after the other, so that they land in separate engine calls: a paused engine batch returns
        # when all its rows are done, so an aborted row would otherwise wait for its held neighbour.
        doomed = post("doomed", {"input_ids": [7, 8], "sampling_params": greedy(40), "rid": "doomed"})
        wait_until(lambda: client.get("/health").json()["in_flight_requests"] == 1, 10, "a held request")
        held = post("held", {"input_ids": [5, 6], "sampling_params": greedy(4), "rid": "held"})
        wait_until(lambda: client.get("/health").json()["in_flight_requests"] == 2, 10, "two held requests")
        assert client.get("/health").json()["paused"] is True
        assert client.get("/health_generate").json()["status"] == "paused"
        time.sleep(0.2)
        assert held.is_alive() and doomed.is_alive()
        assert client.post("/abort_request", json={"rid": "doomed"}, headers=AUTH).json() == {"success": True}
        doomed.join(10)
        assert results["doomed"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert results["doomed"]["meta_info"]["completion_tokens"] == 0
        assert held.is_alive()
    finally:
        assert client.post("/continue_generation", headers=AUTH).status_code == 200
    held.join(10)
    assert results["held"]["meta_info"]["finish_reason"]["type"] == "length"
    assert client.get("/health_generate").json()["status"] == "ok"


def test_control_endpoints_need_the_bearer_token(client):
    for path in ["/abort_request", "/pause_generation", "/continue_generation", "/flush_cache",
                 "/update_weights_from_disk"]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = client.post(path, json={"rid": "x", "model_path": "/nowhere"}, headers=headers)
            assert response.status_code == 401, path
            assert API_KEY not in response.text
    assert client.post("/flush_cache", headers=AUTH).json()["success"] is True
    assert client.post("/generate", json={"input_ids": [5], "sampling_params": greedy(1)}).status_code == 200
    assert client.get("/get_model_info").json()["is_generation"] is True
    assert "/generate" in client.get("/openapi.json").json()["paths"]


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/generate", {"input_ids": [5], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ("/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ("/generate", {"sampling_params": {}}, "text and input_ids"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/v1/chat/completions", {"model": "tiny"}, "messages"),
    ("/v1/completions", {"prompt": "1", "top_p": 2}, "top_p"),
])
def test_bad_bodies_name_the_field(client, path, body, field):
    response = client.post(path, json=body)
    assert response.status_code == 400
    assert field in response.json()["error"]["message"]


def test_openai_client_chat_and_completions(server, reference):
    openai = OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    assert [model.id for model in openai.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "2+2="}]
    chat = openai.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True}, logprobs=True)
    prompt = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    expected = reference_generate(reference, list(prompt), 5)
    assert chat.choices[0].message.content == expected.text
    assert chat.choices[0].finish_reason == "length"
    assert [t.logprob for t in chat.choices[0].logprobs.content] == pytest.approx(expected.output_log_probs, abs=1e-5)
    assert chat.usage.completion_tokens == 5

    stream = openai.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                            extra_body={"ignore_eos": True}, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"

    completion = openai.completions.create(model="tiny", prompt="3+4=", max_tokens=4, temperature=0, n=2,
                                           extra_body={"ignore_eos": True})
    ref = reference_generate(reference, reference.tokenizer("3+4=")["input_ids"], 4)
    assert [choice.text for choice in completion.choices] == [ref.text, ref.text]
    streamed = openai.completions.create(model="tiny", prompt="3+4=", max_tokens=4, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == ref.text

    # Token by token: a longer answer arrives in several content chunks that add up to the whole text.
    long_ref = reference_generate(reference, reference.tokenizer("3+4=")["input_ids"], 24)
    pieces = [chunk.choices[0].text for chunk in openai.completions.create(
        model="tiny", prompt="3+4=", max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if chunk.choices and chunk.choices[0].text]
    assert "".join(pieces) == long_ref.text and len(pieces) > 1


def test_update_weights_from_disk_changes_outputs_and_version(client, model_dir, tmp_path, reference):
    prompt = [5, 6, 7]
    original = reference_generate(reference, prompt, 4).output_log_probs

    def log_probs_and_version():
        body = client.post("/generate", json={"input_ids": prompt, "sampling_params": greedy(4),
                                              "return_logprob": True}).json()
        return [entry[0] for entry in body["meta_info"]["output_token_logprobs"]], body["meta_info"]["weight_version"]

    other = build_tiny_model_dir(tmp_path / "other", seed=1)
    response = client.post("/update_weights_from_disk", json={"model_path": str(other), "weight_version": 3},
                           headers=AUTH)
    assert response.status_code == 200 and response.json()["success"] is True
    log_probs, version = log_probs_and_version()
    assert version == 3 and log_probs != pytest.approx(original, abs=1e-4)
    assert client.get("/get_model_info").json()["weight_version"] == 3

    # Back to the original weights through a versioned directory written by the weight-sync publisher.
    tensors = load_file(str(model_dir / "model.safetensors"))
    asyncio.run(DiskPublisher(tmp_path / "sync", fsync=False).publish([list(tensors.items())], version=4))
    response = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "sync")}, headers=AUTH)
    assert response.status_code == 200, response.text
    log_probs, version = log_probs_and_version()
    assert version == 4 and log_probs == pytest.approx(original, abs=1e-5)

    missing = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nowhere")}, headers=AUTH)
    assert missing.status_code == 400 and "model_path" in missing.json()["message"]


def test_relax_serve_command(model_dir):
    serving = ServeProcess("--hf-checkpoint", str(model_dir), "--device", "cpu", env={"RELAX_API_KEY": API_KEY})
    with serving:
        base = serving.url
        body = httpx.post(f"{base}/generate", json={"text": "1+1=", "sampling_params": greedy(2)}, timeout=30).json()
        assert body["meta_info"]["completion_tokens"] == 2
        assert httpx.post(f"{base}/pause_generation", timeout=5).status_code == 401
        assert httpx.post(f"{base}/continue_generation", headers=AUTH, timeout=5).status_code == 200
    assert API_KEY not in serving.output
    assert json.dumps(API_KEY) not in serving.output


def test_update_weights_over_a_distributed_group(server, model_dir, tmp_path, reference):
    """SGLang's /init_weights_update_group + /update_weights_from_distributed: this process is the trainer (rank 0)
    and broadcasts over a gloo group; the server ends up with exactly the broadcast weights and version."""
    from relax.distributed.weight_broadcast import BroadcastPublisher, WeightSyncGroup

    port, prompt = free_port(), [5, 6, 7]
    original = load_file(str(model_dir / "model.safetensors"))
    other = load_file(str(build_tiny_model_dir(tmp_path / "other", seed=2) / "model.safetensors"))
    results = {}

    def call(name, path, body):
        with httpx.Client(base_url=server, timeout=120, headers=AUTH) as http:
            results[name] = http.post(path, json=body)

    def push(tensors, version):
        thread = threading.Thread(target=call, args=("update", "/update_weights_from_distributed",
                                                     {"weight_version": version}))
        thread.start()
        asyncio.run(BroadcastPublisher(group).publish([list(tensors.items())], version))
        thread.join(60)
        return results["update"]

    joining = threading.Thread(target=call, args=("init", "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}))
    joining.start()
    group = WeightSyncGroup.init("127.0.0.1", port, rank=0, world_size=2, timeout_s=60)
    joining.join(60)
    assert results["init"].status_code == 200 and results["init"].json()["success"] is True
    try:
        response = push(other, 7)
        assert response.status_code == 200 and response.json()["weight_version"] == 7, response.text
        expected = EmbeddedEngine.from_pretrained(str(tmp_path / "other"))
        with httpx.Client(base_url=server, timeout=60) as http:
            body = http.post("/generate", json={"input_ids": prompt, "sampling_params": greedy(4),
                                                "return_logprob": True}).json()
        served = [entry[0] for entry in body["meta_info"]["output_token_logprobs"]]
        assert body["meta_info"]["weight_version"] == 7
        assert served == pytest.approx(reference_generate(expected, prompt, 4).output_log_probs, abs=1e-5)
        assert push(original, 8).json()["weight_version"] == 8  # back to the weights the other tests expect
    finally:
        group.close()
    with httpx.Client(base_url=server, timeout=60) as http:
        unknown = http.post("/update_weights_from_distributed", json={"group_name": "nope"}, headers=AUTH)
    assert unknown.status_code == 400 and "init_weights_update_group" in unknown.text


# ---- issue 14, items 12-17 ----------------------------------------------------------------------------------------
def test_a_weight_update_never_moves_the_version_backwards(client, model_dir, tmp_path):
    served = client.get("/health").json()["weight_version"]
    tensors = load_file(str(model_dir / "model.safetensors"))
    # Served through this process's publisher (whatever ran before): an older version of the same publisher is
    # refused, one of another publisher (a resumed run) would be taken.
    served = max(served, 2)
    asyncio.run(DiskPublisher(tmp_path / "current", fsync=False).publish([list(tensors.items())], version=served))
    assert client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "current")},
                       headers=AUTH).status_code == 200
    asyncio.run(DiskPublisher(tmp_path / "old", fsync=False).publish([list(tensors.items())], version=served - 1))
    for body in ({"model_path": str(tmp_path / "old")},
                 {"model_path": str(model_dir), "weight_version": served - 1}):
        response = client.post("/update_weights_from_disk", json=body, headers=AUTH)
        assert response.status_code == 400 and response.json()["error"]["param"] == "weight_version", response.text
    assert client.get("/health").json()["weight_version"] == served
    # a new run's initial weights (version 0) are taken over any served version
    restart = client.post("/update_weights_from_disk", json={"model_path": str(model_dir), "weight_version": 0},
                          headers=AUTH)
    assert restart.status_code == 200 and client.get("/health").json()["weight_version"] == 0


def test_the_first_bad_file_of_a_folder_leaves_the_model_untouched(model_dir, tmp_path):
    """Item 14: a valid first file and a second naming an unknown parameter: 400, the same greedy output."""
    from safetensors.torch import save_file

    from tests.support.http_servers import Server

    server = Server(model_dir)
    try:
        prompt = {"input_ids": [5, 6, 7], "sampling_params": greedy(6), "return_logprob": True}
        before = httpx.post(f"{server.url}/generate", json=prompt).json()
        tensors = {name: t + 0.5 for name, t in load_file(str(model_dir / "model.safetensors")).items()}
        folder = tmp_path / "half"
        folder.mkdir()
        save_file(tensors, str(folder / "a.safetensors"))
        save_file({"model.layers.99.mlp.weight": torch.zeros(2)}, str(folder / "b.safetensors"))
        response = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": str(folder)},
                              headers=AUTH)
        assert response.status_code == 400 and "model.layers.99.mlp.weight" in response.text
        after = httpx.post(f"{server.url}/generate", json=prompt).json()
        assert after["output_ids"] == before["output_ids"]
        assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
        assert server.health()["weight_version"] == 0
    finally:
        server.stop()


def test_nan_weights_are_refused_and_a_nan_model_is_unhealthy(model_dir, tmp_path):
    from safetensors.torch import save_file

    from tests.support.http_servers import Server

    server = Server(model_dir)
    try:
        tensors = {name: torch.full_like(t, float("nan")) for name, t in load_file(str(model_dir / "model.safetensors")).items()}
        folder = tmp_path / "nan"
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        response = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": str(folder)},
                              headers=AUTH)
        assert response.status_code == 400 and "NaN or infinite" in response.text
        assert httpx.get(f"{server.url}/health_generate").status_code == 200
        with torch.no_grad():  # weights broken behind the server's back (a bad broadcast): health says so
            for parameter in server.engine.model.parameters():
                parameter.fill_(float("nan"))
        assert httpx.get(f"{server.url}/health_generate").status_code == 503
        body = httpx.post(f"{server.url}/generate", json={"input_ids": [5], "return_logprob": True,
                                                         "sampling_params": greedy(2)})
        assert body.status_code == 200 and json.loads(body.text)  # valid JSON: null, never a NaN literal
    finally:
        server.stop()


def test_empty_stop_strings_are_no_stop_strings(client, reference):
    prompt = reference.tokenizer("3+4=")["input_ids"]
    expected = reference_generate(reference, prompt, 6)
    for stop in ("", [""], ["", "\u00fcnreachable"]):
        body = client.post("/generate", json={"input_ids": prompt, "sampling_params": {**greedy(6), "stop": stop}})
        assert body.json()["output_ids"] == expected.output_ids, stop


def test_usage_counts_every_prompt_of_a_batch(client):
    body = client.post("/v1/completions", json={"prompt": ["a", "a"], "max_tokens": 2, "temperature": 0}).json()
    single = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "temperature": 0}).json()
    assert body["usage"]["prompt_tokens"] == 2 * single["usage"]["prompt_tokens"]
    n_samples = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "n": 3}).json()
    assert n_samples["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]  # n samples of one prompt: once


@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN", "1e999"])
def test_no_infinity_or_nan_in_any_number(client, literal):
    for path, body in (("/generate", '{"input_ids": [5], "sampling_params": {"temperature": %s}}'),
                       ("/v1/completions", '{"prompt": "a", "top_p": %s}')):
        response = client.post(path, content=body % literal, headers={"Content-Type": "application/json"})
        assert response.status_code == 400, (path, literal, response.text)
