"""Weight sync (DCS) through its three transports, with real processes, gloo groups and files."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import textwrap
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.embedded import EmbeddedEngine
from relax.components.actor import Actor
from relax.distributed.process_group import free_loopback_port
from relax.distributed.weight_broadcast import BroadcastPublisher, BroadcastReceiver, WeightSyncGroup
from relax.distributed.weight_disk import (
    MANIFEST_NAME,
    DiskPublisher,
    DiskReceiver,
    complete_versions,
    publisher_run,
    version_dir,
)
from relax.distributed.weight_sync import (
    InProcessPublisher,
    Manifest,
    WeightSyncError,
    bucketize,
    check_manifest,
    engine_weight_specs,
    sync_weights_in_process,
)
from tests.backends.training.test_fsdp_backend import LOSS, make_backend, make_batch
from tests.support.runs import ROOT

BUCKET_BYTES = 16 * 1024  # the tiny model is ~200 KiB in bf16: about a dozen buckets
TIMEOUT_S = 60.0


def assert_engine_matches(engine_state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Every parameter and buffer of the engine equals the expected tensor, bit for bit."""
    for name, tensor in engine_state.items():
        assert torch.equal(tensor, expected[name].to(tensor.dtype)), name


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: tensor + torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
            for name, tensor in state.items()}


def engine_state(engine: EmbeddedEngine) -> dict[str, torch.Tensor]:
    """A copy of the engine's parameters, each tensor once (the tied lm_head is embed_tokens)."""
    return {name: tensor.detach().clone() for name, tensor in engine.model.named_parameters()}


def as_bytes(state: dict[str, torch.Tensor]) -> bytes:
    """Tensors cross the process boundary as bytes: a shared-memory tensor from a process that has
    exited by the time the queue is read cannot be opened."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def sync_bytes(buckets) -> int:
    return sum(tensor.numel() * tensor.element_size() for bucket in buckets for _, tensor in bucket)


def trained_actor(model_dir: Path, steps: int = 1) -> tuple[Actor, object]:
    backend = make_backend(model_dir)
    for seed in range(steps):
        backend.train_step(make_batch(seed=seed), LOSS)
    return Actor(backend, LOSS, train_batch_size=8), backend


# ----------------------------------------------------------------------------- in-process


def test_in_process_sync_is_bit_identical_and_lands_between_decode_steps(tiny_workspace):
    model_dir = tiny_workspace / "model"
    actor, backend = trained_actor(model_dir)
    engine = EmbeddedEngine.from_pretrained(str(model_dir))
    request = GenerationRequest("r0", [5, 6, 7], SamplingParams(max_new_tokens=12, temperature=0.0, seed=0))

    async def generate_while_syncing():
        generation = asyncio.create_task(engine.generate([request]))
        for _ in range(4):  # let a few decode steps run on version 0
            await asyncio.sleep(0)
        metrics = await InProcessPublisher(engine).publish(actor.weight_buckets(torch.float32, 4096), version=1)
        return metrics, await asyncio.wait_for(generation, TIMEOUT_S)

    metrics, (output,) = asyncio.run(generate_while_syncing())
    assert engine.weight_version == 1
    assert_engine_matches(engine_state(engine), backend.full_state_dict())
    assert metrics.buckets > 1 and metrics.bytes == sync_bytes(actor.weight_buckets(torch.float32, 4096))
    # The update fell between two steps: every token carries one version, and they only go up.
    versions = output.output_weight_versions
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
    assert not asyncio.run(engine.health())["paused"]


def test_sync_weights_in_process_keeps_its_contract(tiny_workspace):
    model_dir = tiny_workspace / "model"
    actor, backend = trained_actor(model_dir)
    engine = EmbeddedEngine.from_pretrained(str(model_dir))
    metrics = asyncio.run(sync_weights_in_process(actor, engine, version=3, dtype=torch.bfloat16, bucket_bytes=4096))
    assert engine.weight_version == 3
    assert_engine_matches(engine_state(engine), {k: v.bfloat16() for k, v in backend.full_state_dict().items()})
    assert metrics["perf/weight_sync_s"] > 0 and metrics["perf/weight_sync_buckets"] > 1


# ----------------------------------------------------------------------------- broadcast


def _receiver_main(rank: int, world_size: int, port: int, model_dir: str, results) -> None:
    """An engine process: a bf16 EmbeddedEngine that takes three versions off the group."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    try:
        engine = EmbeddedEngine.from_pretrained(model_dir, dtype=torch.bfloat16)
        group = WeightSyncGroup.init("127.0.0.1", port, rank, world_size, timeout_s=TIMEOUT_S)
        receiver = BroadcastReceiver(group, engine)

        async def serve():
            first = await receiver.receive()
            results.put((rank, "v1", first.buckets, engine.weight_version, as_bytes(engine_state(engine))))
            try:
                await receiver.receive()
                results.put((rank, "v2", None, engine.weight_version, as_bytes(engine_state(engine))))
            except WeightSyncError as error:  # expected: the manifest names a tensor the model lacks
                results.put((rank, "v2", str(error), engine.weight_version, as_bytes(engine_state(engine))))
            await receiver.receive(expected_version=3)
            request = GenerationRequest("after", [5, 6], SamplingParams(max_new_tokens=2, temperature=0.0))
            (output,) = await asyncio.wait_for(engine.generate([request]), TIMEOUT_S)
            results.put((rank, "v3", output.output_weight_versions, engine.weight_version, as_bytes(engine_state(engine))))

        asyncio.run(serve())
        group.close()
    except BaseException:  # noqa: BLE001 - any failure goes to the parent, which asserts on it
        results.put((rank, "error", traceback.format_exc(), None, None))


def test_broadcast_from_trainer_process_to_two_engine_processes(tiny_workspace, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    model_dir = tiny_workspace / "model"
    port, world_size = free_loopback_port(), 3
    context = mp.get_context("spawn")
    results = context.Queue()
    receivers = [context.Process(target=_receiver_main, args=(rank, world_size, port, str(model_dir), results))
                 for rank in (1, 2)]
    for process in receivers:
        process.start()
    try:
        actor, backend = trained_actor(model_dir)
        group = WeightSyncGroup.init("127.0.0.1", port, 0, world_size, timeout_s=TIMEOUT_S)
        publisher = BroadcastPublisher(group)
        v1 = asyncio.run(publisher.publish(actor.weight_buckets(torch.bfloat16, BUCKET_BYTES), 1, {"step": 1}))
        expected_v1 = {name: tensor.bfloat16() for name, tensor in backend.full_state_dict().items()}
        bogus = [*actor.weight_buckets(torch.bfloat16, BUCKET_BYTES), [("model.not_a_layer.weight", torch.ones(3))]]
        asyncio.run(publisher.publish(bogus, 2))
        backend.train_step(make_batch(seed=5), LOSS)
        asyncio.run(publisher.publish(actor.weight_buckets(torch.bfloat16, BUCKET_BYTES), 3))
        expected_v3 = {name: tensor.bfloat16() for name, tensor in backend.full_state_dict().items()}
        group.close()
        reports = {}
        for _ in range(3 * len(receivers)):
            rank, stage, detail, version, state = results.get(timeout=TIMEOUT_S)
            state = torch.load(io.BytesIO(state), weights_only=True) if state is not None else None
            assert stage != "error", f"receiver {rank} failed:\n{detail}"
            reports[rank, stage] = (detail, version, state)
    finally:
        for process in receivers:
            process.join(timeout=TIMEOUT_S)
            if process.is_alive():
                process.kill()
    assert v1.buckets > 1 and v1.bytes == sync_bytes(actor.weight_buckets(torch.bfloat16, BUCKET_BYTES))
    for rank in (1, 2):
        buckets, version, state = reports[rank, "v1"]
        assert (buckets, version) == (v1.buckets, 1)
        assert_engine_matches(state, expected_v1)
        error, version, state = reports[rank, "v2"]
        assert "version 2" in error and "model.not_a_layer.weight" in error, error
        assert version == 1  # still serving the previous version, with its weights
        assert_engine_matches(state, expected_v1)
        token_versions, version, state = reports[rank, "v3"]
        assert version == 3 and token_versions == [3, 3]
        assert_engine_matches(state, expected_v3)
    assert all(process.exitcode == 0 for process in receivers)


# ----------------------------------------------------------------------------- disk

CRASHING_PUBLISHER = textwrap.dedent("""
    import asyncio, os, sys
    import torch
    from safetensors.torch import load_file
    from relax.distributed.weight_disk import DiskPublisher
    from relax.distributed.weight_sync import bucketize

    state = {name: tensor + 1 for name, tensor in load_file(sys.argv[1]).items()}
    def buckets_then_crash():
        for index, bucket in enumerate(bucketize(state.items(), 16 * 1024)):
            if index == 2:
                os._exit(17)  # the trainer dies between buckets: no cleanup, no manifest
            yield bucket
    asyncio.run(DiskPublisher(sys.argv[2]).publish(buckets_then_crash(), int(sys.argv[3])))
""")


def test_disk_sync_ignores_a_version_whose_publisher_crashed_between_buckets(tiny_workspace, tmp_path):
    model_dir = tiny_workspace / "model"
    engine = EmbeddedEngine.from_pretrained(str(model_dir))
    sync_dir = tmp_path / "sync"
    publisher, receiver = DiskPublisher(sync_dir, keep_last=2), DiskReceiver(sync_dir, engine)
    v1 = perturbed(engine_state(engine), seed=1)
    asyncio.run(publisher.publish(bucketize(v1.items(), BUCKET_BYTES, torch.bfloat16), 1, {"step": 1}))
    metrics = asyncio.run(receiver.poll(timeout_s=TIMEOUT_S))
    assert (metrics.version, engine.weight_version) == (1, 1) and metrics.buckets > 1
    assert_engine_matches(engine_state(engine), {k: v.bfloat16() for k, v in v1.items()})

    crashed = subprocess.run(
        [sys.executable, "-c", CRASHING_PUBLISHER, str(model_dir / "model.safetensors"), str(sync_dir), "2"],
        check=False, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, capture_output=True,
        text=True, timeout=TIMEOUT_S,
    )
    assert crashed.returncode == 17, crashed.stderr
    partial = version_dir(sync_dir, 2)
    assert len(list(partial.glob("bucket_*.safetensors"))) == 2 and not (partial / MANIFEST_NAME).exists()
    assert receiver.latest_version() == 1
    with pytest.raises(TimeoutError, match="newer than 1"):
        asyncio.run(receiver.poll(timeout_s=0.2))
    assert engine.weight_version == 1

    for version in (3, 4):
        state = perturbed(v1, seed=version)
        asyncio.run(publisher.publish(bucketize(state.items(), BUCKET_BYTES), version))
    asyncio.run(receiver.poll(timeout_s=TIMEOUT_S))
    assert engine.weight_version == 4
    assert_engine_matches(engine_state(engine), state)
    # The crashed v2 and the oldest complete version are collected; the last two are kept.
    assert complete_versions(sync_dir) == [3, 4] and not partial.exists()


def test_disk_manifest_mismatch_leaves_the_engine_on_its_previous_version(tiny_workspace, tmp_path):
    engine = EmbeddedEngine.from_pretrained(str(tiny_workspace / "model"))
    sync_dir = tmp_path / "sync"
    publisher, receiver = DiskPublisher(sync_dir, keep_last=5, fsync=False), DiskReceiver(sync_dir, engine)
    asyncio.run(publisher.publish(bucketize(perturbed(engine_state(engine), 1).items(), BUCKET_BYTES), 1))
    asyncio.run(receiver.apply(1))
    before = engine_state(engine)

    def publish_and_edit_manifest(version: int, edit) -> None:
        asyncio.run(publisher.publish(bucketize(perturbed(before, version).items(), BUCKET_BYTES), version))
        path = version_dir(sync_dir, version) / MANIFEST_NAME
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))

    def claim_other_version(manifest):
        manifest["version"] = 99
        return manifest

    def move_a_tensor_to_the_last_bucket(manifest):  # the last bucket file lacks it
        manifest["buckets"][-1].append(manifest["buckets"][0].pop(0))
        return manifest

    def shrink_a_tensor(manifest):
        name, shape, dtype = manifest["buckets"][0][0]
        manifest["buckets"][0][0] = [name, [shape[0] - 1, *shape[1:]], dtype]
        return manifest

    publish_and_edit_manifest(2, claim_other_version)
    with pytest.raises(WeightSyncError, match="manifest says version 99, the receiver expected version 2"):
        asyncio.run(receiver.poll(timeout_s=TIMEOUT_S))
    publish_and_edit_manifest(3, move_a_tensor_to_the_last_bucket)
    with pytest.raises(WeightSyncError, match="version 3: tensor 'model.embed_tokens.weight' is missing from .*bucket_"):
        asyncio.run(receiver.apply(3))
    publish_and_edit_manifest(4, shrink_a_tensor)
    with pytest.raises(WeightSyncError, match="version 4: tensor 'model.embed_tokens.weight' has shape"):
        asyncio.run(receiver.apply(4))
    assert engine.weight_version == 1
    assert_engine_matches(engine_state(engine), before)
    assert not asyncio.run(engine.health())["paused"]


def test_a_following_engine_skips_a_damaged_version_once_and_takes_the_next(tiny_workspace, tmp_path, caplog):
    """`DiskFollower` (the engines following the published versions): a version that cannot be loaded leaves the
    engine on its version, is reported once (not on every poll), and the next good version is applied."""
    from relax.distributed.weight_disk import DiskFollower

    engine = EmbeddedEngine.from_pretrained(str(tiny_workspace / "model"))
    sync_dir = tmp_path / "sync"
    publisher = DiskPublisher(sync_dir, keep_last=5, fsync=False)
    state = engine_state(engine)

    async def scenario() -> None:
        follower = DiskFollower(sync_dir, engine, asyncio.Lock())
        await publisher.publish(bucketize(perturbed(state, 1).items(), BUCKET_BYTES), 1)
        path = version_dir(sync_dir, 1) / MANIFEST_NAME
        manifest = json.loads(path.read_text())
        manifest["version"] = 99
        path.write_text(json.dumps(manifest))
        for _ in range(3):
            await follower.catch_up()
        assert engine.weight_version == 0 and follower.pop_metrics() == {}
        await publisher.publish(bucketize(perturbed(state, 2).items(), BUCKET_BYTES), 2)
        await follower.catch_up()
        assert engine.weight_version == 2 and follower.pop_metrics()["perf/weight_pull_versions"] == 1.0

    with caplog.at_level("WARNING", logger="relax"):
        asyncio.run(scenario())
    assert_engine_matches(engine_state(engine), perturbed(state, 2))
    assert sum("weight version 1 could not be loaded" in r.getMessage() for r in caplog.records) == 1


def test_check_manifest_names_the_tensor_and_version(tiny_workspace):
    engine = EmbeddedEngine.from_pretrained(str(tiny_workspace / "model"))
    shapes = engine_weight_specs(engine)
    good = Manifest.from_buckets(7, list(bucketize(engine_state(engine).items(), BUCKET_BYTES)))
    check_manifest(good, 7, shapes)
    twice = Manifest(7, good.buckets + (good.buckets[0],))
    with pytest.raises(WeightSyncError, match="version 7: tensor '.*' appears twice") as caught:
        check_manifest(twice, 7, shapes)
    assert caught.value.version == 7 and caught.value.tensor == good.buckets[0][0].name
    assert Manifest.from_json(good.to_json()) == good
    with pytest.raises(WeightSyncError, match="unreadable weight-sync manifest"):
        Manifest.from_json('{"version": 1}')


def test_a_resumed_run_publishes_an_older_version_that_engines_take_and_its_own_order_still_holds(
        tiny_workspace, tmp_path, monkeypatch):
    """A run restarted from its checkpoint of step 2 (its dead predecessor published up to 5) re-publishes 2: the
    predecessor's later versions are removed (they would hide it and the garbage collection would take it), an
    engine serving 5 takes 2 (another publisher: a new run), and within that run an older version is still
    refused."""
    from relax.distributed import weight_disk
    from relax.serving.weights import WeightPathError, update_weights_from_path

    model_dir = tiny_workspace / "model"
    engine = EmbeddedEngine.from_pretrained(str(model_dir))
    sync_dir = tmp_path / "sync"
    base = engine_state(engine)
    states = {version: perturbed(base, seed=version) for version in range(1, 6)}
    publisher = DiskPublisher(sync_dir, keep_last=2)
    for version in range(1, 6):
        asyncio.run(publisher.publish(bucketize(states[version].items(), BUCKET_BYTES), version))
    asyncio.run(update_weights_from_path(engine, str(sync_dir), None))
    assert engine.weight_version == 5

    monkeypatch.setattr(weight_disk, "_publisher_runs", {os.getpid(): "the-restarted-run"})
    resumed = perturbed(base, seed=22)
    asyncio.run(publisher.publish(bucketize(resumed.items(), BUCKET_BYTES), 2))
    assert complete_versions(sync_dir) == [2]  # 3-5 were the dead run's
    assert asyncio.run(update_weights_from_path(engine, str(sync_dir), None)) == 2
    assert engine.weight_version == 2 and engine.weight_run == "the-restarted-run"
    assert_engine_matches(engine_state(engine), resumed)

    asyncio.run(publisher.publish(bucketize(states[3].items(), BUCKET_BYTES), 3))
    asyncio.run(update_weights_from_path(engine, str(sync_dir), 3))
    monkeypatch.setattr(weight_disk, "_publisher_runs", {os.getpid(): "the-restarted-run"})  # the same run goes back: refused
    assert complete_versions(sync_dir) == [2, 3]
    with pytest.raises(WeightPathError, match="older than the served version 3"):
        asyncio.run(update_weights_from_path(engine, str(sync_dir), 2))
    assert engine.weight_version == 3


def _publisher_run_in_child(queue) -> None:
    queue.put(publisher_run())


def test_a_process_forked_after_the_import_is_a_publisher_of_its_own():
    """A run forked from a process that imported the module (a supervisor's restarted child, the test suite's
    forkserver) publishes under its own id: engines that served the parent's later versions take its older ones."""
    mine = publisher_run()
    context = mp.get_context("fork")
    queue = context.Queue()
    children = [context.Process(target=_publisher_run_in_child, args=(queue,)) for _ in range(2)]
    for child in children:
        child.start()
    theirs = [queue.get(timeout=60) for _ in children]
    for child in children:
        child.join(60)
    assert publisher_run() == mine and len({mine, *theirs}) == 3


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_rendezvous_store_listens_on_its_host_alone(world_size):
    """torch's TCPStore binds every interface; a weight-sync group's store (`tcp_store`) listens on the host it is
    given, and its clients still reach it."""
    import psutil

    from relax.distributed.process_group import free_loopback_port, tcp_store

    port = free_loopback_port()
    master = tcp_store("127.0.0.1", port, world_size, is_master=True, timeout=timedelta(seconds=30))
    clients = [tcp_store("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=30))
               for _ in range(world_size - 1)]
    for rank, client in enumerate(clients, start=1):
        client.set(f"rank{rank}", str(rank))
    assert [master.get(f"rank{rank}") for rank in range(1, world_size)] == [str(r).encode() for r in
                                                                           range(1, world_size)]
    listening = {c.laddr.ip for c in psutil.net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert listening == {"127.0.0.1"}, listening
