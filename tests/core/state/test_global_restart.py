"""Global restart (issue 17): with --max-global-restart, a run whose process is SIGKILLed midway is restarted by
its supervising parent from the newest checkpoint and logs exactly the metrics of an uninterrupted run (afresh
when no checkpoint exists yet); an error a restart would repeat ends the supervision."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from relax.core.state import checkpoint
from relax.core.state.supervisor import child_argv
from relax.telemetry.metrics_file import read_metrics
from tests.support.runs import ROOT, SUBPROCESS_TIMEOUT_S, popen_relax, run_relax, tiny_train_args
from tests.support.waits import PROCESS_PATIENCE_S, wait_until

STEPS = ("--num-rollout", "6", "--save-interval", "2")
# 16 eval calls at step 0, 16 rollout samples per step: call 72 falls in step 4, after the checkpoint of step 2
DIE_AT_CALL = 16 + 3 * 16 + 8


def _args(workspace, run_dir, reward: str, *extra: str) -> list[str]:
    args = tiny_train_args(workspace, run_dir, *STEPS, *extra)
    args[args.index("--custom-rm-path") + 1] = reward
    return args


def test_a_killed_run_is_restarted_from_its_checkpoint_and_logs_the_uninterrupted_metrics(tiny_workspace, tmp_path):
    reference_dir = tmp_path / "reference"
    reference = run_relax("train", *_args(tiny_workspace, reference_dir, "tests.support.e2e_rewards:digit_fraction"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    marker = tmp_path / "died"
    run_dir = tmp_path / "run"
    parents = tmp_path / "parents"
    env = {"RELAX_TEST_DIE_MARKER": str(marker), "RELAX_TEST_DIE_AT_CALL": str(DIE_AT_CALL),
           "RELAX_TEST_PARENTS": str(parents)}
    supervisor = popen_relax("train", *_args(tiny_workspace, run_dir,
                                             "tests.support.e2e_rewards:digit_fraction_then_die_once",
                                             "--max-global-restart", "2"), env=env)
    stdout, stderr = supervisor.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    result = subprocess.CompletedProcess(supervisor.args, supervisor.returncode, stdout, stderr)
    assert result.returncode == 0, result.stderr[-3000:]
    assert marker.exists(), "the fault was not injected"
    # Both runs were forked from one process the supervisor started (its forkserver, which imported the training code
    # once), not started by the supervisor itself: the restart did not import torch and transformers again
    (first, parent, grandparent), (second, second_parent, _) = (line.split() for line in
                                                                parents.read_text().splitlines())
    assert first != second and parent == second_parent, parents.read_text()
    assert int(parent) != supervisor.pid and int(grandparent) == supervisor.pid, (supervisor.pid, parents.read_text())
    assert "the run died (killed by SIGKILL)" in result.stderr and "restart 1 of 2" in result.stderr
    assert "restart 1 of 2" in (run_dir / "run.log").read_text()
    mine, theirs = read_metrics(run_dir / "metrics.jsonl"), read_metrics(reference_dir / "metrics.jsonl")
    assert [row["step"] for row in mine] == [row["step"] for row in theirs] == [0, 1, 2, 3, 4, 5, 6]
    for a, b in zip(mine, theirs):
        for key, value in b.items():
            if not key.startswith("perf/"):
                assert a[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (a["step"], key)


def test_a_run_killed_before_its_first_checkpoint_restarts_afresh(tiny_workspace, tmp_path):
    env = {"RELAX_TEST_DIE_MARKER": str(tmp_path / "died"), "RELAX_TEST_DIE_AT_CALL": "20"}
    result = run_relax("train", *_args(tiny_workspace, tmp_path / "run", "tests.support.e2e_rewards:digit_fraction_then_die_once",
                                       "--max-global-restart", "1"), env=env)
    # the first child dies in step 1; the restart starts afresh (no checkpoint yet) and, the fault spent, finishes
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restart 1 of 1" in result.stderr
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]["step"] == 6


def test_an_error_relax_names_is_not_restarted(tiny_workspace, tmp_path):
    run_dir = tmp_path / "run"
    assert run_relax("train", *_args(tiny_workspace, run_dir, "tests.support.e2e_rewards:digit_fraction")).returncode == 0
    for path in (run_dir / "checkpoints").glob("iter_*/trainer_state.json"):
        path.write_text("{")
    result = run_relax("train", *_args(tiny_workspace, run_dir, "tests.support.e2e_rewards:digit_fraction",
                                       "--load", str(run_dir), "--max-global-restart", "3"))
    assert result.returncode == 2 and "no usable checkpoint" in result.stderr and "restart 1 of" not in result.stderr


def test_a_restart_resumes_from_the_runs_own_checkpoints(tmp_path):
    argv = ["--output-dir", "runs/x", "--load", "elsewhere", "--overwrite", "--lr", "1e-3"]
    assert child_argv(argv, tmp_path / "none", 0) == argv
    # a restart resumes in place, with or without checkpoints yet: --load of its own save directory, never
    # --overwrite (which would delete the run.log that holds the fault)
    for restart in (1, 2):
        assert child_argv(argv, tmp_path / "none", restart) == ["--output-dir", "runs/x", "--lr", "1e-3", "--load",
                                                                 str(tmp_path / "none")]


def test_sigterm_to_the_supervisor_stops_the_run_with_a_checkpoint_and_no_restart(tiny_workspace, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_train_args(tiny_workspace, run_dir, "--num-rollout", "60", "--max-global-restart", "2")
    process = subprocess.Popen([sys.executable, "-m", "relax.cli.main", "train", *args], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    wait_until(lambda: any(r.get("step", 0) >= 1 for r in _rows(run_dir)), PROCESS_PATIENCE_S, "step 1",
               process=process, interval_s=0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=PROCESS_PATIENCE_S)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "restart 1 of" not in stderr and "stopped by SIGTERM after step" in stderr
    stopped_at = read_metrics(run_dir / "metrics.jsonl")[-1]["step"]
    assert 1 <= stopped_at < 60
    assert checkpoint.read_latest_step(run_dir / "checkpoints") == stopped_at


def _rows(run_dir):
    try:
        return read_metrics(run_dir / "metrics.jsonl")
    except (OSError, ValueError):
        return []


def test_async_save_writes_the_blocking_saves_checkpoints_and_a_killed_run_resumes_from_them(tiny_workspace, tmp_path):
    """--async-save: the checkpoints hold the same tensors as blocking saves (the state is copied when the step is
    saved, whatever the next steps change), and a run SIGKILLed while later steps train restarts from them with the
    uninterrupted metrics."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    blocking_dir = tmp_path / "blocking"
    assert run_relax("train", *_args(tiny_workspace, blocking_dir, "tests.support.e2e_rewards:digit_fraction")).returncode == 0
    run_dir = tmp_path / "async"
    env = {"RELAX_TEST_DIE_MARKER": str(tmp_path / "died"), "RELAX_TEST_DIE_AT_CALL": str(DIE_AT_CALL)}
    result = run_relax("train", *_args(tiny_workspace, run_dir, "tests.support.e2e_rewards:digit_fraction_then_die_once",
                                       "--max-global-restart", "1", "--async-save"), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restart 1 of 1" in result.stderr
    mine, theirs = read_metrics(run_dir / "metrics.jsonl"), read_metrics(blocking_dir / "metrics.jsonl")
    assert [row["step"] for row in mine] == [row["step"] for row in theirs]
    for a, b in zip(mine, theirs):
        for key, value in b.items():
            if not key.startswith("perf/"):
                assert a[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (a["step"], key)
    for step in (2, 4, 6):
        tensors = []
        for root in (blocking_dir, run_dir):
            target = tmp_path / f"{root.name}_{step}.pt"
            dcp_to_torch_save(checkpoint.iteration_dir(root / "checkpoints", step) / "model_optim", target)
            tensors.append(torch.load(target, weights_only=False))
        blocking, written_async = tensors
        names = [name for name in blocking["model"]]
        assert names and all(torch.equal(blocking["model"][n], written_async["model"][n]) for n in names), step
        assert (checkpoint.iteration_dir(run_dir / "checkpoints", step) / checkpoint.MANIFEST_FILE).is_file()


def test_async_save_is_refused_where_it_cannot_seal(tmp_path, monkeypatch):
    import relax.core.loops.sync as controller_module
    from relax.cli.args import parse_config
    from relax.config import ConfigError

    monkeypatch.setattr(controller_module, "world_size", lambda: 2)  # as under torchrun with two ranks
    with pytest.raises(ConfigError, match="--async-save seals a checkpoint from one process"):
        controller_module.SyncController(parse_config(["--async-save", "--output-dir", str(tmp_path)]), None, None)
