"""Elastic scale-out / scale-in of rollout engines over the REST API: real HTTP on 127.0.0.1, real embedded
engines behind the real router."""

import json
import threading
import time

import httpx
import pytest
import torch
import uvicorn

from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.embedded import EmbeddedEngine
from relax.backends.inference.router import EngineRouter
from relax.distributed.process_group import free_loopback_port
from relax.rollout.scaling import ScaleManager
from relax.serving.scaling_api import create_scaling_app
from tests.support.http_servers import ThreadServer
from tests.support.waits import PROCESS_PATIENCE_S, wait_until

TOKEN = "scale-secret"
TRAINED_VERSION = 5


def _trained_weights(model_dir):
    """The 'trainer's' current weights: the model moved away from its start, as version 5."""
    model = EmbeddedEngine.from_pretrained(str(model_dir)).model
    generator = torch.Generator().manual_seed(0)
    # named_parameters lists a tied tensor once (the embedding and the LM head are one here), as the trainer does
    return {name: p.detach() + 0.01 * torch.randn(p.shape, generator=generator) for name, p in model.named_parameters()}


@pytest.fixture
def service(tiny_workspace):
    model_dir = tiny_workspace / "model"
    trained = _trained_weights(model_dir)
    initial = EmbeddedEngine.from_pretrained(str(model_dir))
    router = EngineRouter([initial])
    created = []

    async def factory():
        engine = EmbeddedEngine.from_pretrained(str(model_dir))
        created.append(engine)
        return engine, None

    manager = ScaleManager(router, weights=lambda: (TRAINED_VERSION, trained.items()), factory=factory)
    server = ThreadServer(uvicorn.Config(create_scaling_app(manager, api_key=TOKEN), log_level="warning"))
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        yield client, manager, router, created, trained
    server.stop()


def _wait_terminal(client, kind, request_id, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        op = client.get(f"/{kind}/{request_id}").json()
        if op["status"] in ("ACTIVE", "COMPLETED", "FAILED", "CANCELLED", "NOOP"):
            return op
        time.sleep(0.05)
    raise AssertionError(f"{kind} {request_id} did not finish within {timeout_s} s")


def _wait_for_scaling_api(url: str, train) -> None:
    """Until `relax train --rollout-api-port` answers (fails if the training exits first)."""
    wait_until(lambda: httpx.get(f"{url}/engines", timeout=5).status_code == 200, PROCESS_PATIENCE_S,
               "the scaling API", process=train, interval_s=0.1)


def test_scale_out_to_three_and_back_to_one(service):
    client, manager, router, created, trained = service
    response = client.post("/scale_out", json={"num_replicas": 3, "request_id": "out-1"})
    assert response.status_code == 200 and response.json()["status"] in ("PENDING", "CREATING", "HEALTH_CHECKING",
                                                                         "WEIGHT_SYNCING", "READY", "ACTIVE")
    op = _wait_terminal(client, "scale_out", "out-1")
    assert op["status"] == "ACTIVE" and op["weight_version"] == TRAINED_VERSION and len(op["engine_ids"]) == 2
    table = client.get("/engines").json()
    assert table["total_engines"] == 3 and len(router.engines) == 3
    assert all(engine["is_healthy"] for engine in table["models"]["default"]["engines"])
    # new engines serve the trainer's current weights, never the checkpoint's
    for engine in created:
        assert engine.weight_version == TRAINED_VERSION
        for name, param in engine.model.named_parameters():
            assert torch.equal(param, trained[name].to(param.dtype)), name
    # idempotent: the same request id returns the same operation; the target already met is a NOOP
    assert client.post("/scale_out", json={"num_replicas": 3, "request_id": "out-1"}).json()["request_id"] == "out-1"
    assert client.post("/scale_out", json={"num_replicas": 3}).json()["status"] == "NOOP"

    # the initial engine is protected; a dry run shows the last-in-first-out selection
    rejected = client.post("/scale_in", json={"num_replicas": 0})
    assert rejected.status_code == 400 and "protected" in rejected.text
    dry = client.post("/scale_in", json={"num_replicas": 2, "dry_run": True}).json()
    assert dry["status"] == "NOOP" and dry["selected_engines"] == [op["engine_ids"][-1]]
    back = client.post("/scale_in", json={"num_replicas": 1, "request_id": "in-1"}).json()
    done = _wait_terminal(client, "scale_in", back["request_id"])
    assert done["status"] == "COMPLETED" and done["removed_engines"] == list(reversed(op["engine_ids"]))
    assert len(router.engines) == 1 and client.get("/engines").json()["total_engines"] == 1
    listed = client.get("/scale_in").json()
    assert listed["total_count"] == 3 and client.get("/scale_out/nope").status_code == 404


def test_one_operation_at_a_time_and_cancel_rolls_back(service):
    client, manager, router, created, _ = service
    slow = manager.factory

    async def slow_factory():
        import asyncio

        await asyncio.sleep(1.0)
        return await slow()

    manager.factory = slow_factory
    first = client.post("/scale_out", json={"num_replicas": 3}).json()
    conflict = client.post("/scale_out", json={"num_replicas": 4})
    assert conflict.status_code == 409 and first["request_id"] in conflict.text
    cancelled = client.post(f"/scale_out/{first['request_id']}/cancel")
    assert cancelled.status_code == 200
    assert _wait_terminal(client, "scale_out", first["request_id"])["status"] == "CANCELLED"
    assert len(router.engines) == 1


def test_control_endpoints_need_the_token(service):
    client, *_ = service
    anonymous = httpx.post(f"{client.base_url}/scale_out", json={"num_replicas": 2})
    assert anonymous.status_code == 401 and TOKEN not in anonymous.text
    assert httpx.get(f"{client.base_url}/engines").status_code == 200  # reads are open


def test_requests_keep_flowing_through_a_scale_out(service):
    client, manager, router, created, _ = service
    import asyncio

    async def traffic():
        requests = [GenerationRequest(f"g{i}-i0-0", [5, 6, 7], SamplingParams(max_new_tokens=4, seed=i, ignore_eos=True))
                    for i in range(12)]
        return await router.generate(requests)

    op = client.post("/scale_out", json={"num_replicas": 2}).json()
    outputs = asyncio.run(traffic())  # concurrently with the scale-out running on the server's loop
    assert len(outputs) == 12 and all(len(o.output_ids) == 4 for o in outputs)
    assert _wait_terminal(client, "scale_out", op["request_id"])["status"] == "ACTIVE"


def test_scale_out_and_in_during_fully_async_training(tiny_workspace, tmp_path):
    """`relax train --fully-async --rollout-api-port`, driven by `relax scale`: 1 -> 3 -> 1 engines while it trains;
    training goes on, every group is trained once, and new engines serve the current weight version."""

    from relax.telemetry.metrics_file import read_metrics
    from tests.support.runs import popen_relax, run_relax, tiny_train_args

    port, out = free_loopback_port(), tmp_path / "run"
    train = popen_relax(
        "train", *tiny_train_args(
            tiny_workspace, out, "--fully-async", "--max-staleness", "1", "--num-rollout", "250",
            "--skip-eval-before-train", "--dump-samples", "0", "--rollout-api-port", str(port),
            "--rollout-api-key", TOKEN))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_scaling_api(url, train)

        scaled = run_relax("scale", "out", "--url", url, "--num-replicas", "3", "--api-key", TOKEN)
        assert scaled.returncode == 0, scaled.stderr
        operation = json.loads(scaled.stdout)
        assert operation["status"] == "ACTIVE" and train.poll() is None  # training still running
        # The training goes on updating every engine (the router's update reaches them concurrently), so one
        # snapshot may catch an update half applied: the versions differ by one at most, none is behind the version
        # the new engines were synced at, and between two updates they agree (an engine left behind never would).
        def versions_agree() -> bool:
            versions = [e["weight_version"] for e in httpx.get(f"{url}/engines").json()["models"]["default"]["engines"]]
            assert len(versions) == 3 and max(versions) - min(versions) <= 1, versions
            assert min(versions) >= max(operation["weight_version"], 1), (versions, operation)
            return len(set(versions)) == 1

        wait_until(versions_agree, PROCESS_PATIENCE_S, "the three engines to serve one weight version", process=train,
                   interval_s=0.05)
        time.sleep(1.0)  # let the three engines serve a few steps
        back = run_relax("scale", "in", "--url", url, "--num-replicas", "1", "--api-key", TOKEN)
        assert back.returncode == 0, back.stderr
        assert json.loads(back.stdout)["status"] == "COMPLETED" and train.poll() is None
        _, stderr = train.communicate(timeout=600)
        assert train.returncode == 0, stderr[-3000:]
    finally:
        if train.poll() is None:
            train.kill()
    rows = read_metrics(out / "metrics.jsonl")
    trained = [r for r in rows if "data/produced_groups" in r]
    assert [r["step"] for r in trained] == list(range(1, 251))
    assert all(r["data/produced_groups"] == r["data/consumed_groups"] == 4 for r in trained)
    assert TOKEN not in stderr


def test_an_external_engine_joins_and_leaves_a_running_training(tiny_workspace, tmp_path):
    """`/scale_out` with ``engine_urls`` on `relax train --rollout-api-port` (issue 19): a `relax serve` server is
    health-checked, loads the trainer's current weights from --rollout-weights-dir, joins the router and serves the
    training's groups; `/scale_in` drains and removes it; the training goes on and trains every step once."""

    from relax.telemetry.metrics_file import read_metrics
    from tests.support.http_servers import Server
    from tests.support.runs import popen_relax, tiny_train_args

    port, out = free_loopback_port(), tmp_path / "run"
    external = Server(tiny_workspace / "model", api_key=None, weight_update_root=out)
    args = tiny_train_args(tiny_workspace, out, "--num-rollout", "20", "--skip-eval-before-train", "--dump-samples",
                           "0", "--rollout-api-port", str(port), "--rollout-api-key", TOKEN, "--reward-timeout", "300")
    # The training's rewards wait while the hold file exists: the steps go on only when the test lets them, so the
    # run can neither end before the engine joins nor before it leaves, however loaded the machine is.
    args[args.index("--custom-rm-path") + 1] = "tests.support.e2e_rewards:digit_fraction_held"
    hold = tmp_path / "hold"
    hold.touch()
    train = popen_relax("train", *args, env={"RELAX_CHAOS_HOLD": str(hold)})
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        _wait_for_scaling_api(url, train)
        with httpx.Client(base_url=url, timeout=60, headers=auth) as client:
            joined = client.post("/scale_out", json={"engine_urls": [external.url],
                                                       "timeout_secs": PROCESS_PATIENCE_S})
            assert joined.status_code == 200, joined.text
            op = _wait_terminal(client, "scale_out", joined.json()["request_id"], timeout_s=PROCESS_PATIENCE_S)
            assert op["status"] == "ACTIVE", op
            assert external.engine.weight_version >= op["weight_version"]  # the trainer's, then newer ones
            engines = client.get("/engines").json()["models"]["default"]["engines"]
            assert external.url in [e["url"] for e in engines]
            hold.unlink()
            wait_until(lambda: external.health()["engine_calls"] > 0, PROCESS_PATIENCE_S,
                       "the training's groups to reach the joined engine", process=train, interval_s=0.05)
            hold.touch()
            left = client.post("/scale_in", json={"engine_urls": [external.url]})
            assert left.status_code == 200, left.text
            assert _wait_terminal(client, "scale_in", left.json()["request_id"])["status"] == "COMPLETED"
            calls = external.health()["engine_calls"]
            assert train.poll() is None
        hold.unlink()
        _, stderr = train.communicate(timeout=600)
        assert train.returncode == 0, stderr[-3000:]
        assert external.health()["engine_calls"] == calls  # removed: no request after it left
    finally:
        if train.poll() is None:
            train.kill()
        external.stop()
    trained = [row for row in read_metrics(out / "metrics.jsonl") if "train/loss" in row]
    assert [row["step"] for row in trained] == list(range(1, 21))


# ---- hard to break (issue 14, items 19-22) ----------------------------------------------------------------------
def test_a_rejected_request_never_wedges_the_api(service):
    client, manager, router, created, _ = service
    rejected = client.post("/scale_out", json={"engine_urls": ["http://127.0.0.1:9"], "request_id": "ext-1"})
    assert rejected.status_code == 400 and "cannot connect external engines" in rejected.json()["detail"]
    assert client.get("/scale_out/ext-1").json()["status"] == "REJECTED"
    assert client.post("/scale_out/ext-1/cancel").status_code == 400  # nothing to cancel: it never ran
    too_many = client.post("/scale_out", json={"num_replicas": manager.max_engines + 1})
    assert too_many.status_code == 400 and "--scale-out-max-engines" in too_many.json()["detail"]
    later = client.post("/scale_out", json={"num_replicas": 2})
    assert later.status_code == 200, later.text
    assert _wait_terminal(client, "scale_out", later.json()["request_id"])["status"] == "ACTIVE"


def test_the_idempotency_key_is_tied_to_kind_and_body(service):
    client, *_ = service
    first = client.post("/scale_in", json={"num_replicas": 1, "request_id": "key-1"})
    assert first.status_code == 200 and first.json()["status"] == "NOOP"
    assert client.post("/scale_in", json={"num_replicas": 1, "request_id": "key-1"}).json() == first.json()
    other_kind = client.post("/scale_out", json={"num_replicas": 2, "request_id": "key-1"})
    assert other_kind.status_code == 409 and "key-1" in other_kind.json()["detail"]
    other_body = client.post("/scale_in", json={"num_replicas": 1, "force": True, "request_id": "key-1"})
    assert other_body.status_code == 409


@pytest.mark.parametrize("body, param", [
    ({"num_replicas": "2"}, "num_replicas"), ({"num_replicas": 2.0}, "num_replicas"),
    ({"num_replicas": True}, "num_replicas"), ({"num_replicas": 10**6}, "num_replicas"),
    ({"num_replicas": 2, "timeout_secs": "5"}, "timeout_secs"), ({"num_replicas": 2, "replicas": 3}, "replicas"),
    ({"num_replicas": 2, "request_id": ""}, "request_id"),
])
def test_scale_out_bodies_are_strict(service, body, param):
    response = service[0].post("/scale_out", json=body)
    assert response.status_code == 400 and response.json()["param"] == param, response.text


def test_scale_in_bodies_are_strict(service):
    response = service[0].post("/scale_in", json={"num_replicas": 1, "force": "yes"})
    assert response.status_code == 400 and response.json()["param"] == "force"


def test_timeout_secs_holds_while_engines_are_created(service):
    client, manager, router, created, _ = service
    build = manager.factory

    async def slow_factory():  # loading a model in a worker thread, as the training's factory does
        import asyncio

        await asyncio.to_thread(time.sleep, 1.0)
        return await build()

    manager.factory = slow_factory
    op = client.post("/scale_out", json={"num_replicas": 8, "timeout_secs": 0.2}).json()
    final = _wait_terminal(client, "scale_out", op["request_id"])
    assert final["status"] == "FAILED" and "timeout_secs 0.2" in final["error_message"]
    assert len(router.engines) == 1


def test_the_api_answers_while_the_engines_loop_is_busy(tiny_workspace):
    """Production wiring: the API on its own thread, operations on the engines' loop. A blocked engine loop (a
    training step) delays the operation, never the answers."""
    import asyncio

    from relax.utils.http_server import ThreadedServer

    engine_loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=engine_loop.run_forever, daemon=True)
    loop_thread.start()
    model_dir = tiny_workspace / "model"
    router = EngineRouter([EmbeddedEngine.from_pretrained(str(model_dir))])

    async def factory():
        return EmbeddedEngine.from_pretrained(str(model_dir)), None

    manager = ScaleManager(router, weights=lambda: (1, []), factory=factory, loop=engine_loop)
    server = ThreadedServer(create_scaling_app(manager, api_key=TOKEN), "127.0.0.1", free_loopback_port())
    server.start()
    released, finished = threading.Event(), threading.Event()

    async def training_step():  # holds the loop without awaiting, as a compute-bound step does
        released.wait(30)
        finished.set()

    try:
        asyncio.run_coroutine_threadsafe(training_step(), engine_loop)
        with httpx.Client(base_url=f"http://{server.address}", timeout=30,
                          headers={"Authorization": f"Bearer {TOKEN}"}) as client:
            assert client.get("/engines").status_code == 200
            op = client.post("/scale_out", json={"num_replicas": 3}).json()
            assert op["status"] == "PENDING"
            cancel = client.post(f"/scale_out/{op['request_id']}/cancel")
            assert cancel.status_code == 200 and "cancel" in cancel.json()["message"]
            assert not finished.is_set(), "the answers waited for the engines' loop"
            released.set()
            assert _wait_terminal(client, "scale_out", op["request_id"])["status"] == "CANCELLED"
        assert len(router.engines) == 1
    finally:
        released.set()
        server.stop()
        engine_loop.call_soon_threadsafe(engine_loop.stop)
        loop_thread.join(10)


def test_relax_train_takes_the_scaling_token_from_the_environment(tiny_workspace, tmp_path):
    """One rule for every server: the flag, else $RELAX_API_KEY; the log says whether auth is on, never the key."""
    import signal

    import yaml

    from tests.support.runs import popen_relax, tiny_train_args

    port, out = free_loopback_port(), tmp_path / "run"
    train = popen_relax(
        "train", *tiny_train_args(
            tiny_workspace, out, "--num-rollout", "500", "--skip-eval-before-train", "--dump-samples", "0",
            "--rollout-api-port", str(port)), env={"RELAX_API_KEY": TOKEN})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_scaling_api(url, train)
        assert httpx.post(f"{url}/scale_out", json={"num_replicas": 2}).status_code == 401
        authorized = httpx.post(f"{url}/scale_in", json={"num_replicas": 1},
                                headers={"Authorization": f"Bearer {TOKEN}"})
        assert authorized.status_code == 200 and authorized.json()["status"] == "NOOP"
    finally:
        train.send_signal(signal.SIGTERM)
        _, stderr = train.communicate(timeout=PROCESS_PATIENCE_S)
    assert "scaling API on" in stderr and "need a bearer token" in stderr
    assert TOKEN not in stderr and TOKEN not in (out / "run.log").read_text()
    assert yaml.safe_load((out / "config.yaml").read_text())["rollout_api_key"] is None
