"""The rollout -> training data plane: both implementations, real asyncio, real Ray + TransferQueue."""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import uuid
from collections import Counter

import pytest

from relax.data.sample import Sample, SampleStatus
from relax.data_plane import DataPlane, InProcessDataPlane, StalenessGate

# Ray clusters of tests on one xdist worker, one after the other (scripts/test.sh runs three workers).
pytestmark = pytest.mark.xdist_group("ray")

HAS_TQ = importlib.util.find_spec("transfer_queue") is not None and importlib.util.find_spec("ray") is not None
needs_tq = pytest.mark.skipif(not HAS_TQ, reason="TransferQueue + Ray not installed (pip install -e '.[ray]')")
WAIT_S = 20.0  # bound on every wait; generous for a loaded 2-core machine


def make_group(group_index: int, size: int = 4, version: int | list[int] | None = 0,
               status: SampleStatus = SampleStatus.COMPLETED) -> list[Sample]:
    return [Sample(index=group_index * 100 + i, group_index=group_index, tokens=[1, 2, 3, 10 + i], response_length=2,
                   loss_mask=[1, 1], rollout_log_probs=[-0.5, -0.25], reward=float(i), status=status,
                   weight_version=version) for i in range(size)]


def groups_of(batch: list[Sample]) -> Counter:
    return Counter(sample.group_index for sample in batch)


async def collect(plane: DataPlane, step: int, batch_size: int, **kwargs) -> list[list[Sample]]:
    async def run() -> list[list[Sample]]:
        return [batch async for batch in plane.stream(step, batch_size, **kwargs)]
    return await asyncio.wait_for(run(), WAIT_S)


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def transfer_queue_runtime():
    if not HAS_TQ:
        pytest.skip("TransferQueue + Ray not installed")
    from relax.data_plane.tq_plane import start_local_transfer_queue, stop_local_transfer_queue

    start_local_transfer_queue(num_storage_units=2, num_cpus=4)  # two units: a put is split across them
    yield
    stop_local_transfer_queue()


def make_plane(kind: str, gate: StalenessGate | None, request) -> DataPlane:
    if kind == "in_process":
        return InProcessDataPlane(gate)
    request.getfixturevalue("transfer_queue_runtime")
    from relax.data_plane.tq_plane import TransferQueueDataPlane

    # A task name per test keeps TransferQueue's consumption status of one test out of the next.
    return TransferQueueDataPlane(gate, task_name=f"train_{uuid.uuid4().hex[:8]}", poll_interval_s=0.02)


@pytest.fixture(params=["in_process", pytest.param("transfer_queue", marks=needs_tq)])
def plane_factory(request):
    """Builds planes of one implementation; clears every partition they left behind."""
    planes: list[DataPlane] = []

    def build(gate: StalenessGate | None = None) -> DataPlane:
        planes.append(make_plane(request.param, gate, request))
        return planes[-1]

    yield build

    async def cleanup() -> None:
        for plane in planes:
            for step in plane.pending_steps():
                await plane.clear(step)
    asyncio.run(cleanup())


# ---- streaming --------------------------------------------------------------------------------
def test_stream_starts_before_the_partition_is_complete(plane_factory):
    plane = plane_factory()

    async def scenario() -> None:
        await plane.put(0, make_group(0) + make_group(1))
        stream = plane.stream(0, batch_size=8)
        first = await asyncio.wait_for(anext(stream), WAIT_S)  # nothing marked complete yet
        assert groups_of(first) == {0: 4, 1: 4}
        await plane.put(0, make_group(2))
        await plane.mark_complete(0)
        rest = await asyncio.wait_for(anext(stream), WAIT_S)
        assert groups_of(rest) == {2: 4}  # the short tail is flushed at the end
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(stream), WAIT_S)

    asyncio.run(scenario())


def test_groups_are_never_split_across_batches(plane_factory):
    plane = plane_factory()
    sizes = {0: 3, 1: 5, 2: 2, 3: 4, 4: 1, 5: 6, 6: 3}

    async def scenario() -> list[list[Sample]]:
        writes = [[0, 1], [2], [3, 4, 5], [6]]
        for group_indexes in writes:
            await plane.put(0, [s for g in group_indexes for s in make_group(g, sizes[g])])
        await plane.mark_complete(0)
        return await collect(plane, 0, batch_size=6)

    batches = asyncio.run(scenario())
    seen = Counter()
    for batch in batches:
        for group_index, count in groups_of(batch).items():
            assert count == sizes[group_index], f"group {group_index} split: {count} of {sizes[group_index]}"
            seen[group_index] += 1
        assert len(batch) >= 6 or batch is batches[-1]
    assert seen == Counter(dict.fromkeys(sizes, 1))


@pytest.mark.parametrize("seed", range(4))
def test_all_ready_hands_over_every_group_that_landed_while_the_reader_worked(plane_factory, seed):
    """``all_ready`` (the trainer's chunked reading): each batch is every group ready when it is handed over, at
    least ``batch_size`` samples (only the tail less); groups arrive whole, in order, each once, for any arrival
    schedule and any reader speed."""
    import random

    rng = random.Random(seed)
    plane = plane_factory()
    num_groups, batch_size = 12, 8
    arrivals = [rng.randint(1, 3) for _ in range(num_groups)]  # groups per put, clipped below
    landed: list[int] = []  # groups written so far, for the reader's check

    async def produce() -> None:
        group = 0
        while group < num_groups:
            chunk = list(range(group, min(group + arrivals[group], num_groups)))
            await plane.put(0, [s for g in chunk for s in make_group(g)])
            landed.extend(chunk)
            group = chunk[-1] + 1
            await asyncio.sleep(rng.choice([0.0, 0.002, 0.01]))
        await plane.mark_complete(0)

    async def consume() -> list[list[Sample]]:
        batches = []
        async for batch in plane.stream(0, batch_size, all_ready=True):
            handed = sorted(groups_of(batch))
            read_so_far = [g for b in batches for g in groups_of(b)]
            if isinstance(plane, InProcessDataPlane):  # (TransferQueue's reader polls: it sees a put a poll later)
                # every group written and not yet read is in this batch: nothing ready is left behind
                assert set(landed) - set(read_so_far) <= set(handed), (landed, read_so_far, handed)
            batches.append(batch)
            await asyncio.sleep(rng.choice([0.0, 0.005, 0.02]))  # the reader trains on it
        return batches

    async def scenario() -> list[list[Sample]]:
        consumer = asyncio.create_task(consume())
        await asyncio.wait_for(produce(), WAIT_S)
        return await asyncio.wait_for(consumer, WAIT_S)

    batches = asyncio.run(scenario())
    read = [g for batch in batches for g in sorted(groups_of(batch))]
    assert sorted(read) == list(range(num_groups))  # each group once
    assert all(count == 4 for batch in batches for count in groups_of(batch).values())  # never split
    assert all(len(batch) >= batch_size for batch in batches[:-1])


def test_all_ready_takes_a_step_already_in_as_one_batch(plane_factory):
    plane = plane_factory()

    async def scenario() -> list[list[Sample]]:
        await plane.put(0, [s for g in range(6) for s in make_group(g)])
        await plane.mark_complete(0)
        return await collect(plane, 0, batch_size=8, all_ready=True)

    batches = asyncio.run(scenario())
    assert [sorted(groups_of(batch)) for batch in batches] == [list(range(6))]  # one batch, not three of 8


def test_exactly_once_under_concurrent_producer_and_consumer(plane_factory):
    plane = plane_factory()
    num_groups = 24

    async def produce() -> None:
        group = 0
        while group < num_groups:
            chunk = list(range(group, min(group + 1 + group % 3, num_groups)))
            samples = [s for g in chunk for s in make_group(g, status=SampleStatus.FAILED if g == 5 else
                                                            SampleStatus.COMPLETED)]
            await plane.put(0, samples)
            group = chunk[-1] + 1
            await asyncio.sleep(0.005)
        await plane.drop(0, make_group(1000), reason="filtered")
        await plane.mark_complete(0)

    async def scenario() -> list[list[Sample]]:
        consumer = asyncio.create_task(collect(plane, 0, batch_size=8))
        await asyncio.wait_for(produce(), WAIT_S)
        return await consumer

    batches = asyncio.run(scenario())
    read = Counter((s.group_index, s.index) for batch in batches for s in batch)
    expected = {(g, g * 100 + i) for g in range(num_groups) if g != 5 for i in range(4)}
    assert set(read) == expected and set(read.values()) == {1}
    counts = plane.accounting()[0]
    assert counts["produced"] == num_groups + 1
    assert counts["consumed"] == num_groups - 1
    assert counts["dropped"] == {"filtered": 1, "failed": 1, "stale": 0}
    assert counts["outstanding"] == 0


def test_a_group_split_over_two_puts_is_refused():
    plane = InProcessDataPlane()
    group = make_group(0)
    asyncio.run(plane.put(0, group[:2]))
    with pytest.raises(ValueError, match="one put"):
        asyncio.run(plane.put(0, group[2:]))


# ---- streaming roles ---------------------------------------------------------------------------
async def run_role(plane: DataPlane, step: int, name: str, needs: tuple[str, ...], gives: str, compute) -> list[int]:
    """A streaming role: reads the groups of ``step`` as they become ready and writes field ``gives`` back."""
    seen = []
    async for groups in plane.stage_stream(step, name, needs, (gives,)):
        seen.extend(g[0].group_index for g in groups)
        samples = [s for g in groups for s in g]
        await asyncio.sleep(0.003 * (len(seen) % 3))  # roles of uneven speed
        await plane.write_fields(step, groups, {gives: [compute(s) for s in samples]})
    return seen


@pytest.mark.parametrize("seed", [0, 1])
def test_streaming_roles_see_every_group_once_and_the_trainer_gets_their_fields(plane_factory, seed):
    """Two chained roles (the second needs the first's field) read beside the trainer, which needs both: every
    role sees every group exactly once, the trainer reads each group once with the fields that belong to its own
    samples, and only the trainer accounts."""
    import random

    import torch

    rng = random.Random(seed)
    plane = plane_factory()
    num_groups = 14
    sizes = {g: rng.randint(1, 5) for g in range(num_groups)}

    def first(s: Sample) -> torch.Tensor:
        return torch.full((s.response_length,), float(s.index))

    def second(s: Sample) -> torch.Tensor:
        return s.stage_fields["a"] * 2 + 1

    async def produce() -> None:
        group = 0
        while group < num_groups:
            chunk = list(range(group, min(group + rng.randint(1, 3), num_groups)))
            await plane.put(0, [s for g in chunk for s in make_group(g, sizes[g])])
            group = chunk[-1] + 1
            await asyncio.sleep(rng.random() * 0.01)
        await plane.mark_complete(0)

    async def scenario():
        roles = [asyncio.create_task(run_role(plane, 0, "a_role", (), "a", first)),
                 asyncio.create_task(run_role(plane, 0, "b_role", ("a",), "b", second))]
        trainer = asyncio.create_task(collect(plane, 0, batch_size=6, needs=("a", "b")))
        await asyncio.wait_for(produce(), WAIT_S)
        return await trainer, [await asyncio.wait_for(r, WAIT_S) for r in roles]

    batches, (seen_a, seen_b) = asyncio.run(scenario())
    assert sorted(seen_a) == sorted(seen_b) == list(range(num_groups))
    read = [s for batch in batches for s in batch]
    assert Counter(s.group_index for s in read) == Counter(sizes)
    for s in read:
        assert torch.equal(s.stage_fields["a"], torch.full((2,), float(s.index)))
        assert torch.equal(s.stage_fields["b"], torch.full((2,), 2.0 * s.index + 1))
    for batch in batches:  # whole groups per batch
        assert all(count == sizes[g] for g, count in groups_of(batch).items())
    counts = plane.accounting()[0]
    assert counts["consumed"] == num_groups and counts["outstanding"] == 0


def test_groups_a_role_has_not_reached_are_carried_not_lost(plane_factory):
    """The trainer's partition is cleared while a role has not processed some groups: they go to the carry-over
    buffer without the role's field, and the next stream serves them."""
    plane = plane_factory()

    async def scenario():
        await plane.put(0, make_group(0) + make_group(1))
        await plane.mark_complete(0)
        await plane.clear(0)  # no role ran, the trainer read nothing
        assert plane.carried_groups() == 2
        await plane.mark_complete(1)
        batches = await collect(plane, 1, batch_size=8, needs=("a",))
        assert groups_of(batches[0]) == {0: 4, 1: 4}
        assert all("a" not in s.stage_fields for s in batches[0])  # the trainer computes what is missing

    asyncio.run(scenario())


def test_write_fields_refuses_a_wrong_count_and_a_role_named_like_the_trainer():
    import torch

    plane = InProcessDataPlane()

    async def scenario():
        await plane.put(0, make_group(0))
        stream = plane.stage_stream(0, "a_role", (), ("a",))
        groups = await anext(stream)
        with pytest.raises(ValueError, match="field 'a': 3 values for 4 samples"):
            await plane.write_fields(0, groups, {"a": [torch.zeros(2)] * 3})
        with pytest.raises(ValueError, match="name of its own"):
            await anext(plane.stage_stream(0, "train"))

    asyncio.run(scenario())


# ---- staleness --------------------------------------------------------------------------------
def test_staleness_gate_blocks_until_the_trainer_catches_up():
    async def scenario() -> None:
        gate = StalenessGate(max_staleness=1)
        await asyncio.wait_for(gate.wait_for_slot(1, trained_version=0), 1.0)  # one step ahead: allowed
        waiting = asyncio.create_task(gate.wait_for_slot(2, trained_version=0))
        done, _ = await asyncio.wait({waiting}, timeout=0.2)
        assert not done, "step 2 started two steps ahead of the trained weights"
        await gate.publish(1)
        await asyncio.wait_for(waiting, 1.0)

        sync_gate = StalenessGate(max_staleness=0)
        assert sync_gate.may_start(0) and not sync_gate.may_start(1)
        waiting = asyncio.create_task(sync_gate.wait_for_slot(1))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await asyncio.wait_for(sync_gate.wait_for_slot(1, trained_version=1), 1.0)  # the caller saw version 1
        await asyncio.wait_for(waiting, 1.0)

    asyncio.run(scenario())


def test_gate_rejects_negative_staleness():
    with pytest.raises(ValueError, match="max-staleness"):
        StalenessGate(max_staleness=-1)


def test_stale_samples_are_dropped_and_counted(plane_factory):
    gate = StalenessGate(max_staleness=1, trained_version=3)  # oldest allowed version: 2
    plane = plane_factory(gate)

    async def scenario() -> list[list[Sample]]:
        await plane.put(0, make_group(0, version=1) + make_group(1, version=2) + make_group(2, version=[3, 1])
                        + make_group(3, version=[3, 2]) + make_group(4, version=None))
        await plane.mark_complete(0)
        return await collect(plane, 0, batch_size=4)

    batches = asyncio.run(scenario())
    assert sorted(groups_of([s for b in batches for s in b])) == [1, 3, 4]
    counts = plane.accounting()[0]
    assert counts["dropped"]["stale"] == 2 and counts["consumed"] == 3 and counts["outstanding"] == 0


# ---- lifecycle --------------------------------------------------------------------------------
def test_clear_frees_the_partition(plane_factory):
    plane = plane_factory()

    async def scenario() -> None:
        await plane.put(3, make_group(0) + make_group(1))
        await plane.mark_complete(3)
        assert plane.pending_steps() == [3]
        assert len(await collect(plane, 3, batch_size=8)) == 1
        await plane.clear(3)
        assert plane.pending_steps() == []
        if isinstance(plane, InProcessDataPlane):
            assert not plane.has_partition(3)
        else:
            assert "train_3" not in await plane.partition_ids()
        # A cleared step can be written again from scratch.
        await plane.put(3, make_group(0))
        await plane.mark_complete(3)
        assert [groups_of(b) for b in await collect(plane, 3, batch_size=4)] == [{0: 4}]

    asyncio.run(scenario())


def test_clear_keeps_unread_groups_for_the_next_step(plane_factory):
    plane = plane_factory()

    async def scenario() -> None:
        await plane.put(0, make_group(0) + make_group(1))
        await plane.mark_complete(0)
        await plane.clear(0)  # nothing was read
        assert plane.carried_groups() == 2
        await plane.mark_complete(1)
        batches = await collect(plane, 1, batch_size=8)
        assert groups_of(batches[0]) == {0: 4, 1: 4}
        assert plane.accounting()[0]["consumed"] == 2

    asyncio.run(scenario())


def test_surplus_groups_are_carried_to_the_next_step_first(plane_factory):
    """Groups of one partition come in the order they become ready, which TransferQueue does not tie to the
    write order (its storage units report rows independently); what is fixed is that the carried surplus of
    the previous step comes before anything of the new one, and that every group is served exactly once."""
    plane = plane_factory()

    async def scenario() -> None:
        await plane.put(0, [s for g in range(5) for s in make_group(g)])
        await plane.mark_complete(0)
        step0 = await collect(plane, 0, batch_size=4, max_groups=3)
        served0 = [sorted(groups_of(b)) for b in step0]
        assert all(len(groups) == 1 for groups in served0) and len(served0) == 3
        assert plane.carried_groups() == 2
        await plane.clear(0)

        await plane.put(1, [s for g in range(10, 13) for s in make_group(g)])
        await plane.mark_complete(1)
        step1 = await collect(plane, 1, batch_size=8, max_groups=3)
        served1 = [sorted(groups_of(b)) for b in step1]
        carried = sorted(set(range(5)) - {g for groups in served0 for g in groups})
        assert served1[0] == carried  # the surplus of step 0 comes first
        assert len(served1) == 2 and len(served1[1]) == 1 and served1[1][0] in {10, 11, 12}
        assert plane.carried_groups() == 2

    asyncio.run(scenario())
    counts = plane.accounting()
    assert counts[0]["consumed"] == 5 and counts[0]["carried_over"] == 2 and counts[0]["outstanding"] == 0
    assert counts[1]["served_from_carry"] == 2 and counts[1]["consumed"] == 1 and counts[1]["outstanding"] == 2


def test_a_stream_closed_early_keeps_what_it_did_not_hand_over():
    plane = InProcessDataPlane()

    async def scenario() -> None:
        await plane.put(0, [s for g in range(3) for s in make_group(g)])
        await plane.mark_complete(0)
        stream = plane.stream(0, batch_size=4)
        assert groups_of(await anext(stream)) == {0: 4}
        await stream.aclose()
        assert plane.carried_groups() == 2
        assert plane.accounting()[0]["outstanding"] == 2

    asyncio.run(scenario())


# ---- the TransferQueue columns ----------------------------------------------------------------
@needs_tq
def test_samples_round_trip_through_the_transfer_queue_columns():
    import torch

    from relax.data_plane.tq_codec import decode_rows, encode_rows, record_to_sample

    full = Sample(index=7, group_index=2, prompt=[{"role": "user", "content": "2+2?"}], label="4",
                  metadata={"source": "gsm"}, tokens=[5, 6, 7, 8], response="4", response_length=2,
                  loss_mask=[1, 0], rollout_log_probs=[-0.5, -0.125], reward={"acc": 1.0},
                  status=SampleStatus.TRUNCATED, weight_version=[3, 4],
                  multimodal_train_inputs={"pixel_values": torch.ones(2, 3)})
    bare = Sample(index=8, group_index=2, tokens=[5], weight_version=3)
    decoded = [record_to_sample(r) for r in decode_rows(encode_rows(copy.deepcopy([full, bare])))]
    assert decoded[1] == bare
    assert torch.equal(decoded[0].multimodal_train_inputs.pop("pixel_values"), torch.ones(2, 3))
    full.multimodal_train_inputs = {}
    assert decoded[0] == full


@needs_tq
def test_a_writer_in_another_process_streams_to_this_one(transfer_queue_runtime):
    """The point of TransferQueue: rollout in one Ray process, training in another."""
    import ray

    from relax.data_plane.tq_plane import TransferQueueDataPlane

    @ray.remote(num_cpus=0)
    class RolloutWriter:  # defined here so Ray ships it by value; it imports only the relax package
        def write(self, step: int, num_groups: int) -> int:
            from relax.data.sample import Sample
            from relax.data_plane.tq_plane import TransferQueueDataPlane

            async def run() -> int:
                plane = TransferQueueDataPlane()
                for group in range(num_groups):
                    await plane.put(step, [Sample(index=i, group_index=group, tokens=[group, i]) for i in range(2)])
                await plane.mark_complete(step)
                return plane.accounting()[step]["produced"]
            return asyncio.run(run())

    reader = TransferQueueDataPlane(task_name=f"train_{uuid.uuid4().hex[:8]}", poll_interval_s=0.02)
    writer = RolloutWriter.remote()
    try:
        written = writer.write.remote(7, 5)
        batches = asyncio.run(collect(reader, 7, batch_size=4))
        assert ray.get(written, timeout=WAIT_S) == 5
        assert sorted(Counter(s.group_index for b in batches for s in b).items()) == [(g, 2) for g in range(5)]
        counts = reader.accounting()[7]  # the produced count comes from the writer's end-of-step marker
        assert counts["produced"] == 5 and counts["consumed"] == 5 and counts["outstanding"] == 0
    finally:
        asyncio.run(reader.clear(7))
        ray.kill(writer)


@needs_tq
def test_a_reader_of_rows_decides_on_keys_and_the_trainer_reads_the_samples(request):
    """``trainer_reads_rows``: the trainer's stream yields `RowHandle`s (group, status and oldest version from the
    rows' metadata, no payload read), drops failed and stale groups from those as it drops samples, carries the
    surplus as rows and reads it whole before its partition is cleared; `samples_of` (any process) gives the written
    samples with the stage fields a streaming role wrote. Every group once."""
    import torch

    from relax.data_plane.rows import RowHandle

    plane = make_plane("transfer_queue", StalenessGate(max_staleness=0), request)
    plane.trainer_reads_rows = True
    written = {s.index: s for g in range(6) for s in make_group(g, version=1)}
    failed = make_group(6, version=1, status=SampleStatus.FAILED)
    stale = make_group(7, version=0)

    async def scenario() -> None:
        await plane.gate.publish(1)
        await plane.put(0, [*written.values(), *failed, *stale])
        await plane.mark_complete(0)
        async for groups in plane.stage_stream(0, "reference", (), ("ref_log_probs",)):  # a streaming role
            samples = [s for group in groups for s in group]
            await plane.write_fields(0, groups, {"ref_log_probs": [torch.full((2,), float(s.index)) for s in samples]})
        batches = await collect(plane, 0, batch_size=8, max_groups=4, needs=("ref_log_probs",))
        handles = [item for batch in batches for item in batch]
        assert all(isinstance(item, RowHandle) for item in handles) and len(handles) == 16
        read = await plane.samples_of(handles, ("ref_log_probs",))
        assert [s.index for s in read] == [h.index for h in handles]
        shuffled = sorted(handles, key=lambda h: -h.index)  # any order of handles, from any poll, comes back in it
        assert [s.index for s in await plane.samples_of(shuffled)] == [h.index for h in shuffled]
        for sample in read:
            original = written[sample.index]
            assert (sample.tokens, sample.reward, sample.group_index) == (original.tokens, original.reward,
                                                                        original.group_index)
            assert torch.equal(sample.stage_fields["ref_log_probs"], torch.full((2,), float(sample.index)))
        served0 = {h.group_index for h in handles}
        assert plane.carried_groups() == 2
        await plane.clear(0)  # the carried rows are read whole: they outlive their partition
        await plane.mark_complete(1)
        carried = [s for batch in await collect(plane, 1, batch_size=8) for s in batch]
        assert all(isinstance(s, Sample) for s in carried)
        assert {s.group_index for s in carried} | served0 == set(range(6)) and not {s.group_index for s in carried} & served0
        assert all(s.tokens == written[s.index].tokens for s in carried)
        await plane.clear(1)

    asyncio.run(scenario())
    counts = plane.accounting()[0]
    assert counts["dropped"]["failed"] == counts["dropped"]["stale"] == 1
    assert counts["consumed"] == 6 and counts["outstanding"] == 0
