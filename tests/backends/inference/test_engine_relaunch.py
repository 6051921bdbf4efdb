"""Engines this run starts (`relax serve` processes, ``--rollout-engine-protocol relax``) relaunched when they die or
hang (``--use-fault-tolerance``, issue 17): real processes on 127.0.0.1, real SIGKILL and SIGSTOP.

The contract: the failed engine's request groups finish on another engine (whole groups), the engine is killed
and started again, and before it gets work it loads the weight version the others serve; with no other engine a
call waits for the relaunch; after the last allowed relaunch the engine stays down and a call fails within the
router's bound naming it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.embedded import EmbeddedEngine
from relax.backends.inference.remote.launched_relax import RelaxServerEngine, RelaxServerSettings
from relax.backends.inference.router import EngineRouter, NoEngineAvailableError
from relax.distributed.process_group import free_port
from tests.support.runs import ROOT
from tests.support.waits import PROCESS_PATIENCE_S, wait_until_async


@pytest.fixture(autouse=True)
def importable_relax(monkeypatch):
    """The servers are `python -m relax.cli.main serve` processes: they import this checkout."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def launched(model_dir: Path, tmp_path: Path, count: int,
             settings: RelaxServerSettings | None = None) -> list[RelaxServerEngine]:
    return [RelaxServerEngine(model_dir, tmp_path / "weights", port=free_port(), log_dir=tmp_path / "logs",
                              settings=settings, timeout_s=120) for _ in range(count)]


def request(rid: str, prompt: list[int], n: int) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))


def group_requests(n_tokens: int, groups: int = 4, first: int = 0) -> list[GenerationRequest]:
    """Two samples per prompt group; ``first`` numbers the groups (the router keeps a group on its engine)."""
    return [request(f"g{first + g}-i{g * 2 + k}-{g * 2 + k}", [5 + g, 6, 7], n_tokens)
            for g in range(groups) for k in range(2)]


def perturbed_weights(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """Weights other than the base model's, so a server that serves the base model is told apart."""
    generator = torch.Generator().manual_seed(0)
    tensors = [item for path in sorted(model_dir.glob("*.safetensors")) for item in load_file(path).items()]
    return [(name, tensor + 0.5 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))
            for name, tensor in tensors]


def server_state(engine: RelaxServerEngine) -> dict:
    return httpx.get(f"{engine.base_url}/health", timeout=5).json()


async def in_flight(engine: RelaxServerEngine) -> bool:
    try:
        return (await asyncio.to_thread(server_state, engine))["in_flight_requests"] > 0
    except (httpx.TransportError, ValueError):
        return False


def run_scenario(router: EngineRouter, engines: list[RelaxServerEngine], scenario) -> None:
    """``await scenario()``, then close the router, and kill every server whatever happened."""
    async def guarded() -> None:
        try:
            await scenario()
        finally:
            await router.aclose()

    try:
        asyncio.run(guarded())
    finally:
        for engine in engines:
            engine.server.kill()


def slot_stats(router: EngineRouter, engine: RelaxServerEngine) -> dict:
    return next(s for s in router.stats() if s["engine"] == engine.base_url)


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSTOP"])
def test_a_dead_or_stopped_engine_is_relaunched_at_the_current_weights(signal_name, tiny_workspace, tmp_path):
    model_dir = tiny_workspace / "model"
    victim, survivor = engines = launched(model_dir, tmp_path, 2)
    router = EngineRouter(engines, retry_down_after_s=0.5, relaunch_limit=2, health_check_interval_s=0.5,
                          health_check_timeout_s=3.0, health_check_max_failures=2)

    async def scenario() -> None:
        await router.update_weights(perturbed_weights(model_dir), 1)
        before = [o.output_ids for o in await survivor.generate(group_requests(8))]
        old_pid = server_state(victim)["pid"]

        call = asyncio.ensure_future(router.generate(group_requests(150)))
        await wait_until_async(lambda: in_flight(victim), PROCESS_PATIENCE_S, "requests to reach the victim")
        os.kill(old_pid, getattr(signal, signal_name))
        outputs = await asyncio.wait_for(call, PROCESS_PATIENCE_S)
        assert all(o.finish_reason == "length" and len(o.output_ids) == 150 for o in outputs), "no request lost"
        assert all(o.weight_version == 1 for o in outputs)

        await wait_until_async(lambda: slot_stats(router, victim)["relaunches"] >= 1
                               and not slot_stats(router, victim)["relaunching"], PROCESS_PATIENCE_S,
                               "the relaunch to end", interval_s=0.05)
        stats = slot_stats(router, victim)
        assert stats["healthy"], stats
        state = server_state(victim)
        assert state["pid"] != old_pid and state["weight_version"] == 1, state  # a new process, current weights
        # It serves version 1 (not the base model it started on): the survivor's tokens for the same prompts.
        again = [o.output_ids for o in await router.generate(group_requests(8, first=10))]
        assert again == before
        base = EmbeddedEngine.from_pretrained(str(model_dir))
        assert [o.output_ids for o in await base.generate(group_requests(8))] != before  # the check can fail
        assert slot_stats(router, victim)["served"] > 0, "the relaunched engine is routed to again"

    run_scenario(router, engines, scenario)
    log = (tmp_path / "logs" / f"relax_serve_{victim.server.port}.log").read_text()
    assert log.count("==== ") >= 2, "started, then relaunched"


def test_the_only_engine_is_waited_for_while_it_relaunches(tiny_workspace, tmp_path):
    """With no other engine a call does not fail after the router's wait: it waits for the relaunch (bounded by
    the start-up timeout) and gets its answers from the new process, at the current weights."""
    model_dir = tiny_workspace / "model"
    (only,) = launched(model_dir, tmp_path, 1)
    router = EngineRouter([only], retry_down_after_s=0.2, wait_for_engine_s=0.5, relaunch_limit=1)

    async def scenario() -> None:
        await router.update_weights(perturbed_weights(model_dir), 1)
        before = [o.output_ids for o in await router.generate(group_requests(6))]
        os.kill(server_state(only)["pid"], signal.SIGKILL)
        started = time.monotonic()
        outputs = await asyncio.wait_for(router.generate(group_requests(6)), PROCESS_PATIENCE_S)
        assert [o.output_ids for o in outputs] == before and all(o.weight_version == 1 for o in outputs)
        assert time.monotonic() - started > router.wait_for_engine_s  # it waited out the relaunch
        assert slot_stats(router, only)["relaunches"] == 1

    run_scenario(router, [only], scenario)


def test_an_engine_that_cannot_come_back_stays_down_and_the_call_fails_naming_it(tiny_workspace, tmp_path):
    """The bound when recovery is impossible: the relaunched process exits at once (its model folder is gone), so
    after ``relaunch_limit`` relaunches the engine stays down and the call ends with `NoEngineAvailableError`
    naming the engine and the server's own error, within the router's wait: not after the start-up timeout, which
    is set past the test's own wait, so waiting it out would fail the test with a timeout, not this error."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_workspace / "model", model_dir)
    (only,) = launched(model_dir, tmp_path, 1, RelaxServerSettings(startup_timeout_s=2 * PROCESS_PATIENCE_S))
    router = EngineRouter([only], retry_down_after_s=0.2, wait_for_engine_s=2.0, relaunch_limit=1, max_retries=2)

    async def scenario() -> None:
        await router.generate(group_requests(4))
        shutil.rmtree(model_dir)
        os.kill(server_state(only)["pid"], signal.SIGKILL)
        with pytest.raises(NoEngineAvailableError) as failure:
            await asyncio.wait_for(router.generate(group_requests(4)), PROCESS_PATIENCE_S)
        message = str(failure.value)
        assert only.base_url in message and f"{model_dir}: no such folder" in message, message
        assert slot_stats(router, only)["relaunches"] == 1

    run_scenario(router, [only], scenario)


@pytest.mark.parametrize(("args", "message"), [
    (["--rollout-external", "--rollout-external-engine-addrs", "http://10.0.0.5:1", "--use-fault-tolerance"],
     "--rollout-engine-protocol relax or vllm"),
    (["--rollout-engine-max-relaunches", "2"], "--rollout-engine-max-relaunches needs --use-fault-tolerance"),
    (["--rollout-external", "--rollout-engine-protocol", "relax", "--rollout-external-engine-addrs",
      "http://10.0.0.5:30000"], "must be http://127.0.0.1:PORT"),
    (["--rollout-external", "--rollout-engine-protocol", "relax", "--rollout-external-engine-addrs",
      "http://127.0.0.1:99999"], "must be http://127.0.0.1:PORT"),
    (["--rollout-external", "--rollout-engine-protocol", "relax", "--rollout-external-engine-addrs",
      "http://127.0.0.1:3000/v1"], "must be http://127.0.0.1:PORT"),
    (["--rollout-external", "--rollout-engine-protocol", "relax", "--rollout-external-engine-addrs",
      "http://127.0.0.1:3000", "--use-fault-tolerance", "--weight-sync-transport", "broadcast"],
     "--use-fault-tolerance needs --weight-sync-transport disk"),
    (["--rollout-external", "--rollout-engine-protocol", "relax", "--rollout-external-engine-addrs",
      "http://127.0.0.1:3000", "--use-fault-tolerance", "--rollout-engine-max-relaunches", "0"],
     "--rollout-engine-max-relaunches: Input should be greater than or equal to 1"),
])
def test_fault_tolerance_flags_are_checked(args, message):
    from relax.cli.args import parse_config
    from relax.config import ConfigError

    with pytest.raises((ConfigError, ValueError)) as info:
        parse_config(["--hf-checkpoint", "x", *args])
    assert message in str(info.value)


def test_launched_engine_flags_are_accepted():
    from relax.cli.args import parse_config

    cfg = parse_config(["--hf-checkpoint", "x", "--rollout-external", "--rollout-engine-protocol", "relax",
                        "--rollout-external-engine-addrs", "http://127.0.0.1:30000", "http://127.0.0.1:30001/",
                        "--use-fault-tolerance", "--rollout-engine-max-relaunches", "5"])
    assert cfg.use_fault_tolerance and cfg.rollout_engine_max_relaunches == 5
    cfg = parse_config(["--hf-checkpoint", "x", "--use-fault-tolerance"])  # the embedded engine recovers in place
    assert cfg.use_fault_tolerance and not cfg.rollout_external


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_run_relaunches_the_engines_it_started(tiny_workspace, tmp_path):
    """On the GPU: the trainer and two `relax serve` engines share the device; one engine SIGKILLed, the other
    SIGSTOPped, each relaunched on CUDA at the current weights, and the run trains every step."""
    import sys

    from benchmarks.chaos_cpu import Fault, run_with_faults
    from relax.telemetry.metrics_file import read_metrics
    from tests.support.runs import tiny_train_args

    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    run_dir = tmp_path / "run"
    argv = tiny_train_args(tiny_workspace, run_dir, "--num-rollout", "44", "--skip-eval-before-train",
                           "--no-use-tensorboard", "--dump-samples", "0", "--rollout-external",
                           "--rollout-engine-protocol", "relax", "--rollout-external-engine-addrs", *urls,
                           "--use-fault-tolerance", "--rollout-health-check-interval", "0.5",
                           "--rollout-health-check-timeout", "2", "--mem-fraction-static", "0.05")
    argv[argv.index("--custom-rm-path") + 1] = "tests.support.e2e_rewards:digit_fraction_serial"
    faults = [Fault(urls[0], "SIGKILL", 2), Fault(urls[1], "SIGSTOP", 12)]
    report = run_with_faults([sys.executable, "-m", "relax.cli.main", "train", *argv], run_dir, faults,
                             timeout_s=500, env={"PYTHONPATH": os.environ["PYTHONPATH"]})
    assert report.returncode == 0, report.stderr_tail
    assert all(fault.recovered for fault in faults), faults
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, 45))
    log = (run_dir / "run.log").read_text()
    assert "device cuda" in log and all(f"engine {url} relaunched" in log for url in urls)
    print("faults:", [(f.target, f.signal, f.detection_s, f.recovery_s) for f in faults])
    for url in urls:
        port = url.rsplit(":", 1)[1]
        assert (run_dir / "engines" / f"relax_serve_{port}.log").read_text().count("==== ") == 2
