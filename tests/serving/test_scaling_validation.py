"""Issue 28, items 8-9: the scaling API shows no engine URL's secrets, refuses bad requests at once (400 naming the
field), and keeps ``timeout_secs`` even while the engines' loop is busy with a training step."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from relax.backends.inference.embedded import EmbeddedEngine
from relax.backends.inference.router import EngineRouter
from relax.distributed.process_group import free_loopback_port
from relax.rollout.scaling import TERMINAL, ScaleManager
from relax.serving.scaling_api import create_scaling_app
from relax.utils.http_server import ThreadedServer
from relax.utils.urls import join_url, redact_url, redact_urls_in

TOKEN = "scale-token"
PROPERTY = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck),
                    phases=(Phase.explicit, Phase.generate))  # no shrinking: each case is a real server call
SECRET = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789-_", min_size=6, max_size=24)


@pytest.fixture
def api(tiny_workspace):
    """The scaling API on its own thread over one embedded engine; operations on an engines' loop of their own.
    The connector 'connects' any URL to a server that never answers its health check (the URL is what matters)."""
    engine_loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=engine_loop.run_forever, daemon=True)
    loop_thread.start()
    router = EngineRouter([EmbeddedEngine.from_pretrained(str(tiny_workspace / "model"))])

    class Silent:
        def __init__(self, url: str) -> None:
            self.base_url = redact_url(url)

        async def health(self):
            await asyncio.sleep(3600)

    async def connect(url: str):
        return Silent(url)

    manager = ScaleManager(router, weights=lambda: (1, []), connector=connect, loop=engine_loop,
                           health_timeout_s=0.5)
    server = ThreadedServer(create_scaling_app(manager, api_key=TOKEN), "127.0.0.1", free_loopback_port())
    server.start()
    client = httpx.Client(base_url=f"http://{server.address}", timeout=30,
                          headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        yield client, manager, engine_loop
    finally:
        client.close()
        server.stop()
        engine_loop.call_soon_threadsafe(engine_loop.stop)
        loop_thread.join(10)


def _terminal(client: httpx.Client, request_id: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        op = client.get(f"/scale_out/{request_id}").json()
        if op["status"] in {s.value for s in TERMINAL}:
            return op
        time.sleep(0.02)
    raise AssertionError(f"{request_id} did not end")


# ---- item 8: no secret in any answer or log ------------------------------------------------------------------------
@PROPERTY
@given(user=SECRET, password=SECRET, token=SECRET, path=st.sampled_from(["", "/", "/some/path", "/v1/"]))
def test_engine_url_secrets_appear_in_no_answer(api, user, password, token, path):
    client, manager, _ = api
    url = f"http://{user}:{password}@127.0.0.1:9{path}?token={token}&plain=1"
    op = client.post("/scale_out", json={"engine_urls": [url], "timeout_secs": 5}).json()
    answers = [json.dumps(op), client.get(f"/scale_out/{op['request_id']}").text, client.get("/scale_out").text,
               client.get("/engines").text, json.dumps(_terminal(client, op["request_id"]))]
    for text in answers:
        for secret in (user, password, token):
            assert secret not in text, text
    assert "token=***" in answers[0]


@PROPERTY
@given(user=SECRET, token=SECRET, host=st.sampled_from(["127.0.0.1", "example.org", "[::1]"]),
       port=st.integers(1, 65535), path=st.sampled_from(["", "/a/b", "/p;x"]),
       words=st.lists(st.sampled_from(["POST", "failed:", "(", ")", "to", "at"]), max_size=4))
def test_redaction_hides_every_secret_of_generated_urls(user, token, host, port, path, words):
    url = f"https://{user}:pw-{token}@{host}:{port}{path}?api_key={token}"
    for text in (redact_url(url), redact_urls_in(" ".join([*words, url, *words])), redact_urls_in(f"({url})."),
                 redact_urls_in(f"'{url}'")):
        assert token not in text and user not in text, text
    joined = join_url(url, "/health")
    assert joined.endswith(f"?api_key={token}") and "/health?" in joined  # a query stays a query


# ---- item 9: bad requests refused at once --------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "param"), [
    ({"engine_urls": ["not a url"]}, "engine_urls.0"),
    ({"engine_urls": ["file:///etc/passwd"]}, "engine_urls.0"),
    ({"engine_urls": ["http://127.0.0.1:1", "ftp://x"]}, "engine_urls.1"),
    ({"engine_urls": ["http://127.0.0.1:99999"]}, "engine_urls.0"),
    ({"engine_urls": ["127.0.0.1:8000"]}, "engine_urls.0"),
    ({"engine_urls": ["http://127.0.0.1:1", "http://127.0.0.1:1/"]}, "engine_urls"),
    ({"num_replicas": 2, "request_id": "a/b"}, "request_id"),
    ({"num_replicas": 2, "request_id": "a b"}, "request_id"),
    ({"num_replicas": 2, "model_name": "no-such-model"}, "model_name"),
])
def test_bad_scale_out_requests_get_400_at_once(api, body, param):
    client, manager, _ = api
    response = client.post("/scale_out", json=body)
    assert response.status_code == 400 and response.json()["param"] == param, response.text
    assert client.get("/scale_out").json()["total_count"] == 0  # nothing registered, nothing blocks the next
    assert "not a url" not in response.text.lower() or "engine_urls" in response.text


def test_scale_in_of_an_engine_that_does_not_serve_is_400(api):
    client, _, _ = api
    response = client.post("/scale_in", json={"engine_urls": ["http://127.0.0.1:5/"]})
    assert response.status_code == 400 and response.json()["param"] == "engine_urls.0"
    assert client.post("/scale_in", json={"num_replicas": 1, "model_name": "x"}).json()["param"] == "model_name"


def test_a_request_id_can_always_be_polled(api):
    client, _, _ = api
    op = client.post("/scale_in", json={"num_replicas": 1, "request_id": "ok-1.2_3:4"}).json()
    assert client.get(f"/scale_in/{op['request_id']}").status_code == 200


def test_timeout_secs_holds_while_the_engines_loop_is_busy(api):
    """A training step holds the engines' loop; the operation's deadline is kept from the API's side: FAILED at
    once past it, and what it began is rolled back when the loop is free."""
    client, manager, engine_loop = api
    released = threading.Event()
    asyncio.run_coroutine_threadsafe(asyncio.to_thread(lambda: None), engine_loop)  # the loop runs

    async def training_step():
        released.wait(60)  # holds the loop without awaiting

    asyncio.run_coroutine_threadsafe(training_step(), engine_loop)
    try:
        op = client.post("/scale_out", json={"engine_urls": ["http://127.0.0.1:7"], "timeout_secs": 0.5}).json()
        final = _terminal(client, op["request_id"], timeout_s=30)
        assert final["status"] == "FAILED" and "timeout_secs 0.5" in final["error_message"]
        assert not released.is_set()  # decided while the loop was still held
        later = client.post("/scale_in", json={"num_replicas": 1})
        assert later.status_code == 200  # the expired operation blocks nothing
    finally:
        released.set()
    deadline = time.monotonic() + 30
    while len(manager.router.engines) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(manager.router.engines) == 1 and manager.operations[op["request_id"]].status.value == "FAILED"


def test_relax_scale_out_passes_its_start_timeout_as_the_operations_bound(api, capsys):
    """`relax scale out --start-timeout S` is the operation's timeout_secs: an engine that never turns healthy
    fails the operation with S as its bound (not the API's default), and the command says so and exits 1; its
    polling (--timeout 1 here) outlasts S."""
    from relax.cli import scale

    client, _, _ = api
    code = scale.main(["out", "--url", str(client.base_url), "--engine-urls", "http://127.0.0.1:7", "--start-timeout",
                       "0.7", "--timeout", "1", "--api-key", TOKEN])
    operation = json.loads(capsys.readouterr().out)
    assert code == 1 and operation["status"] == "FAILED" and "timeout_secs 0.7" in operation["error_message"]
