"""Issue 28, items 4-7: what one client may take from a server Relax runs, tried with real sockets on 127.0.0.1.

Body size (413 before it is read), tokenization off the event loop, sequences and tokens per request (400) and in
flight (429 with Retry-After), a client that disconnects (its generation is aborted, plain and streamed, on `relax
serve` and on the agent gateway), slow clients (header and body deadlines, a connection cap) on every server, and
a load of 200 clients of which a third disconnect and a tenth trickle. Waits are for events, bounded; no test
asserts a duration.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from relax.serving.limits import GenerationLimits
from relax.utils.http_server import HTTPLimits
from tests.support.http_servers import API_KEY, Server
from tests.support.waits import wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LIMITS = HTTPLimits(max_request_bytes=64 * 1024, max_connections=48, header_timeout_s=1.0, body_timeout_s=1.0,
                    keep_alive_s=2, shutdown_grace_s=2)
WORK = GenerationLimits(max_sequences_per_request=32, max_tokens_per_request=2048, max_inflight_sequences=64)
LONG = 200  # new tokens (the tiny model's context is 256)


@pytest.fixture(scope="module")
def server(tiny_workspace):
    server = Server(tiny_workspace / "model", http_limits=LIMITS, generation_limits=WORK)
    yield server
    server.stop()


def _health(server: Server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=30).json()


def _settled(server: Server, timeout_s: float = 60.0) -> dict:
    """The health once nothing is in flight (waits for it, bounded)."""
    wait_until(lambda: (lambda h: h["in_flight_requests"] == 0 and h["inflight_sequences"] == 0)(_health(server)),
               timeout_s, "the server to have nothing in flight")
    return _health(server)


def _connect(server: Server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    return sock


def _read_until_closed(sock: socket.socket, timeout_s: float = 30.0) -> bytes:
    """Everything the server sends until it closes the connection (bounded)."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


# ---- item 4: body size and tokenization ----------------------------------------------------------------------------
def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    big = json.dumps({"text": "a" * (LIMITS.max_request_bytes + 10)})
    response = httpx.post(f"{server.url}/generate", content=big, timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "--max-request-bytes" in response.text
    assert response.json()["error"]["type"] == "request_too_large"

    def chunks():  # no Content-Length: refused as soon as the body passes the limit
        for _ in range(40):
            yield b"x" * 4096

    response = httpx.post(f"{server.url}/generate", content=chunks(), timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert _health(server)["in_flight_requests"] == 0


def test_a_text_that_cannot_fit_the_context_is_refused_without_tokenizing(server, monkeypatch):
    tokenizer = server.engine.tokenizer
    calls = []
    original = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    text = "7" * (LIMITS.max_request_bytes - 100)
    response = httpx.post(f"{server.url}/generate", json={"text": text}, timeout=30)
    assert response.status_code == 400 and "cannot fit the model's context" in response.text
    assert response.json()["error"]["param"] == "text" and calls == []


def test_tokenization_runs_off_the_event_loop(server, monkeypatch):
    """While a request's text is being tokenized, /health still answers (the tokenizer runs in a worker thread)."""
    tokenizer = server.engine.tokenizer
    entered, release = threading.Event(), threading.Event()
    original = type(tokenizer).__call__

    def slow(self, text, *args, **kwargs):
        if text == "hold me":
            entered.set()
            release.wait(30)
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", slow)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
        f"{server.url}/generate", json={"text": "hold me", "sampling_params": {"max_new_tokens": 2}}, timeout=60)))
    thread.start()
    try:
        assert entered.wait(30)
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # the loop is free
    finally:
        release.set()
        thread.join(60)
    assert result["r"].status_code == 200


# ---- item 5: work per request and in flight --------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "body", "flag"), [
    ("/v1/completions", {"prompt": ["a"] * 20, "n": 2, "max_tokens": 4}, "--max-sequences-per-request"),
    ("/generate", {"input_ids": [[5]] * 33}, "--max-sequences-per-request"),
    ("/generate", {"text": ["a"] * 33}, "--max-sequences-per-request"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 33}, "--max-sequences-per-request"),
    ("/generate", {"input_ids": [[5]] * 12, "sampling_params": {"max_new_tokens": 200}}, "--max-tokens-per-request"),
])
def test_a_request_asking_too_much_is_400_naming_the_bound(server, path, body, flag):
    response = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert response.status_code == 400 and flag in response.text, response.text
    assert _health(server)["inflight_sequences"] == 0


def test_a_full_server_answers_429_with_retry_after_and_recovers(server):
    assert httpx.post(f"{server.url}/pause_generation", headers=AUTH, timeout=30).status_code == 200
    results: list[httpx.Response] = []

    def post(count: int) -> None:
        results.append(httpx.post(f"{server.url}/generate", timeout=120,
                                  json={"input_ids": [[5, 6]] * count, "sampling_params": {"max_new_tokens": 2}}))

    holders = [threading.Thread(target=post, args=(32,)) for _ in range(2)]
    try:
        for thread in holders:
            thread.start()
        wait_until(lambda: _health(server)["inflight_sequences"] == 64, 30, "64 sequences in flight")
        full = httpx.post(f"{server.url}/generate", json={"input_ids": [5]}, timeout=30)
        assert full.status_code == 429 and full.headers["retry-after"] == "1", full.text
        assert full.json()["error"]["type"] == "rate_limit_error"
        streamed = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "stream": True}, timeout=30)
        assert streamed.status_code == 429
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # health answers when full
    finally:
        httpx.post(f"{server.url}/continue_generation", headers=AUTH, timeout=30)
        for thread in holders:
            thread.join(120)
    assert [r.status_code for r in results] == [200, 200]
    assert _settled(server)["inflight_sequences"] == 0


# ---- item 6: a client that goes away -------------------------------------------------------------------------------
REQUESTS = {
    "generate": ("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}),
    "completions": ("/v1/completions", {"prompt": "ab", "max_tokens": LONG, "ignore_eos": True}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG,
                                      "ignore_eos": True}),
    "completions-stream": ("/v1/completions", {"prompt": "ab", "max_tokens": LONG, "ignore_eos": True,
                                               "stream": True}),
    "chat-stream": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG,
                                             "ignore_eos": True, "stream": True, "logprobs": True}),
}


def _disconnect_after(server: Server, path: str, body: dict, delay_s: float) -> None:
    payload = json.dumps(body).encode()
    sock = _connect(server)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    wait_until(lambda: _health(server)["in_flight_requests"] > 0, 30, "the request to reach the engine")
    time.sleep(delay_s)
    sock.close()


@settings(max_examples=10, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck),
                    phases=(Phase.explicit, Phase.generate))  # no shrinking: each case is a real server call
@given(kind=st.sampled_from(sorted(REQUESTS)), delay_s=st.floats(0.0, 0.3))
def test_a_disconnected_client_s_generation_is_aborted(server, kind, delay_s):
    """The engine is paused, so the request can only leave it by being aborted: it must, once its client is gone."""
    _settled(server)
    assert httpx.post(f"{server.url}/pause_generation", headers=AUTH, timeout=30).status_code == 200
    try:
        path, body = REQUESTS[kind]
        _disconnect_after(server, path, body, delay_s)
        health = _settled(server)  # while still paused: aborted, not finished
        assert health["paused"] is True
    finally:
        httpx.post(f"{server.url}/continue_generation", headers=AUTH, timeout=30)


def test_a_graceful_stop_ends_within_its_grace_and_aborts_the_work(tiny_workspace):
    """SIGTERM's path (uvicorn's shutdown): a request still running past ``shutdown_grace_s`` is cancelled and its
    generation aborted in the engine (held by a pause, it could end no other way); the stop does not wait for it."""
    stopping = Server(tiny_workspace / "model", http_limits=HTTPLimits(shutdown_grace_s=1), generation_limits=WORK)
    assert httpx.post(f"{stopping.url}/pause_generation", headers=AUTH, timeout=30).status_code == 200
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", _post_quietly(
        f"{stopping.url}/generate", REQUESTS["generate"][1])))
    thread.start()
    wait_until(lambda: stopping.health()["in_flight_requests"] > 0, 30, "the request to start")
    stopping.stop()
    thread.join(60)
    assert not stopping.thread_server.thread.is_alive(), "the server did not stop within its grace"
    assert asyncio.run(stopping.engine.health())["in_flight_requests"] == 0


def _post_quietly(url: str, body: dict) -> httpx.Response | None:
    try:
        return httpx.post(url, json=body, timeout=120)
    except httpx.HTTPError:
        return None


# ---- item 7: slow clients -----------------------------------------------------------------------------------------
def test_idle_and_trickling_connections_are_closed(server):
    idle = [_connect(server) for _ in range(10)]
    trickling = [_connect(server) for _ in range(5)]
    request = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    closed = []

    def trickle(sock: socket.socket) -> None:
        for byte in request:  # one byte every 0.2 s: would take 14 s, twice the deadline and more
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed.append(sock)
                return
            time.sleep(0.2)

    threads = [threading.Thread(target=trickle, args=(sock,)) for sock in trickling]
    for thread in threads:
        thread.start()
    for sock in idle:
        answer = _read_until_closed(sock)
        assert answer == b"" or b"408" in answer.split(b"\r\n", 1)[0]
    for thread in threads:
        thread.join(60)
    for sock in trickling:
        if sock not in closed:
            assert b"408" in _read_until_closed(sock, 5).split(b"\r\n", 1)[0]
    assert len(closed) + sum(1 for s in trickling if s not in closed) == len(trickling)
    assert _health(server)["in_flight_requests"] == 0


def test_a_body_shorter_than_its_content_length_gets_408(server):
    sock = _connect(server)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"input_ids\": [5]")
    answer = _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert _health(server)["in_flight_requests"] == 0


def test_connections_past_the_cap_get_503(tiny_workspace):
    capped = Server(tiny_workspace / "model", http_limits=HTTPLimits(max_connections=8, header_timeout_s=30,
                                                                     keep_alive_s=30))
    held = []
    try:
        for _ in range(8):  # each registered: a kept-alive connection that has had its answer
            sock = _connect(capped)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(12).startswith(b"HTTP/1.1 200")
            held.append(sock)
        extra = _connect(capped)
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_until_closed(extra, 10).startswith(b"HTTP/1.1 503")
        held.pop().close()
        wait_until(lambda: _health_or_none(capped) is not None, 30, "a freed slot to be taken")
    finally:
        for sock in held:
            sock.close()
        capped.stop()


def _health_or_none(server: Server) -> dict | None:
    try:
        return _health(server)
    except httpx.HTTPError:
        return None


# ---- every server: the scaling API, the agent gateway, the metrics endpoint --------------------------------------------
def test_every_server_relax_runs_has_the_same_bounds(tiny_workspace):
    from relax.backends.inference.embedded import EmbeddedEngine
    from relax.backends.inference.router import EngineRouter
    from relax.distributed.process_group import free_loopback_port
    from relax.rollout.agentic.gateway import AgentGateway
    from relax.rollout.scaling import ScaleManager
    from relax.serving.scaling_api import create_scaling_app
    from relax.telemetry.metrics_service import MetricsService
    from relax.utils.http_server import ThreadedServer

    engine = EmbeddedEngine.from_pretrained(str(tiny_workspace / "model"))
    limits = HTTPLimits(max_request_bytes=4096, header_timeout_s=1.0, body_timeout_s=1.0)
    manager = ScaleManager(EngineRouter([engine]), weights=lambda: (1, []))
    scaling_port = free_loopback_port()
    scaling = ThreadedServer(create_scaling_app(manager), "127.0.0.1", scaling_port, limits=limits)
    scaling.start()
    metrics = MetricsService(free_loopback_port(), http_limits=limits).start()
    loop = asyncio.new_event_loop()
    gateway = AgentGateway(engine.tokenizer, http_limits=limits)
    loop.run_until_complete(gateway.start())
    gateway_loop = threading.Thread(target=loop.run_forever, daemon=True)
    gateway_loop.start()
    try:
        for port, path in ((scaling_port, "/scale_out"), (metrics.port, "/metrics"), (gateway.port, "/v1/models")):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            sock.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            assert _read_until_closed(sock).split(b"\r\n", 1)[0].endswith(b"408 Request Timeout"), port
        too_big = httpx.post(f"http://127.0.0.1:{scaling_port}/scale_out", content=b"x" * 8192, timeout=30)
        assert too_big.status_code == 413
        assert httpx.get(f"http://127.0.0.1:{metrics.port}/metrics", timeout=30).status_code == 200
    finally:
        scaling.stop()
        metrics.close()
        asyncio.run_coroutine_threadsafe(gateway.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        gateway_loop.join(10)


# ---- the load test ---------------------------------------------------------------------------------------------------
def test_health_answers_under_a_load_of_careless_clients(tiny_workspace):
    """200 concurrent clients on `relax serve`'s default bounds (a shorter header deadline, so that the trickling
    clients are dropped within the test): a third disconnect mid-request, a tenth trickle their headers, the rest
    generate. /health answers every probe throughout (the longest probe is recorded; benchmarks/serve_load_cpu.py
    compares it with one second), and nothing stays in flight afterwards."""
    from benchmarks.serve_load_cpu import run_load

    loaded = Server(tiny_workspace / "model", http_limits=HTTPLimits(header_timeout_s=2.0))
    try:
        report = run_load(loaded.url, loaded.port, clients=200, max_tokens=8, trickle_s=6.0)
        assert report["health_failures"] == 0, report
        assert report["completed"] == report["generating_clients"], report
        assert report["in_flight_after"] == report["inflight_sequences_after"] == 0, report
    finally:
        loaded.stop()
