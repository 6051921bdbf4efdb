"""Ray placement (`--placement ray`): the role registry, the flags, and the three modes with the
actor, rollout (and reference) in their own Ray processes on a real local Ray bound to 127.0.0.1."""

import asyncio
import importlib.util
import json
import math
import os
import re

import pytest
import torch

from relax.algorithms.spec import get_algorithm
from relax.cli.args import parse_config
from relax.config import ConfigError
from relax.core.roles import required_roles, roles_for_config
from relax.telemetry.metrics_file import read_metrics
from relax.telemetry.tracking import Tracker
from tests.support.runs import run_relax, tiny_train_args

# Ray clusters of tests on one xdist worker, one after the other (scripts/test.sh runs three workers).
pytestmark = pytest.mark.xdist_group("ray")

HAS_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("transfer_queue") is not None
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="Ray + TransferQueue not installed (pip install -e '.[ray]')")


# ---- registry (pure) -------------------------------------------------------------------------
def test_registry_names_the_roles_each_algorithm_and_mode_needs():
    grpo, ppo, reinforce = get_algorithm("grpo"), get_algorithm("ppo"), get_algorithm("reinforce_plus_plus")
    assert required_roles(grpo) == ("actor", "rollout", "advantages")
    assert required_roles(ppo) == ("actor", "rollout", "advantages", "critic")
    assert required_roles(grpo, use_kl_loss=True) == ("actor", "rollout", "advantages", "reference")
    assert "reference" in required_roles(reinforce, kl_coef=0.01) and "reference" not in required_roles(reinforce)
    assert "reference" not in required_roles(grpo, kl_coef=0.01)  # GRPO puts no KL into the reward
    assert required_roles(grpo, use_opd=True)[-1] == "teacher"
    assert "actor_fwd" in required_roles(grpo, true_on_policy=False)
    assert "actor_fwd" not in required_roles(grpo, true_on_policy=True)
    assert required_roles(ppo, loss_type="sft") == ("actor", "rollout")


def test_registry_reads_the_config(tiny_workspace, tmp_path):
    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path, "--global-batch-size", "8", "--use-kl-loss"))
    assert roles_for_config(cfg) == ("actor", "rollout", "advantages", "reference", "actor_fwd")


def test_placement_flags_are_validated_naming_the_flag(tiny_workspace, tmp_path):
    base = tiny_train_args(tiny_workspace, tmp_path)
    cases = [
        (["--resource", '{"actor": [1, 1]}'], "--resource needs --placement ray"),
        (["--weight-sync-transport", "disk"], "--weight-sync-transport needs --placement ray or --rollout-external"),
        (["--placement", "ray", "--resource", '{"judge": [1, 1]}'], "unknown role 'judge'"),
        (["--placement", "ray", "--resource", '{"rollout": [2, 1]}'], "one rollout process"),
        (["--placement", "ray", "--resource", '{"actor": [1, -1]}'], "gpus_per_replica >= 0"),
        (["--placement", "ray", "--use-opd", "--teacher-hf-checkpoint", str(tiny_workspace / "model")],
         "--placement ray does not support --use-opd"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message):
            parse_config([*base, *extra])
    with pytest.raises(ConfigError, match="--placement: invalid choice: 'serve'"):
        parse_config([*base, "--placement", "serve"])


# ---- real Ray --------------------------------------------------------------------------------
@pytest.fixture
def ray_guard():
    """Never leave Ray running, whatever the test did."""
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _run_with_ray(cfg, check=None):
    """Train ``cfg`` with Ray placement; ``check(service)`` runs before the roles are stopped."""
    from relax.core.loops import loop_class
    from relax.core.placement.ray import RayPlacement

    placement = RayPlacement.start(cfg)
    service = placement.service
    try:
        pids = {name: report["pid"] for name, report in service.health().items()}
        assert os.getpid() not in pids.values() and len(set(pids.values())) == len(pids), pids
        assert all(report["torch_threads"] == 1 for report in service.health().values())
        with Tracker(cfg.output_dir, use_tensorboard=False) as tracker:
            asyncio.run(loop_class(cfg)(cfg, placement, tracker).run())
        return check(service) if check else None
    finally:
        placement.close()


def _weights_equal(service) -> int:
    engine, trainer = service.engine_weights(), service.trainer_weights()
    for name, tensor in trainer.items():
        assert torch.equal(engine[name], tensor), name
    assert service.health()["rollout"]["weight_version"] == 3
    return len(trainer)


def _assert_finite_losses(out, steps=3) -> list[dict]:
    rows = [row for row in read_metrics(out / "metrics.jsonl") if "train/loss" in row]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert all(math.isfinite(row["train/loss"]) for row in rows)
    return rows


RUN = ("--num-rollout", "3", "--skip-eval-before-train", "--dump-samples", "0", "--no-use-tensorboard")


@needs_ray
def test_sync_mode_in_ray_processes_then_resume_in_process(tiny_workspace, tmp_path, ray_guard):
    out = tmp_path / "ray_sync"
    cfg = parse_config(tiny_train_args(tiny_workspace, out, "--placement", "ray", "--use-kl-loss",
                                       "--save-interval", "3", *RUN))
    assert _run_with_ray(cfg, _weights_equal) > 0  # broadcast (gloo): engine == trainer, bit for bit
    _assert_finite_losses(out)
    assert (out / "checkpoints").is_dir()

    # The checkpoint written under Ray placement resumes in one process.
    from relax.core.build import build_roles
    from relax.core.loops import loop_class
    from relax.core.placement.in_process import InProcessPlacement

    resumed_out = tmp_path / "resumed_in_process"
    cfg2 = parse_config(tiny_train_args(tiny_workspace, resumed_out, "--use-kl-loss", "--load", str(out),
                                        "--num-rollout", "4", "--skip-eval-before-train", "--dump-samples", "0",
                                        "--no-use-tensorboard"))
    roles = build_roles(cfg2)
    with Tracker(resumed_out, use_tensorboard=False) as tracker:
        controller = loop_class(cfg2)(cfg2, InProcessPlacement(cfg2, roles), tracker)
        asyncio.run(controller.run())
    rows = [row for row in read_metrics(resumed_out / "metrics.jsonl") if "train/loss" in row]
    assert len(rows) == 1 and math.isfinite(rows[0]["train/loss"])


@needs_ray
def test_fully_async_with_the_rollout_engines_on_ray_serve_under_ray_placement(tiny_workspace, tmp_path, ray_guard):
    """`--placement ray --rollout-serve-replicas 2`: the rollout role's process starts the engines' Serve
    deployment in the run's Ray; the weights it receives reach the replicas; every group is trained once."""
    out = tmp_path / "serve"
    cfg = parse_config(tiny_train_args(tiny_workspace, out, "--placement", "ray", "--fully-async", "--max-staleness",
                                       "1", "--rollout-serve-replicas", "2", *RUN))

    def check(service):
        from ray import serve

        from relax.core.engines.serve_deployment import APP_NAME, DEPLOYMENT_NAME

        deployment = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME]
        assert deployment.replica_states.get("RUNNING") == 2
        assert service.health()["rollout"]["weight_version"] == 3

    _run_with_ray(cfg, check)
    rows = [row for row in read_metrics(out / "metrics.jsonl") if "data/produced_groups" in row]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["data/produced_groups"] == row["data/consumed_groups"] == 4 for row in rows)
    assert all(row["perf/rollout_version_lag"] <= 1 for row in rows)


@needs_ray
def test_fully_async_streams_the_reference_in_its_own_process(tiny_workspace, tmp_path, ray_guard):
    """`--placement ray --fully-async` with a KL loss: the rollout process writes each group to TransferQueue as it
    is scored, the reference's process reads it there and writes its log-probs back, advantages stream in the
    controller, and the trainer reads groups carrying both; every group once, every sample with its fields."""
    out = tmp_path / "streaming"
    # the serial reward (100 ms a sample, one at a time) spaces the groups' arrivals 0.4 s apart, far more than the
    # reader's poll: the trainer, waiting from the run's start, gets step 1 in several chunks (a chunk is all that
    # landed while the last one trained; a faster reward let all four land before the first read now and then)
    cfg = parse_config(tiny_train_args(tiny_workspace, out, "--placement", "ray", "--fully-async", "--max-staleness",
                                       "1", "--use-kl-loss", "--kl-loss-coef", "0.1", "--rollout-max-batch-size", "4",
                                       "--custom-rm-path", "tests.support.e2e_rewards:digit_fraction_serial", *RUN))
    _run_with_ray(cfg)
    rows = _assert_finite_losses(out)
    assert rows[0]["perf/train_chunks"] > 1, rows[0]
    for row in rows:
        assert row["data/produced_groups"] == row["data/consumed_groups"] == 4, row
        assert row["data/streamed_fields_fraction"] == 1.0, row
        # the actor's process trains each step in chunks as the groups arrive, one optimizer step, reading the
        # samples from TransferQueue itself: the controller passed their keys
        assert 1 <= row["perf/train_chunks"] <= 4 and row["train/optimizer_steps"] == 1, row
        assert row["data/passed_by_key_fraction"] == 1.0, row
    # Step 1 trains the initial weights, which the reference holds: its streamed log-probs, matched to their samples
    # through TransferQueue, equal the actor's exactly (a sample given another's field would show a KL). Later steps
    # have moved away from the reference.
    assert abs(rows[0]["train/kl_loss"]) < 1e-6 and all(abs(row["train/kl_loss"]) > 1e-5 for row in rows[1:])


@needs_ray
def test_dpo_sft_and_reward_models_in_ray_processes_take_the_in_process_steps(tiny_workspace, tmp_path, ray_guard):
    """`--loss-type dpo`, `sft` and `rm` under `--placement ray`: the controller takes each step's rows from the
    rollout's process (the data source's cursor lives there), the policy (DPO's reference, the score model) compute
    in theirs, and the steps' losses, implicit rewards and gradient norms are the in-process run's; the held-out
    evaluations run on the rollout's engine after the weights were pushed to it (a reward model's: its held-out
    pairs, fetched from the rollout's process, ranked by the score model's process); the checkpoint keeps the
    cursor."""
    from relax.core.build import build_roles
    from relax.core.loops import loop_class
    from relax.core.placement.in_process import InProcessPlacement
    from tests.core.loops.test_dpo import _dpo_args, _pairs
    from tests.core.loops.test_reward_model import _rm_args

    pairs = _pairs(tiny_workspace, tmp_path)
    runs = {
        "dpo": lambda out, *extra: _dpo_args(tiny_workspace, pairs, out, "--num-rollout", "2", "--eval-interval",
                                             "2", *extra)[1:],
        "sft": lambda out, *extra: tiny_train_args(tiny_workspace, out, "--loss-type", "sft", "--num-rollout", "2",
                                                   "--eval-interval", "2", *extra),
        "rm": lambda out, *extra: _rm_args(tiny_workspace, tmp_path, out, "--num-rollout", "2", "--eval-interval",
                                           "2", *extra)[1:],
    }
    for name, args in runs.items():
        _run_with_ray(parse_config(args(tmp_path / f"{name}_ray", "--placement", "ray")))
        one = parse_config(args(tmp_path / f"{name}_one"))
        with Tracker(one.output_dir, use_tensorboard=False) as tracker:
            asyncio.run(loop_class(one)(one, InProcessPlacement(one, build_roles(one)), tracker).run())
        got, expected = (read_metrics(tmp_path / f"{name}_{where}" / "metrics.jsonl") for where in ("ray", "one"))
        trained = [key for key in expected[-1] if key.startswith("train/") and key != "train/lr"]
        assert "train/loss" in trained and len(got) == len(expected)
        for a, b in zip(expected, got):
            assert a["step"] == b["step"]
            for key in trained + ["eval/accuracy"]:
                if key in a:
                    assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (name, a["step"], key)
        state = json.loads((tmp_path / f"{name}_ray" / "checkpoints" / "iter_0000002" / "trainer_state.json")
                           .read_text())
        assert state["consumed_prompts"] == 2 * (4 if name == "sft" else 8), state  # two steps' rows


@needs_ray
def test_hybrid_holds_the_reference_in_the_actors_process(tiny_workspace, tmp_path, ray_guard):
    """`--hybrid` as upstream places it: no reference process; the actor's process holds the reference beside the
    policy and computes its log-probs over the whole step (step 1's KL against the initial weights is 0)."""
    out = tmp_path / "hybrid"
    cfg = parse_config(tiny_train_args(tiny_workspace, out, "--placement", "ray", "--hybrid", "--max-staleness", "1",
                                       "--use-kl-loss", "--kl-loss-coef", "0.1", *RUN))

    def check(service):
        assert set(service.health()) == {"actor", "rollout"}, service.health()

    _run_with_ray(cfg, check)
    rows = _assert_finite_losses(out)
    assert abs(rows[0]["train/kl_loss"]) < 1e-6 and all(abs(row["train/kl_loss"]) > 1e-5 for row in rows[1:])
    assert all(row["data/consumed_groups"] == 4 and "data/streamed_fields_fraction" not in row for row in rows)
    with pytest.raises(ConfigError, match="with --hybrid the reference runs in the actor's processes"):
        from relax.core.placement.ray.service import RayService

        RayService(parse_config(tiny_train_args(tiny_workspace, tmp_path / "refused", "--placement", "ray", "--hybrid",
                                                "--use-kl-loss", "--num-rollout", "1", "--resource",
                                                '{"actor": [1, 1], "rollout": [1, 1], "reference": [1, 1]}'))).start()


@needs_ray
def test_the_judge_and_the_advantages_in_processes_of_their_own(tiny_workspace, tmp_path, ray_guard):
    """`--resource` places upstream's `genrm` (the --genrm-model-path judge) and `advantages` roles: the rollout's
    rewards ask the judge's process for verdicts, the advantages stream from TransferQueue in their own process."""
    from tests.rollout.rewards.test_remote_rewards import build_bigram_judge

    judge = build_bigram_judge(tmp_path / "judge", "yes")
    out = tmp_path / "placed"
    resource = '{"actor": [1, 1], "rollout": [1, 1], "advantages": [1, 0], "genrm": [1, 1]}'
    args = tiny_train_args(tiny_workspace, out, "--placement", "ray", "--fully-async", "--resource", resource,
                           "--genrm-model-path", str(judge), "--genrm-sampling-config",
                           '{"temperature": 0, "max_response_len": 8}', "--reward-timeout", "300", *RUN)
    at = args.index("--custom-rm-path")
    cfg = parse_config(args[:at] + args[at + 2:])  # the judge is the reward

    def check(service):
        health = service.health()
        assert {"actor", "rollout", "advantages", "genrm"} <= set(health), health
        return health

    _run_with_ray(cfg, check)
    rows = _assert_finite_losses(out)
    for row in rows:
        assert row["reward/genrm_verdicts"] == 16 and row["rollout/reward_mean"] == 1.0, row
        assert row["data/streamed_fields_fraction"] == 1.0 and row["data/consumed_groups"] == 4, row


@needs_ray
def test_the_scaling_api_under_ray_placement_grows_and_shrinks_a_running_training(tiny_workspace, tmp_path):
    """`--placement ray --rollout-api-port`: the rollout role's process, which holds the engines, serves the scaling
    API; `relax scale out` adds an embedded engine there (given the weights its engines serve), `relax scale in`
    drains it, and training goes on: every step trained once with all its groups."""
    import httpx

    from relax.distributed.process_group import free_loopback_port
    from tests.core.engines.test_serve_rollout import (
        TOKEN,
        _run_steps,
        _scale,
        _up,
        _wait,
        assert_every_step_trained_once,
        finish_held_training,
        held_training,
    )

    port, out, hold = free_loopback_port(), tmp_path / "run", tmp_path / "hold"
    steps = 10
    args = tiny_train_args(tiny_workspace, out, "--placement", "ray", "--fully-async", "--max-staleness", "1",
                           "--num-rollout", str(steps), "--skip-eval-before-train", "--dump-samples", "0",
                           "--rollout-api-port", str(port), "--rollout-api-key", TOKEN, "--reward-timeout", "300",
                           "--use-health-check", "--heartbeat-timeout-s", "600")
    url = f"http://127.0.0.1:{port}"

    def engines() -> list[dict]:
        return httpx.get(f"{url}/engines", timeout=30).json()["models"]["default"]["engines"]

    with held_training(args, hold) as train:
        _wait(lambda: _up(url), train, "the scaling API in the rollout process")
        assert non_loopback_listeners(train.pid) == []  # the Ray it started, its workers and servers: loopback
        assert len(engines()) == 1
        grown = _scale(url, "out", 2)
        assert grown["status"] == "ACTIVE" and len(grown["engine_ids"]) == 1, grown
        assert len(engines()) == 2 and all(e["is_healthy"] for e in engines())
        _run_steps(out, hold, train, 3, "steps on two engines")
        shrunk = _scale(url, "in", 1)
        assert shrunk["status"] == "COMPLETED" and len(shrunk["removed_engines"]) == 1, shrunk
        stderr = finish_held_training(train, hold)
    assert_every_step_trained_once(out, steps)
    assert TOKEN not in stderr
    assert_ended_healthy(out)


def non_loopback_listeners(pid: int) -> list[str]:
    """Listening sockets of process ``pid`` and its descendants (the Ray it started: GCS, raylet, workers) that
    are not on loopback."""
    import psutil

    processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    pids = {}
    for process in processes:  # a child that ended and is not reaped yet (a zombie) listens on nothing
        try:
            pids[process.pid] = " ".join(process.cmdline())[:120]
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return [f"{c.pid} ({pids[c.pid]}): {c.laddr.ip}:{c.laddr.port}" for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in pids
            and c.laddr.ip not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]


def assert_ended_healthy(out) -> None:
    """A run that ended well ends healthy: no verdict in its health state or log, `relax health` exits 0."""
    from relax.core.state.health import read_state

    state = read_state(out)
    assert state["fatal"] is None and state["ended"], state
    assert all(role["healthy"] for role in state["roles"].values()), state
    assert "health check:" not in (out / "run.log").read_text()
    assert run_relax("health", str(out)).returncode == 0


@pytest.mark.parametrize("resource, message", [
    ('{"actor_fwd": [1, 1]}', "old-policy log-probs in the actor's own processes"),
    ('{"advantages": [2, 0]}', "advantages: one process"),
    ('{"genrm": [1, 1]}', "--genrm-model-path, which is not set"),
])
def test_resource_refuses_what_it_cannot_place_with_the_reason(resource, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(["--n-samples-per-prompt", "2", "--num-rollout", "1", "--placement", "ray", "--resource",
                      resource])


@needs_ray
def test_the_actor_across_two_processes_trains_as_one_process_does(tiny_workspace, tmp_path, ray_guard):
    """`--resource '{"actor": [2, 1]}'`: two Ray processes form one FSDP2 (gloo) process group, each trains on its
    share of the batch; one step gives the loss and the weights of the same step in one process (float32 rounding
    of a two-way gradient reduction), and the engine receives them bit for bit."""
    from relax.core.build import build_roles
    from relax.core.loops import loop_class
    from relax.core.placement.in_process import InProcessPlacement

    # Adam's first step moves each weight by +-lr whatever its gradient's size, so a near-zero gradient whose sign
    # differs by rounding would move a weight by 2 lr: a large epsilon makes the step proportional to the gradient
    one_step = ("--num-rollout", "1", "--skip-eval-before-train", "--dump-samples", "0", "--no-use-tensorboard",
                "--adam-eps", "1.0")
    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path / "two", "--placement", "ray", "--resource",
                                       '{"actor": [2, 1], "rollout": [1, 1]}', *one_step))

    def check(service):
        ranks = [report for name, report in service.health().items() if report["role"] == "actor"]
        assert sorted(report["rank"] for report in ranks) == [0, 1]
        engine, trainer = service.engine_weights(), service.trainer_weights()
        for name, tensor in trainer.items():
            assert torch.equal(engine[name], tensor), name
        return trainer

    two_ranks = _run_with_ray(cfg, check)
    reference = parse_config(tiny_train_args(tiny_workspace, tmp_path / "one", *one_step))
    roles = build_roles(reference)
    with Tracker(reference.output_dir, use_tensorboard=False) as tracker:
        asyncio.run(loop_class(reference)(reference, InProcessPlacement(reference, roles), tracker).run())
    one_process = {name: p.detach() for name, p in roles.actor.backend.model.hf_model.named_parameters()}
    for name, tensor in two_ranks.items():
        torch.testing.assert_close(tensor, one_process[name], atol=1e-6, rtol=1e-5, msg=name)
    loss = [row["train/loss"] for row in read_metrics(tmp_path / "two" / "metrics.jsonl") if "train/loss" in row]
    expected = [row["train/loss"] for row in read_metrics(tmp_path / "one" / "metrics.jsonl") if "train/loss" in row]
    assert loss == pytest.approx(expected, abs=1e-6)


@needs_ray
def test_two_actor_ranks_train_each_step_as_it_arrives_from_keys_as_one_process_does(tiny_workspace, tmp_path,
                                                                                      ray_guard):
    """`--fully-async` with `{"actor": [2, 1]}` and `--tensor-model-parallel-size 2` (the two Ray processes are one
    tensor-parallel group; the sync test above has them as two FSDP2 data ranks): the controller passes each chunk's
    TransferQueue keys, both ranks read the samples there, train on each chunk, and take one optimizer step at the
    step's end; the update is the one the in-process run takes on the whole step (the same samples: on-policy, same
    seed), and the weights the engine is sent are the full tensors."""
    from relax.core.build import build_roles
    from relax.core.loops import loop_class
    from relax.core.placement.in_process import InProcessPlacement

    # (--adam-eps: see the sync test above; a group per engine batch and the serial reward space the groups'
    # arrivals 0.4 s apart, so the trainer takes the step in several chunks)
    one_step = ("--fully-async", "--max-staleness", "0", "--num-rollout", "1", "--skip-eval-before-train",
                "--dump-samples", "0", "--no-use-tensorboard", "--adam-eps", "1.0", "--rollout-max-batch-size", "4",
                "--custom-rm-path", "tests.support.e2e_rewards:digit_fraction_serial")
    cfg = parse_config(tiny_train_args(tiny_workspace, tmp_path / "two", "--placement", "ray", "--resource",
                                       '{"actor": [2, 1], "rollout": [1, 1]}', "--tensor-model-parallel-size", "2",
                                       *one_step))
    two_ranks = _run_with_ray(cfg, lambda service: service.trainer_weights())
    [row] = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert row["perf/train_chunks"] > 1 and row["data/passed_by_key_fraction"] == 1.0, row
    whole = parse_config(tiny_train_args(tiny_workspace, tmp_path / "one", *one_step, "--train-stream-chunks", "1"))
    roles = build_roles(whole)
    with Tracker(whole.output_dir, use_tensorboard=False) as tracker:
        asyncio.run(loop_class(whole)(whole, InProcessPlacement(whole, roles), tracker).run())
    [expected] = read_metrics(tmp_path / "one" / "metrics.jsonl")
    assert "perf/train_chunks" not in expected
    for key in ("train/loss", "train/grad_norm", "train/advantage_abs_mean", "rollout/reward_mean"):
        assert row[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    one_process = {name: p.detach() for name, p in roles.actor.backend.model.hf_model.named_parameters()}
    for name, tensor in two_ranks.items():
        torch.testing.assert_close(tensor, one_process[name], atol=1e-6, rtol=1e-5, msg=name)


# a sharded trainer behind each transport: two actor processes as one tensor-parallel group, or as two pipeline stages
SHARDED_ACTOR = {"tensor": ("--resource", '{"actor": [2, 1], "rollout": [1, 1]}', "--tensor-model-parallel-size", "2"),
                 "pipeline": ("--resource", '{"actor": [2, 1], "rollout": [1, 1]}', "--pipeline-model-parallel-size",
                              "2"),
                 None: ()}


@needs_ray
@pytest.mark.parametrize("mode, transport, sharded", [("--fully-async", "broadcast", "tensor"),
                                                      ("--fully-async", "disk", "pipeline"),
                                                      pytest.param("--hybrid", "disk", None, marks=pytest.mark.slow)])
def test_async_modes_in_ray_processes_account_every_group_once(tiny_workspace, tmp_path, ray_guard, mode, transport,
                                                               sharded):
    """Over broadcast the controller pushes each version; over disk the actor publishes and the rollout's engines
    follow the published versions themselves (nothing waits for the generation in flight), and the run ends with
    the engine serving its last version, equal to the trainer's weights. The fully-async runs train a sharded actor
    (tensor-parallel over broadcast, two pipeline stages over disk): each transport sends the full tensors."""
    out = tmp_path / mode.strip("-")
    cfg = parse_config(tiny_train_args(tiny_workspace, out, "--placement", "ray", mode, "--max-staleness", "1",
                                       "--weight-sync-transport", transport, *SHARDED_ACTOR[sharded], *RUN))
    assert _run_with_ray(cfg, _weights_equal) > 0
    rows = _assert_finite_losses(out)
    for row in rows:  # exactly once: each step's 4 groups produced by the rollout process, consumed here
        assert row["data/produced_groups"] == row["data/consumed_groups"] == 4, row
        assert row["data/outstanding_groups"] == 0
    if transport == "disk":
        assert (out / "weight_sync").is_dir()
        assert all(row["perf/weight_push_wait_s"] == 0.0 for row in rows)
        pulled = sum(row.get("perf/weight_pull_versions", 0) for row in rows)
        assert 1 <= pulled <= 3, pulled  # the engines loaded versions themselves (the last one at the end of the run)
        lags = [row["perf/rollout_version_lag"] for row in rows]
        assert max(lags) <= 1, lags


@needs_ray
@pytest.mark.slow
def test_in_process_checkpoint_resumes_under_ray_placement(tiny_workspace, tmp_path, ray_guard):
    first = tmp_path / "in_process"
    result = run_relax("train", *tiny_train_args(tiny_workspace, first, "--num-rollout", "2", "--save-interval", "2",
                                                 "--skip-eval-before-train", "--dump-samples", "0"))
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = tmp_path / "ray_resumed"
    result = run_relax("train", *tiny_train_args(tiny_workspace, resumed, "--placement", "ray", "--load", str(first),
                                                 "--num-rollout", "3", "--skip-eval-before-train", "--dump-samples",
                                                 "0", "--use-health-check", "--heartbeat-timeout-s", "600"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [row for row in read_metrics(resumed / "metrics.jsonl") if "train/loss" in row]
    assert len(rows) == 1 and math.isfinite(rows[0]["train/loss"])
    assert_ended_healthy(resumed)
