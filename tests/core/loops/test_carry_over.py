"""Partial rollout across steps (--over-sampling-batch-size with --partial-rollout, `relax.core.streaming.carry_over`):
each step takes the first groups to finish, the rest go on into later steps; every prompt position is trained once
(also across a stop and --load), nothing is older than --max-staleness, and the data cursor's pending positions
round-trip through a checkpoint."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.cli.args import parse_config
from relax.config import ConfigError
from relax.core.streaming.carry_over import CarryOverFeed
from relax.data.sample import Sample
from relax.data_plane import StalenessGate
from relax.rollout.generation.data_source import PromptDataSource
from relax.telemetry.metrics_file import read_metrics
from tests.core.loops.test_async_modes import _run
from tests.core.loops.test_graceful_stop import trained_steps, train_until_signalled
from tests.support.runs import run_relax, tiny_train_args

pytestmark = pytest.mark.xdist_group("ray")

CARRY = ["--fully-async", "--partial-rollout", "--over-sampling-batch-size", "8"]


def _positions(samples) -> list[int]:
    return sorted({sample.group_index for sample in samples})


@pytest.mark.parametrize("mode", [["--max-staleness", "2"], ["--colocate-async", "--max-staleness", "2"]],
                         ids=["fully-async", "colocate-async"])
def test_each_step_takes_finished_groups_and_every_position_is_trained_once(tiny_workspace, tmp_path, mode):
    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, *CARRY, *mode, "--num-rollout", "6",
                                       "--dump-samples", "0", "--skip-eval-before-train"))
    controller = _run(cfg)
    steps = sorted(controller.trained_samples)
    assert steps == list(range(6))
    trained = [position for step in steps for position in _positions(controller.trained_samples[step][1])]
    rows = [row for row in read_metrics(tmp_path / "metrics.jsonl") if "rollout/launched_groups" in row]
    dropped = sum(row.get("data/dropped_stale_groups", 0) + row.get("data/dropped_failed_groups", 0) for row in rows)
    # Eight groups outstanding at every step, the last included (it takes the first four of eight): 8 + 5 x 4 = 28
    # positions launched; six steps of four trained once each or dropped with a reason, and the four left when the
    # run ended are pending in its last checkpoint (a longer run continued from it would take them first).
    assert [row["rollout/outstanding_groups"] for row in rows] == [4] * 6
    assert sum(row["rollout/launched_groups"] for row in rows) == 28
    assert len(trained) == len(set(trained)) and len(trained) + dropped == 24
    state = json.loads(next((tmp_path / "checkpoints" / "iter_0000006").glob("trainer_state.json")).read_text())
    assert state["consumed_prompts"] == 28 and len(state["pending_prompts"]) == 4
    assert not set(trained) & set(state["pending_prompts"]) and set(trained) <= set(range(28))
    assert rows[0]["rollout/launched_groups"] == 8
    assert sum(row["rollout/carried_groups"] for row in rows) > 0  # groups of one step's launch trained in a later one
    for step, (trained_version, samples) in controller.trained_samples.items():
        assert len(_positions(samples)) <= 4
        for sample in samples:
            oldest = min(sample.weight_version) if isinstance(sample.weight_version, list) else sample.weight_version
            assert trained_version - oldest <= 2, (step, trained_version, sample.weight_version)


def test_sigterm_and_load_train_every_prompt_once(tiny_workspace, tmp_path):
    """A stop at a step boundary checkpoints the positions launched and not trained; --load trains them first."""
    run_dir = tmp_path / "run"
    args = tiny_train_args(tiny_workspace, run_dir, *CARRY, "--max-staleness", "2", "--num-rollout", "30",
                           "--save-interval", "100", "--skip-eval-before-train", "--dump-samples", "16")
    stopped = train_until_signalled(args, run_dir, signal.SIGTERM, after_step=2)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    last = trained_steps(run_dir)[-1]
    checkpoint = next((run_dir / "checkpoints" / f"iter_{last:07d}").glob("trainer_state.json"))
    state = json.loads(checkpoint.read_text())
    # Launched: consumed_prompts; trained: consumed - pending (the rest was decoding or finished for a later step).
    assert state["consumed_prompts"] - len(state.get("pending_prompts", [])) == last * 4
    resumed = run_relax("train", *args, "--load", str(run_dir), timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert trained_steps(run_dir) == list(range(1, 31))
    dropped = sum(row.get("data/dropped_stale_groups", 0) for row in read_metrics(run_dir / "metrics.jsonl"))
    positions = []
    for dump in sorted((run_dir / "samples").glob("*.jsonl")):
        positions += sorted({json.loads(line)["group_index"] for line in dump.read_text().splitlines()})
    assert len(positions) == len(set(positions)), "a prompt position was trained twice"
    assert len(positions) + dropped == 30 * 4


@given(st.integers(1, 40), st.lists(st.integers(1, 9), min_size=1, max_size=12), st.data())
@settings(max_examples=60, deadline=None)
def test_a_restored_cursor_gives_back_exactly_the_untaken_positions(prompts, takes, data):
    """Whatever was taken and whichever positions a checkpoint lists as pending, the resumed stream gives the
    pending ones first, then continues at the cursor: together, every position below the end once."""
    source = PromptDataSource([Sample(prompt=str(i), index=i) for i in range(prompts)], 4, shuffle=True, seed=3)
    taken = [position for count in takes for position, _ in source.take_positions(count)]
    assert taken == list(range(len(taken)))
    pending = data.draw(st.lists(st.sampled_from(taken), unique=True))
    resumed = PromptDataSource(source.prompts, 4, shuffle=True, seed=3)
    resumed.load_state_dict({**source.state_dict(), "pending_prompts": pending})
    assert resumed.state_dict().get("pending_prompts", []) == sorted(pending)
    again = resumed.take_positions(len(pending) + 3)
    assert [position for position, _ in again] == sorted(pending) + [len(taken), len(taken) + 1, len(taken) + 2]
    for position, prompt in again:  # the same prompt as the first run had at that position
        assert prompt.prompt == source.prompts_at(position, 1)[0].prompt
    with pytest.raises(ValueError, match="pending_prompts"):
        resumed.load_state_dict({"consumed_prompts": 2, "pending_prompts": [2]})


class _ScriptedRollout:
    """A rollout whose groups finish when the test says (real feed, real data plane, real asyncio)."""

    def __init__(self, batch_size: int):
        self.data_source = PromptDataSource([Sample(prompt=str(i), index=i) for i in range(100)], batch_size,
                                            shuffle=False, seed=0)
        self.release: dict[int, asyncio.Event] = {}
        self.failing: set[int] = set()

    async def generate_group(self, rollout_id, position, prompt):
        await self.release.setdefault(position, asyncio.Event()).wait()
        if position in self.failing:
            raise RuntimeError(f"group {position} broke")
        return [Sample(prompt=prompt.prompt, index=position, group_index=position)]

    def step_metrics(self, samples, epoch):
        return {}


def _feed(batch_size: int, over_sampling: int):
    rollout = _ScriptedRollout(batch_size)
    roles = type("Roles", (), {"rollout": rollout})()
    return rollout, CarryOverFeed(roles, StalenessGate(5), over_sampling)


def test_a_step_completes_with_the_first_groups_to_finish_and_stragglers_land_later():
    async def scenario():
        rollout, feed = _feed(batch_size=2, over_sampling=4)
        step0 = asyncio.create_task(feed.generate(0))
        await asyncio.sleep(0)
        for position in (3, 1):  # finish out of order
            rollout.release.setdefault(position, asyncio.Event()).set()
        metrics, cursor = await step0
        assert metrics["rollout/launched_groups"] == 4 and metrics["rollout/carried_groups"] == 0
        assert cursor == {"consumed_prompts": 4, "pending_prompts": [0, 2]}
        batches = [batch async for batch in feed.plane.stream(0, 10)]
        assert _positions(batches[0]) == [1, 3]
        step1 = asyncio.create_task(feed.generate(1))
        await asyncio.sleep(0)
        for position in (0, 5):
            rollout.release.setdefault(position, asyncio.Event()).set()
        metrics, cursor = await step1
        assert metrics["rollout/launched_groups"] == 2 and metrics["rollout/carried_groups"] == 1
        assert cursor == {"consumed_prompts": 6, "pending_prompts": [2, 4]}
        # Every step tops the outstanding groups up to four (the run's last one too: it takes the first two).
        step2 = asyncio.create_task(feed.generate(2))
        await asyncio.sleep(0)
        rollout.failing.add(4)
        for position in (2, 4):
            rollout.release.setdefault(position, asyncio.Event()).set()
        with pytest.raises(RuntimeError, match="rollout step 3 failed|a group of rollout step 3") as failure:
            await step2
        assert "group 4 broke" in str(failure.value.__cause__)
        assert rollout.data_source.consumed == 8  # positions 6 and 7 launched by step 2
        await feed.close()  # their groups are cancelled with the run
        assert not feed._decoding

    asyncio.run(scenario())


@given(st.integers(1, 4), st.integers(0, 4), st.integers(1, 5), st.randoms(use_true_random=False))
@settings(max_examples=60, deadline=None)
def test_whatever_order_groups_finish_in_each_step_takes_b_and_n_stay_outstanding(batch, extra, steps, rng):
    """Groups finish in any order (several per loop turn, some during a step, some between steps): every step takes
    B groups no other step took, N stay outstanding after it, and its cursor lists exactly the positions launched
    and not taken."""
    over_sampling = batch + extra

    async def scenario():
        rollout, feed = _feed(batch, over_sampling)
        taken_before: set[int] = set()
        for step in range(steps):
            stepping = asyncio.create_task(feed.generate(step))
            while not stepping.done():
                await asyncio.sleep(0)
                waiting = [p for p in feed._untaken if not rollout.release.setdefault(p, asyncio.Event()).is_set()]
                for position in rng.sample(waiting, min(len(waiting), rng.randint(1, 3))):
                    rollout.release[position].set()
            metrics, cursor = await stepping
            taken = set(_positions([s async for batch in feed.plane.stream(step, 100) for s in batch]))
            assert len(taken) == batch and not taken & taken_before
            taken_before |= taken
            assert metrics["rollout/outstanding_groups"] == over_sampling - batch
            assert set(cursor.get("pending_prompts", [])) == set(range(cursor["consumed_prompts"])) - taken_before
        await feed.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("flags, message", [
    (["--over-sampling-batch-size", "2"], "must be >= --rollout-batch-size"),
    (["--over-sampling-batch-size", "8"], "needs --fully-async and --partial-rollout"),
    (["--fully-async", "--over-sampling-batch-size", "8"], "needs --partial-rollout"),
    (["--colocate-async", "--partial-rollout", "--over-sampling-batch-size", "8"], "needs --max-staleness >= 2, got 1"),
    ([*CARRY, "--max-staleness", "2", "--placement", "ray"], "--placement ray is not built"),
    ([*CARRY, "--max-staleness", "2", "--dynamic-sampling-filter-path",
      "relax.rollout.filters.dynamic_sampling.check_reward_nonzero_std"], "--dynamic-sampling-filter-path is not built"),
])
def test_over_sampling_rules_name_the_flags(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-rollout", "2", *flags])


def test_over_sampling_equal_to_the_batch_changes_nothing():
    cfg = parse_config(["--rollout-batch-size", "4", "--num-rollout", "2", "--over-sampling-batch-size", "4"])
    assert not cfg.carries_groups_over
