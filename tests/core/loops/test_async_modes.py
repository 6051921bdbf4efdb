"""The fully-async and hybrid loops (in-process placement): staleness bound, exactly-once
accounting, partial rollout, and the mode rules."""

import asyncio
import math

import pytest
import torch

from relax.cli.args import parse_config
from relax.config import ConfigError
from relax.core.build import build_roles
from relax.core.loops.asynchronous import AsyncController, mask_older_tokens
from relax.core.placement.in_process import InProcessPlacement
from relax.data.sample import Sample
from relax.data_plane import oldest_weight_version
from relax.telemetry.metrics_file import read_metrics
from relax.telemetry.tracking import Tracker
from tests.support.runs import run_relax, tiny_train_args

# Ray clusters of tests on one xdist worker, one after the other (scripts/test.sh runs three workers).
pytestmark = pytest.mark.xdist_group("ray")


class RecordingController(AsyncController):
    """Records, per trained step, the version being trained from and the samples trained on: whole (`train_on`),
    or chunk by chunk as the step arrives (`_train_chunk`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained_samples: dict[int, tuple[int, list]] = {}

    def _record(self, rollout_id, samples):
        _, trained = self.trained_samples.setdefault(rollout_id, (self.gate.trained_version, []))
        trained.extend(samples)

    async def train_on(self, rollout_id, samples):
        self._record(rollout_id, samples)
        return await super().train_on(rollout_id, samples)

    async def _train_chunk(self, rollout_id, batch, expected, last):
        self._record(rollout_id, batch)
        return await super()._train_chunk(rollout_id, batch, expected, last)

    @property
    def trained(self) -> list[tuple[int, int, list]]:
        """``(step, version trained from, the samples' weight versions)`` per step, in order."""
        return [(step, version, [s.weight_version for s in samples])
                for step, (version, samples) in sorted(self.trained_samples.items())]


def _run(cfg) -> RecordingController:
    placement = InProcessPlacement.build(cfg)
    try:
        with Tracker(cfg.output_dir, use_tensorboard=False) as tracker:
            controller = RecordingController(cfg, placement, tracker)
            asyncio.run(controller.run())
    finally:
        placement.close()
    return controller


@pytest.mark.parametrize("mode, staleness, partial", [
    ("--fully-async", 0, False), ("--fully-async", 1, False), ("--fully-async", 2, True),
    ("--colocate-async", 1, False), ("--colocate-async", 2, True)])
def test_no_trained_sample_is_older_than_max_staleness(tiny_workspace, tmp_path, mode, staleness, partial):
    extra = ["--partial-rollout"] if partial else []
    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, mode, "--max-staleness", str(staleness),
                                       "--num-rollout", "6", "--dump-samples", "0", "--skip-eval-before-train",
                                       *extra))
    controller = _run(cfg)
    assert [step for step, _, _ in controller.trained] == list(range(6))
    lags = []
    for step, trained_version, versions in controller.trained:
        for version in versions:
            oldest = min(version) if isinstance(version, list) else version
            assert trained_version - oldest <= staleness, (step, trained_version, version)
            lags.append(trained_version - oldest)
    if staleness and not partial:
        # Rollout ran ahead: a step was generated while the previous one trained. (With partial rollout the
        # in-process scheduler hands the new weights to the generation in flight, so it rarely lags.)
        assert max(lags) >= 1, "rollout never ran ahead: the modes would be the same"
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    for row in metrics:  # exactly once: each step's 4 groups trained, none lost or duplicated
        if "data/produced_groups" in row:
            assert row["data/produced_groups"] == row["data/consumed_groups"] == 4
            assert row["data/outstanding_groups"] == 0
    assert all(math.isfinite(row["train/loss"]) for row in metrics if "train/loss" in row)
    # every step's row carries the run's wall-clock so far (what curves against time are drawn on), increasing,
    # and at least the steps' own times
    elapsed = [row["perf/elapsed_s"] for row in metrics if "perf/step_s" in row]
    assert len(elapsed) == 6 and elapsed == sorted(elapsed)
    assert elapsed[-1] >= sum(row["perf/step_s"] for row in metrics if "perf/step_s" in row) * 0.99


@pytest.mark.parametrize("mode, overlaps", [("--colocate-async", True), ("--fully-async", False)])
def test_colocate_async_decodes_while_the_trainer_computes(tiny_workspace, tmp_path, monkeypatch, mode, overlaps):
    """--colocate-async: the embedded engine takes decode steps while the trainer computes, on another thread.
    Each training call holds its thread for 0.3 s (as a long backward would): under --colocate-async the engine's
    steps go on meanwhile; under plain --fully-async with the embedded engine the trainer shares the loop's thread,
    so the engine waits for every training call."""
    import threading
    import time

    from relax.backends.inference.engine_core.core import EngineCore
    from relax.components.actor import Actor

    training: list[tuple[float, float, str]] = []
    engine_steps: list[float] = []

    def held(function):
        async def wrapper(self, *args, **kwargs):
            started = time.monotonic()
            time.sleep(0.3)  # holds the calling thread, not only this task
            result = await function(self, *args, **kwargs)
            training.append((started, time.monotonic(), threading.current_thread().name))
            return result
        return wrapper

    process = EngineCore._process

    def recorded_process(self, output):
        engine_steps.append(time.monotonic())
        return process(self, output)

    for name in ("train", "train_chunk"):
        monkeypatch.setattr(Actor, name, held(getattr(Actor, name)))
    monkeypatch.setattr(EngineCore, "_process", recorded_process)
    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, mode, "--max-staleness", "1", "--num-rollout", "4",
                                       "--dump-samples", "0", "--skip-eval-before-train", "--rollout-max-batch-size",
                                       "4", "--rollout-max-response-len", "16"))
    _run(cfg)
    assert training and engine_steps
    inside = sum(any(start < moment < end for start, end, _ in training) for moment in engine_steps)
    threads = {thread for _, _, thread in training}
    if overlaps:
        assert threads == {"relax-trainer-compute_0"} and inside > 0, (threads, inside)
    else:
        assert threads == {threading.main_thread().name} and inside == 0, (threads, inside)


class StreamCheckingController(RecordingController):
    """Which fields the samples of each trained step carried from the streaming roles."""

    @property
    def carried_fields(self) -> list[set[str]]:
        return [set.intersection(*(set(s.stage_fields) for s in samples))
                for _, (_, samples) in sorted(self.trained_samples.items())]


def test_fully_async_streams_the_reference_and_advantages_and_trains_as_hybrid(tiny_workspace, tmp_path, monkeypatch):
    """--fully-async: the reference's log-probs and GRPO's advantages come from streaming roles that read each
    group as rollout writes it (the in-step computation is never needed); --hybrid computes them in the step. With
    the same seed the first step sees the same samples and weights, so the losses agree."""
    from relax.components.actor_fwd import ActorFwd
    from relax.components.advantages import Advantages

    results = {}
    for mode in ("--fully-async", "--hybrid"):
        cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path / mode.strip("-"), mode, "--num-rollout", "3",
                                           "--use-kl-loss", "--kl-loss-coef", "0.1", "--skip-eval-before-train",
                                           "--dump-samples", "0", "--rollout-max-batch-size", "4"))
        roles = build_roles(cfg)
        reference_calls, advantage_sizes = [], []
        compute_log_probs, compute_advantages = ActorFwd.compute_log_probs, Advantages.compute

        async def counted_log_probs(self, samples, _calls=reference_calls, _f=compute_log_probs):
            _calls.append(len(samples))
            return await _f(self, samples)

        async def counted_advantages(self, samples, *args, _sizes=advantage_sizes, _f=compute_advantages):
            _sizes.append(len(samples))
            return await _f(self, samples, *args)

        monkeypatch.setattr(ActorFwd, "compute_log_probs", counted_log_probs)
        monkeypatch.setattr(Advantages, "compute", counted_advantages)
        with Tracker(cfg.output_dir, use_tensorboard=False) as tracker:
            controller = StreamCheckingController(cfg, InProcessPlacement(cfg, roles), tracker)
            asyncio.run(controller.run())
        monkeypatch.undo()
        results[mode] = (controller, reference_calls, advantage_sizes, read_metrics(tmp_path / mode.strip("-") / "metrics.jsonl"))

    streamed, calls, sizes, rows = results["--fully-async"]
    assert [role.name for role in streamed.streaming] == ["reference", "advantages"]
    assert streamed.carried_fields == [{"ref_log_probs", "advantages"}] * 3
    # The engine decodes one group per batch and rollout writes each group when it is scored: the roles take
    # the groups as they arrive, in several calls per step, 48 samples in all.
    assert sum(calls) == sum(sizes) == 48 and len(calls) > 3 and len(sizes) > 3, (calls, sizes)
    assert all(row["data/consumed_groups"] == 4 for row in rows if "data/consumed_groups" in row)
    hybrid, hybrid_calls, hybrid_sizes, hybrid_rows = results["--hybrid"]
    assert hybrid.streaming == [] and hybrid.carried_fields == [set()] * 3
    assert hybrid_calls == hybrid_sizes == [16] * 3  # the whole step, in the trainer
    first, first_hybrid = rows[0], hybrid_rows[0]
    # --fully-async trains each step in chunks as its groups arrive (--train-stream-chunks 4: at least one group
    # each, all that landed while the last chunk trained); the rescaled update is hybrid's whole-step update
    assert all(1 <= row["perf/train_chunks"] <= 4 and row["train/optimizer_steps"] == 1 for row in rows
               if "train/loss" in row), rows
    assert all("perf/train_chunks" not in row for row in hybrid_rows)
    for key in ("train/loss", "train/grad_norm", "train/kl_loss", "train/advantage_abs_mean", "rollout/reward_mean"):
        assert math.isclose(first[key], first_hybrid[key], rel_tol=1e-4, abs_tol=1e-6), key


def test_a_failing_streaming_role_ends_the_run_naming_it_instead_of_hanging(tiny_workspace, tmp_path, monkeypatch):
    """The trainer waits for the fields the streaming roles write: when a role fails, the wait ends with that
    failure (not at --data-wait-timeout, not never)."""
    from relax.components.actor_fwd import ActorFwd

    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, "--fully-async", "--num-rollout", "3",
                                       "--use-kl-loss", "--kl-loss-coef", "0.1", "--skip-eval-before-train",
                                       "--dump-samples", "0", "--data-wait-timeout", "600"))
    roles = build_roles(cfg)
    calls = []
    compute_log_probs = ActorFwd.compute_log_probs

    async def failing(self, samples):
        calls.append(len(samples))
        if len(calls) > 1:
            raise RuntimeError("the reference's device fell over")
        return await compute_log_probs(self, samples)

    monkeypatch.setattr(ActorFwd, "compute_log_probs", failing)
    with Tracker(cfg.output_dir, use_tensorboard=False) as tracker:
        controller = AsyncController(cfg, InProcessPlacement(cfg, roles), tracker)
        with pytest.raises(RuntimeError, match=r"a streaming role \(reference, advantages\) failed") as raised:
            asyncio.run(asyncio.wait_for(controller.run(), 120))
    assert "the reference's device fell over" in str(raised.value.__cause__)


def test_rollout_hands_each_group_on_while_the_rest_still_decode(tiny_workspace, tmp_path, monkeypatch):
    """`Rollout.generate(on_group=...)`: the engine reports each group as it ends (here it decodes one group per
    batch: the first is complete while 12 samples have no response yet), and each group is scored and handed on
    by itself; the step's samples are the same as without streaming (one engine call, same seeds)."""
    import relax.components.rollout as rollout_module

    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, "--fully-async", "--rollout-max-batch-size", "4",
                                       "--num-rollout", "1", "--skip-eval-before-train"))
    roles = build_roles(cfg)
    pending_when_complete: dict[int, int] = {}
    generate_samples = rollout_module.generate_samples

    async def watched(engine, samples, *args, on_sample=None, **kwargs):
        def on_sample_watched(sample):
            if all(s.response_length for s in samples if s.group_index == sample.group_index):
                pending_when_complete[sample.group_index] = sum(not s.response_length for s in samples)
            on_sample(sample)
        return await generate_samples(engine, samples, *args, on_sample=on_sample and on_sample_watched, **kwargs)

    monkeypatch.setattr(rollout_module, "generate_samples", watched)
    handed = []

    async def on_group(groups):
        for group in groups:
            assert len({s.group_index for s in group}) == 1 and all(s.reward is not None for s in group)
            handed.append(group[0].group_index)

    async def run():
        streamed, _ = await roles.rollout.generate(0, on_group=on_group)
        plain, _ = await roles.rollout.generate(0)
        return streamed, plain

    streamed, plain = asyncio.run(run())
    groups = sorted({s.group_index for s in plain})
    assert handed == groups
    assert [pending_when_complete[g] for g in groups] == [12, 8, 4, 0]
    assert [(s.tokens, s.reward) for s in streamed] == [(s.tokens, s.reward) for s in plain]


def test_mask_older_tokens_keeps_only_the_newest_version():
    sample = Sample(response_length=4, loss_mask=[1, 1, 0, 1], weight_version=[3, 3, 4, 4])
    same = Sample(response_length=2, loss_mask=[1, 1], weight_version=5)
    assert mask_older_tokens([sample, same]) == 2
    assert sample.loss_mask == [0, 0, 0, 1] and same.loss_mask == [1, 1]
    assert oldest_weight_version(sample) == 3


def test_hybrid_and_fully_async_runs_from_the_command_line(tiny_workspace, tmp_path):
    for mode in ("--hybrid", "--fully-async"):
        out = tmp_path / mode.strip("-")
        result = run_relax("train", *tiny_train_args(tiny_workspace, out, mode, "--max-staleness", "1",
                                                    "--num-rollout", "3", "--save-interval", "3",
                                                    "--eval-interval", "3"))
        assert result.returncode == 0, result.stderr[-3000:]
        rows = read_metrics(out / "metrics.jsonl")
        assert [r["step"] for r in rows] == [0, 1, 2, 3]
        assert (out / "checkpoints" / "iter_0000003").is_dir()


@pytest.mark.parametrize("flags, message", [
    (["--fully-async", "--hybrid"], "exclusive"),
    (["--max-staleness", "1"], "--max-staleness needs --fully-async or --hybrid"),
    (["--hybrid", "--partial-rollout"], "--partial-rollout needs --fully-async"),
    (["--fully-async", "--mask-offpolicy-in-partial-rollout"], "needs --partial-rollout"),
    (["--fully-async", "--advantage-estimator", "rloo"], "rloo is on-policy"),
    (["--fully-async", "--colocate"], "--colocate is the synchronous mode"),
    (["--colocate-async", "--hybrid"], "--colocate-async and --hybrid are exclusive"),
    (["--colocate-async", "--colocate"], "--colocate-async and --colocate are exclusive"),
    (["--colocate-async", "--max-staleness", "0"], "--colocate-async .* needs --max-staleness >= 1"),
    (["--colocate-async", "--offload-train"], "--offload-train: the async modes overlap"),
    (["--colocate-async", "--placement", "ray"], "--colocate-async overlaps the embedded engine .* use --fully-async"),
    (["--colocate-async", "--rollout-external", "--rollout-external-engine-addrs", "http://127.0.0.1:1"],
     "--colocate-async overlaps the embedded"),
    (["--colocate-async", "--rollout-serve-replicas", "2"], "--colocate-async overlaps the embedded engine with"),
])
def test_mode_rules_name_the_flags(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(["--n-samples-per-prompt", "4", "--num-rollout", "2", *flags])


def test_a_hung_rollout_times_out_naming_what_was_awaited(tiny_workspace, tmp_path):
    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, "--fully-async", "--num-rollout", "2",
                                       "--skip-eval-before-train", "--custom-rm-path", "tests.support.e2e_rewards:hangs",
                                       "--data-wait-timeout", "2"))
    with pytest.raises(TimeoutError, match=r"waited 2 s for the data of rollout step 1 .*--data-wait-timeout"):
        _run(cfg)


def test_bad_placement_config_fails_up_front(tiny_workspace, tmp_path):
    from relax.core.placement.ray.service import check_ray_address, check_resource_covers
    from relax.distributed.process_group import free_loopback_port

    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, "--placement", "ray", "--num-rollout", "1",
                                       "--resource", '{"actor": [1, 0]}'))
    with pytest.raises(ConfigError, match=r"--resource has no entry for \['rollout'\]"):
        check_resource_covers(cfg, ["actor", "rollout"])
    with pytest.raises(ConfigError, match="--ray-address 127.0.0.1:.*no Ray head answers"):
        check_ray_address(f"127.0.0.1:{free_loopback_port()}")
    # not an address Ray takes: named at once (`http://[::1` had reached ray.init: a ValueError traceback); a URL's
    # credentials are not shown
    for address in ("http://[::1", "http://127.0.0.1:6379", ":", "host:99999", "host:port"):
        with pytest.raises(ConfigError, match="expected HOST:PORT, ray://HOST:PORT"):
            check_ray_address(address)
    with pytest.raises(ConfigError, match=r"--ray-address ray://\*\*\*@127.0.0.1:.*no Ray head answers") as refused:
        check_ray_address(f"ray://user:s3cret@127.0.0.1:{free_loopback_port()}")
    assert "s3cret" not in str(refused.value)
    with pytest.raises(ConfigError, match="--max-staleness"):
        parse_config(["--fully-async", "--max-staleness", "-1"])


@pytest.mark.parametrize("replicas", ["10000", "1e9"])
def test_more_role_processes_than_the_machine_holds_are_refused_before_ray_starts(tiny_workspace, tmp_path, replicas):
    """A local Ray is given as many logical CPUs as the bundles ask: 10,000 actor replicas started 10,000 processes
    (the run hung, then the machine ran out of memory) instead of an error naming --resource."""
    out = tmp_path / "run"
    result = run_relax("train", *tiny_train_args(tiny_workspace, out, "--placement", "ray", "--num-rollout", "1",
                                                 "--resource", f'{{"actor": [{replicas}, 0], "rollout": [1, 0]}}'))
    assert result.returncode == 2, result.stderr
    assert "--resource:" in result.stderr and "role processes take about" in result.stderr and "GiB" in result.stderr
    assert not out.exists() and "Traceback" not in result.stderr


def test_more_gpus_than_the_machine_has_are_refused_with_a_share_that_fits(tiny_workspace, tmp_path):
    """Asked of a local Ray, GPUs that are not there were waited for (300 s) before the error."""
    from relax.core.placement.ray.service import check_machine_holds

    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, "--placement", "ray", "--num-rollout", "1",
                                       "--resource", '{"actor": [2, 1], "rollout": [1, 0.5]}'))
    have = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=rf"--resource: the role processes ask for 2.5 GPUs .* has {have}; give "):
        check_machine_holds(cfg, ["actor", "rollout"], use_gpus=True)
    check_machine_holds(cfg, ["actor", "rollout"], use_gpus=False)  # CPU bundles: three processes fit


class LateReplyController(AsyncController):
    """The rollout's reply (metrics, data cursor) reaches the controller well after its partition is complete, as
    a Ray rollout's does under load (it marks the partition, then replies)."""

    async def _generate_into_plane(self, step):
        reply = await super()._generate_into_plane(step)
        await asyncio.sleep(0.3)
        return reply


def test_a_step_waits_for_its_rollouts_reply_so_no_metric_or_cursor_is_lost(tiny_workspace, tmp_path, caplog):
    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, "--fully-async", "--max-staleness", "1",
                                       "--num-rollout", "3", "--dump-samples", "0", "--skip-eval-before-train",
                                       "--save-interval", "1"))
    roles = build_roles(cfg)
    with Tracker(cfg.output_dir, use_tensorboard=False) as tracker:
        controller = LateReplyController(cfg, InProcessPlacement(cfg, roles), tracker)
        asyncio.run(controller.run())
    rows = [row for row in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in row]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all("rollout/reward_mean" in row and "perf/rollout_s" in row for row in rows), rows
    assert "the data cursor after its rollout is not recorded yet" not in caplog.text


def test_fully_async_evaluates_beside_training_at_one_named_version(tiny_workspace, tmp_path, monkeypatch):
    """--fully-async --eval-interval: an evaluation runs while the trainer goes on (it trains the next step's chunks
    meanwhile; the next weight push waits for the evaluation, which keeps its version), it is logged when it lands
    with ``eval/weight_version``, every held-out token came from that version, and the run's last evaluation is at
    its final version, in the last step's row."""
    import time

    from relax.components.actor import Actor
    from relax.components.rollout import Rollout
    from relax.telemetry.tracking import Tracker as TrackerClass

    evaluations: list[tuple[float, float]] = []
    logged: list[tuple[float, int, dict]] = []
    trained: list[float] = []
    evaluate, log, train_chunk = Rollout.evaluate, TrackerClass.log, Actor.train_chunk

    async def recorded_chunk(self, *args, **kwargs):
        result = await train_chunk(self, *args, **kwargs)
        trained.append(time.monotonic())
        return result

    async def slow_evaluate(self, step):
        started = time.monotonic()
        await asyncio.sleep(0.6)  # a long held-out set
        result = await evaluate(self, step)
        evaluations.append((started, time.monotonic()))
        return result

    def recorded_log(self, step, metrics):
        logged.append((time.monotonic(), step, dict(metrics)))
        return log(self, step, metrics)

    monkeypatch.setattr(Rollout, "evaluate", slow_evaluate)
    monkeypatch.setattr(TrackerClass, "log", recorded_log)
    monkeypatch.setattr(Actor, "train_chunk", recorded_chunk)
    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, "--fully-async", "--max-staleness", "1",
                                       "--num-rollout", "6", "--eval-interval", "2", "--dump-samples", "0"))
    _run(cfg)
    eval_rows = [row for _, _, row in logged if "eval/accuracy" in row]
    assert [row["eval/weight_version"] for row in eval_rows] == [0.0, 2.0, 4.0, 6.0]  # before, beside x2, last
    for row in eval_rows:  # pinned: every held-out token of the evaluation came from the version it names
        assert row["eval/held_out/weight_version_min"] == row["eval/held_out/weight_version_max"] \
            == row["eval/weight_version"]
    beside = evaluations[1:3]  # the evaluations after steps 2 and 4
    assert any(start < moment < end for start, end in beside for moment in trained), \
        "the trainer trained nothing while an evaluation ran"
    last_row = next(row for _, step, row in reversed(logged) if step == 6 and "train/loss" in row)
    assert last_row["eval/weight_version"] == 6.0  # the run's last evaluation is in its last step's row
