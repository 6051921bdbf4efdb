"""HTTP inference engines and the router, against real `relax serve` servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from relax.backends.inference.base import GenerationRequest, SamplingParams, group_key
from relax.backends.inference.embedded import EmbeddedEngine
from relax.backends.inference.remote.openai import OpenAIHTTPEngine
from relax.backends.inference.remote.sglang import EngineUnavailableError, SGLangHTTPEngine, distinct_seeds
from relax.backends.inference.router import EngineRouter
from relax.telemetry.metrics_file import read_metrics
from tests.support.http_servers import API_KEY, Server, free_port
from tests.support.runs import popen_relax, run_relax, tiny_train_args
from tests.support.tiny_assets import build_tiny_model_dir
from tests.support.waits import PROCESS_PATIENCE_S, wait_until


@pytest.fixture(scope="module")
def model_dir(tiny_workspace) -> Path:
    return tiny_workspace / "model"


@pytest.fixture
def servers(model_dir):
    started: list[Server] = []

    def start(count: int = 1, **kwargs) -> list[Server]:
        new = [Server(model_dir, **kwargs) for _ in range(count)]
        started.extend(new)
        return new

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def reference(model_dir) -> EmbeddedEngine:
    return EmbeddedEngine.from_pretrained(str(model_dir))


def request(rid: str, prompt: list[int], n: int, temperature: float = 0.0, seed: int | None = None):
    return GenerationRequest(rid, prompt, SamplingParams(max_new_tokens=n, temperature=temperature, ignore_eos=True,
                                                         seed=seed))


class Recording(SGLangHTTPEngine):
    """Records the request ids it was asked to generate."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[str] = []

    async def generate(self, requests):
        self.seen.extend(r.request_id for r in requests)
        return await super().generate(requests)


def test_sglang_adapter_matches_the_embedded_engine(servers, reference):
    (server,) = servers(1)
    engine = SGLangHTTPEngine(server.url, api_key=API_KEY, timeout_s=30)
    prompt = reference.tokenizer("3+4=")["input_ids"]
    for params in [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}]:
        expected = asyncio.run(reference.generate([request("r", prompt, 6, **params)]))[0]
        got = asyncio.run(engine.generate([request("r", prompt, 6, **params)]))[0]
        assert got.output_ids == expected.output_ids
        assert got.output_log_probs == pytest.approx(expected.output_log_probs, abs=1e-5)
        assert (got.finish_reason, got.weight_version, got.text) == ("length", 0, expected.text)
    health = asyncio.run(engine.health())
    assert health["weight_version"] == 0 and health["url"] == server.url
    # Requests sharing a seed get distinct ones (a server seeds each request alone), the first keeps it.
    shared = asyncio.run(engine.generate([request(f"g0-i{i}-{i}", prompt, 8, 1.0, seed=3) for i in range(4)]))
    assert len({tuple(out.output_ids) for out in shared}) > 1
    assert [r.sampling_params.seed for r in distinct_seeds([request("a", [1], 1, seed=3)] * 2)] == [3, 3 + 1_000_003]
    # Errors name the URL and endpoint; the key never shows.
    with pytest.raises(Exception, match=r"/pause_generation: HTTP 401") as info:
        asyncio.run(SGLangHTTPEngine(server.url, api_key="wrong").pause())
    assert API_KEY not in str(info.value)
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineUnavailableError, match=f"{dead}/generate: cannot reach"):
        asyncio.run(SGLangHTTPEngine(dead, timeout_s=5).generate([request("x", prompt, 1)]))


def test_sglang_adapter_streams_group_by_group_with_the_samples_of_one_batched_call(servers, reference):
    """`generate_streaming` posts each prompt group on its own, at once: every request is reported once with its
    group, and the samples equal those of one batched call (each request keeps the seed that call gives it)."""
    (server,) = servers(1)
    engine = Recording(server.url, api_key=API_KEY, timeout_s=30)
    prompts = [reference.tokenizer(text)["input_ids"] for text in ("3+4=", "12+9=", "7+7=")]
    requests = [request(f"g{g}-i{g * 10 + i}-{g * 3 + i}", prompts[g], 6, 1.0, seed=11)
                for g in range(3) for i in range(3)]
    batched = asyncio.run(engine.generate(requests))
    engine.seen.clear()
    reported: list[int] = []
    streamed = asyncio.run(engine.generate_streaming(requests, lambda position, _: reported.append(position)))
    assert sorted(reported) == list(range(9))
    assert [o.output_ids for o in streamed] == [o.output_ids for o in batched]
    for start in range(0, 9, 3):  # a group is reported together: its three positions are adjacent in the order
        group = set(range(start, start + 3))
        indexes = [i for i, position in enumerate(reported) if position in group]
        assert indexes == list(range(indexes[0], indexes[0] + 3)), reported
    assert len(engine.seen) == 9  # three posts of three requests, no request twice


def test_weight_update_through_disk_is_bit_identical(servers, model_dir, tmp_path, reference):
    (server,) = servers(1)
    engine = SGLangHTTPEngine(server.url, api_key=API_KEY, weights_dir=tmp_path / "weights")
    trainer = load_file(str(build_tiny_model_dir(tmp_path / "other", seed=1) / "model.safetensors"))
    asyncio.run(engine.update_weights(iter(trainer.items()), 5))
    assert engine.weight_version == 5 and server.health()["weight_version"] == 5
    served = dict(server.engine.model.named_parameters())
    for name, tensor in trainer.items():
        if name in served:
            assert torch.equal(served[name].detach().cpu(), tensor), name
    prompt = [5, 6, 7]
    out = asyncio.run(engine.generate([request("w", prompt, 4)]))[0]
    assert out.weight_version == 5
    expected = asyncio.run(reference.generate([request("w", prompt, 4)]))[0]
    assert out.output_log_probs != pytest.approx(expected.output_log_probs, abs=1e-4)
    with pytest.raises(ValueError, match="weights_dir"):
        asyncio.run(SGLangHTTPEngine(server.url, api_key=API_KEY).update_weights([], 6))


def test_router_balances_keeps_groups_and_fans_out(servers, model_dir, tmp_path):
    a, b = servers(2)
    engines = [Recording(s.url, api_key=API_KEY, weights_dir=tmp_path / "w") for s in (a, b)]
    router = EngineRouter(engines)

    async def scenario():
        requests = [request(f"g{g}-i{g * 4 + k}-{g * 4 + k}", [5 + g, 6, 7], 6, 1.0, seed=11)
                    for g in range(4) for k in range(4)]
        outputs = await router.generate(requests)
        assert [o.request_id for o in outputs] == [r.request_id for r in requests]
        assert all(len(o.output_ids) == 6 for o in outputs)
        await router.pause()
        await router.resume()
        tensors = load_file(str(model_dir / "model.safetensors"))
        await router.update_weights(iter(tensors.items()), 2)
        return await router.health()

    health = asyncio.run(scenario())
    assert all(engine.seen for engine in engines), "both engines got requests"
    for g in range(4):
        owners = {i for i, engine in enumerate(engines) if any(group_key(r) == f"g{g}" for r in engine.seen)}
        assert len(owners) == 1, f"group g{g} was split over engines {owners}"
    assert sorted(len(e.seen) for e in engines) == [8, 8]
    assert router.weight_version == 2 and health["weight_version"] == 2
    assert a.health()["weight_version"] == b.health()["weight_version"] == 2
    assert len(list((tmp_path / "w").iterdir())) == 1  # one published copy for engines sharing the directory


def serve_subprocess(model_dir: Path):
    port = free_port()
    process = popen_relax("serve", "--hf-checkpoint", str(model_dir), "--port", str(port), "--device", "cpu",
                          "--log-level", "warning")
    url = f"http://127.0.0.1:{port}"

    wait_until(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, PROCESS_PATIENCE_S,
               "relax serve to answer /health", process=process)
    return process, url


def has_requests_in_flight(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).json()["in_flight_requests"] > 0
    except (httpx.TransportError, ValueError):
        return False


def test_router_survives_a_killed_server(servers, model_dir):
    process, doomed_url = serve_subprocess(model_dir)
    try:
        (survivor,) = servers(1)
        doomed = SGLangHTTPEngine(doomed_url, timeout_s=30)
        router = EngineRouter([doomed, SGLangHTTPEngine(survivor.url, timeout_s=30)], retry_down_after_s=60)
        requests = [request(f"g{g}-i{g * 2 + k}-{g * 2 + k}", [5 + g, 6], 120) for g in range(4) for k in range(2)]
        result: dict = {}
        # Paused first, so that its requests are surely in flight when it dies (not finished in between, as they
        # can be on a loaded machine)
        assert httpx.post(f"{doomed_url}/pause_generation", timeout=10).status_code == 200
        thread = threading.Thread(target=lambda: result.update(out=asyncio.run(router.generate(requests))))
        thread.start()

        wait_until(lambda: has_requests_in_flight(doomed_url), 30, "requests in flight on the doomed server")
        process.send_signal(signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive()
        outputs = result["out"]
        assert [o.request_id for o in outputs] == [r.request_id for r in requests]
        assert all(o.finish_reason == "length" and len(o.output_ids) == 120 for o in outputs), "no request lost"
        stats = {s["engine"]: s for s in router.stats()}
        assert stats[doomed_url]["healthy"] is False and "cannot reach" in stats[doomed_url]["last_error"]
        assert stats[survivor.url]["served"] == len(requests)
        health = asyncio.run(router.health())  # still serving on the survivor
        assert [e["healthy"] for e in health["engines"]] == [False, True]
    finally:
        process.kill()
        process.wait(10)


def test_router_gives_up_on_a_stopped_server_and_resends_its_groups(servers, model_dir):
    """The issue-17 fault: a SIGSTOPped engine stalled training silently until the HTTP timeout. Health checks of
    the engine while it holds requests detect it within interval x failures (+ timeouts), and its whole groups
    are generated on the other engine."""
    process, stopped_url = serve_subprocess(model_dir)
    try:
        (survivor,) = servers(1)
        # an HTTP timeout far past the bounded join below: a join within it is the health checks' doing
        stopped = SGLangHTTPEngine(stopped_url, timeout_s=3600)
        router = EngineRouter([stopped, SGLangHTTPEngine(survivor.url, timeout_s=120)], retry_down_after_s=60,
                              health_check_interval_s=0.5, health_check_timeout_s=0.5, health_check_max_failures=2)
        requests = [request(f"g{g}-i{g * 2 + k}-{g * 2 + k}", [5 + g, 6], 200) for g in range(4) for k in range(2)]
        result: dict = {}

        def run() -> None:
            result["out"] = asyncio.run(router.generate(requests))

        thread = threading.Thread(target=run)
        thread.start()

        wait_until(lambda: has_requests_in_flight(stopped_url), 30, "requests in flight on the server to stop")
        process.send_signal(signal.SIGSTOP)
        thread.join(PROCESS_PATIENCE_S)
        assert not thread.is_alive()
        outputs = result["out"]
        assert [o.request_id for o in outputs] == [r.request_id for r in requests]
        assert all(o.finish_reason == "length" and len(o.output_ids) == 200 for o in outputs), "no request lost"
        stats = {s["engine"]: s for s in router.stats()}
        assert stats[stopped_url]["healthy"] is False
        assert "stopped answering health checks" in stats[stopped_url]["last_error"]
        assert stats[survivor.url]["served"] == len(requests)
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait(10)


def test_remove_engine_drains_and_add_engine_catches_up(servers, model_dir, tmp_path):
    a, b, c = servers(3)
    first, second = (SGLangHTTPEngine(s.url, api_key=API_KEY, weights_dir=tmp_path / "w") for s in (a, b))
    router = EngineRouter([first, second])

    async def scenario():
        requests = [request(f"g{g}-i{g}-{g}", [5, 6 + g], 60) for g in range(4)]
        task = asyncio.ensure_future(router.generate(requests))
        while not router._slots[0].outstanding:
            await asyncio.sleep(0.005)
        await router.remove_engine(first, drain=True, timeout_s=30)
        assert a.health()["in_flight_requests"] == 0, "removed before its requests finished"
        assert router.engines == [second]
        outputs = await task
        assert all(len(o.output_ids) == 60 for o in outputs)
        later = await router.generate([request(f"g9-i{k}-{k}", [5], 2) for k in range(3)])
        assert all(o.finish_reason == "length" for o in later)
        # A new engine is brought to the router's weight version before it gets work.
        tensors = load_file(str(model_dir / "model.safetensors"))
        await router.update_weights(iter(tensors.items()), 3)
        await router.add_engine(SGLangHTTPEngine(c.url, api_key=API_KEY, weights_dir=tmp_path / "w"))
        return outputs

    asyncio.run(scenario())
    assert c.health()["weight_version"] == 3 and b.health()["weight_version"] == 3
    assert a.health()["weight_version"] == 0
    with pytest.raises(KeyError, match="not in the router"):
        asyncio.run(router.remove_engine(a.url))


def test_openai_adapter_against_our_server(servers, model_dir, reference, tmp_path):
    (server,) = servers(1)
    engine = OpenAIHTTPEngine(server.url, "tiny", api_key=API_KEY, tokenizer=reference.tokenizer,
                              weights_dir=tmp_path / "w")
    prompt = reference.tokenizer("3+4=")["input_ids"]
    for params in [{"temperature": 0.0}, {"temperature": 1.0, "seed": 5}]:
        expected = asyncio.run(reference.generate([request("r", prompt, 6, **params)]))[0]
        got = asyncio.run(engine.generate([request("r", prompt, 6, **params)]))[0]
        assert got.output_ids == expected.output_ids
        assert got.output_log_probs == pytest.approx(expected.output_log_probs, abs=1e-5)
        assert got.finish_reason == "length"
    tensors = load_file(str(model_dir / "model.safetensors"))
    asyncio.run(engine.update_weights(iter(tensors.items()), 4))
    assert asyncio.run(engine.health())["weight_version"] == 4 == server.health()["weight_version"]
    assert engine._token_id("token_id:17") == 17


def test_train_with_external_engines(servers, tiny_workspace, tmp_path):
    a, b = servers(2)
    run_dir = tmp_path / "run"
    result = run_relax("train", *tiny_train_args(
        tiny_workspace, run_dir, "--num-rollout", "2", "--rollout-external", "--rollout-external-engine-addrs",
        a.url, b.url, "--rollout-engine-api-key", API_KEY, "--rollout-weights-dir", str(tmp_path / "weights")),
        timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert a.health()["weight_version"] == 2 and b.health()["weight_version"] == 2
    assert a.health()["batched_requests"] > 0 and b.health()["batched_requests"] > 0
    assert API_KEY not in result.stderr + result.stdout
    saved = (run_dir / "config.yaml").read_text()
    assert API_KEY not in saved and "rollout_engine_api_key: null" in saved
    assert "# rollout_engine_api_key: set for this run, not saved" in saved
    assert API_KEY not in (run_dir / "run.log").read_text() if (run_dir / "run.log").exists() else True


def test_weight_update_over_a_broadcast_group(servers, model_dir, tmp_path):
    """--weight-sync-transport broadcast: the router pushes versions to every server over one gloo group (no
    disk); the group is rebuilt when the set of servers changes."""
    from relax.backends.inference.remote.broadcast import BroadcastWeightTransport

    a, b, c = servers(3)
    transport = BroadcastWeightTransport("127.0.0.1", "gloo", timeout_s=60)
    router = EngineRouter([SGLangHTTPEngine(s.url, api_key=API_KEY) for s in (a, b)], weight_transport=transport)
    trainer = load_file(str(build_tiny_model_dir(tmp_path / "other", seed=1) / "model.safetensors"))

    def served_equals_trainer(server: Server) -> bool:
        served = dict(server.engine.model.named_parameters())
        return all(torch.equal(served[name].detach().cpu(), tensor) for name, tensor in trainer.items()
                   if name in served)

    async def scenario():
        await router.update_weights(iter(trainer.items()), 3)
        assert router.weight_version == 3 and a.health()["weight_version"] == b.health()["weight_version"] == 3
        assert served_equals_trainer(a) and served_equals_trainer(b)
        await router.update_weights(iter(trainer.items()), 4)  # the same group again
        await router.add_engine(SGLangHTTPEngine(c.url, api_key=API_KEY))
        await router.update_weights(iter(trainer.items()), 5)  # a new group of three servers
        transport.close()

    asyncio.run(scenario())
    assert [s.health()["weight_version"] for s in (a, b, c)] == [5, 5, 5] and served_equals_trainer(c)


def test_train_with_broadcast_weight_sync(servers, tiny_workspace, tmp_path):
    (server,) = servers(1)
    result = run_relax("train", *tiny_train_args(
        tiny_workspace, tmp_path / "run", "--num-rollout", "2", "--rollout-external", "--rollout-external-engine-addrs",
        server.url, "--rollout-engine-api-key", API_KEY, "--weight-sync-transport", "broadcast"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert server.health()["weight_version"] == 2
    assert not (tmp_path / "run" / "engine_weights").exists()


def test_fully_async_with_an_external_engine(servers, tiny_workspace, tmp_path):
    """The fully-async loop with the rollout on a server: the trainer computes on its worker thread
    (relax.core.placement.compute_thread) while the producer generates the next step over HTTP."""
    (server,) = servers(1)
    run_dir = tmp_path / "run"
    result = run_relax("train", *tiny_train_args(
        tiny_workspace, run_dir, "--num-rollout", "3", "--fully-async", "--max-staleness", "1", "--rollout-external",
        "--rollout-external-engine-addrs", server.url, "--rollout-engine-api-key", API_KEY,
        "--weight-sync-transport", "broadcast"), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert server.health()["weight_version"] == 3
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "perf/step_s" in row]
    assert [row["step"] for row in steps] == [1, 2, 3]
    # Every step trained on a full batch; with --max-staleness 1 some step was generated a version ahead.
    assert all(row["data/consumed_groups"] == 4 for row in steps)
    assert max(row["perf/rollout_version_lag"] for row in steps) == 1


def test_abort_and_pause_through_the_router(servers):
    a, b = servers(2)
    router = EngineRouter([SGLangHTTPEngine(s.url, api_key=API_KEY) for s in (a, b)])

    async def scenario():
        await router.pause()
        task = asyncio.ensure_future(router.generate([request("g0-i0-0", [5, 6], 50), request("g1-i1-1", [5, 7], 3)]))
        while a.health()["in_flight_requests"] + b.health()["in_flight_requests"] < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert not task.done(), "paused engines hold their requests"
        await router.abort(["g0-i0-0"])
        await router.resume()
        return await task

    aborted, finished = asyncio.run(scenario())
    assert aborted.finish_reason == "abort" and finished.finish_reason == "length"


@pytest.mark.parametrize(("args", "message"), [
    (["--rollout-external"], "--rollout-external needs --rollout-external-engine-addrs"),
    (["--rollout-external-engine-addrs", "http://127.0.0.1:1"], "--rollout-external-engine-addrs needs --rollout-external"),
    (["--rollout-external", "--rollout-external-engine-addrs", "127.0.0.1:1"], "is not a base URL"),
    (["--rollout-external", "--rollout-external-engine-addrs", "http://a:1", "http://a:1/"], "listed twice"),
    (["--rollout-external", "--rollout-external-engine-addrs", "http://a:1", "--rollout-engine-protocol", "grpc"],
     "--rollout-engine-protocol"),
    (["--weight-sync-transport", "broadcast"], "--weight-sync-transport needs --placement ray or --rollout-external"),
    (["--rollout-external", "--rollout-external-engine-addrs", "http://a:1", "--rollout-engine-protocol", "openai",
      "--weight-sync-transport", "broadcast"], "broadcast needs --rollout-engine-protocol sglang"),
])
def test_external_engine_flags_are_checked(args, message):
    from relax.cli.args import parse_config
    from relax.config import ConfigError

    with pytest.raises((ConfigError, SystemExit, ValueError)) as info:
        parse_config(["--hf-checkpoint", "x", *args])
    if info.type is not SystemExit:
        assert message in str(info.value)


def test_a_fresh_run_sends_its_weights_before_the_first_evaluation(servers, tiny_workspace, tmp_path):
    """The issue-17 fault: a fresh --rollout-external run evaluated and rolled out on whatever the server last held.
    Here the server holds another model at another run's version 7: the run sends its initial weights as version 0
    (which a new run may do), so step 0's greedy evaluation equals an in-process run's, and its updates follow."""
    other = build_tiny_model_dir(tmp_path / "other", seed=7)
    (server,) = servers(1)
    foreign = {name: p.detach().clone() for name, p in EmbeddedEngine.from_pretrained(str(other)).model.named_parameters()}
    asyncio.run(server.engine.update_weights(foreign.items(), 7))
    assert server.health()["weight_version"] == 7
    rows = {}
    for name, extra in (("external", ["--rollout-external", "--rollout-external-engine-addrs", server.url,
                                      "--rollout-engine-api-key", API_KEY,
                                      "--rollout-weights-dir", str(tmp_path / "weights")]),
                        ("in-process", [])):
        run_dir = tmp_path / name
        result = run_relax("train", *tiny_train_args(tiny_workspace, run_dir, "--num-rollout", "1", *extra),
                           timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        rows[name] = read_metrics(run_dir / "metrics.jsonl")
    assert "sent the initial weights (version 0)" in (tmp_path / "external" / "run.log").read_text()
    assert rows["external"][0]["step"] == 0
    assert rows["external"][0]["eval/accuracy"] == rows["in-process"][0]["eval/accuracy"]
    assert server.health()["weight_version"] == 1


def test_a_resumed_run_goes_on_with_servers_that_served_its_later_versions(servers, tiny_workspace, tmp_path):
    """A run resumed from its step-2 checkpoint (as a global restart does) on a server that served its dead
    predecessor's version 6: the server takes version 2 again (a new publisher), the predecessor's later
    versions in the weights directory do not hide it, and the resumed steps log the first run's metrics."""
    (server,) = servers(1)
    run_dir, weights = tmp_path / "run", tmp_path / "weights"
    args = tiny_train_args(tiny_workspace, run_dir, "--num-rollout", "6", "--save-interval", "2",
                           "--skip-eval-before-train", "--rollout-external", "--rollout-external-engine-addrs",
                           server.url, "--rollout-engine-api-key", API_KEY, "--rollout-weights-dir", str(weights))
    first = run_relax("train", *args, timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {row["step"]: row for row in read_metrics(run_dir / "metrics.jsonl")}
    assert server.health()["weight_version"] == 6
    checkpoints = run_dir / "checkpoints"
    for step in (4, 6):  # as if the run had died after its step-2 checkpoint
        import shutil

        shutil.rmtree(checkpoints / f"iter_{step:07d}")
    (checkpoints / "latest_checkpointed_iteration.txt").write_text("2")

    resumed = run_relax("train", *args, "--load", str(checkpoints), timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert server.health()["weight_version"] == 6
    after = {row["step"]: row for row in read_metrics(run_dir / "metrics.jsonl")}
    assert sorted(after) == [1, 2, 3, 4, 5, 6]
    for step in (3, 4, 5, 6):
        for key in ("rollout/reward_mean", "train/loss", "train/grad_norm", "train/ppo_kl"):
            assert after[step][key] == pytest.approx(before[step][key], rel=1e-5, abs=1e-7), (step, key)
