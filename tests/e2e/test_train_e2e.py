"""The whole colocated loop through the `relax` command: run directory, kill-and-resume,
export, eval, and bad inputs that fail before any work."""

import json
import math
import signal
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax.core.state.checkpoint import load_hf_model_from_checkpoint
from relax.telemetry.metrics_file import read_metrics
from tests.support.runs import popen_relax, run_relax, tiny_train_args
from tests.support.waits import PROCESS_PATIENCE_S, wait_until


@pytest.fixture(scope="module")
def finished_run(tiny_workspace, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "full"
    result = run_relax("train", *tiny_train_args(tiny_workspace, run_dir, "--num-rollout", "6", "--save-interval", "2",
                                                 "--eval-interval", "3", "--global-batch-size", "8"))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_run_directory_holds_config_metrics_plots_samples_checkpoints(finished_run):
    metrics = read_metrics(finished_run / "metrics.jsonl")
    assert [row["step"] for row in metrics] == [0, 1, 2, 3, 4, 5, 6]
    step = metrics[1]
    for key in ("rollout/reward_mean", "rollout/accuracy", "rollout/response_length_mean", "train/loss",
                "train/pg_loss", "train/clipfrac", "train/ppo_kl", "train/entropy", "train/grad_norm", "train/lr",
                "perf/step_s", "reward/num_errors"):
        assert key in step and step[key] is not None and math.isfinite(step[key]), key
    assert step["train/optimizer_steps"] == 2.0  # 16 samples per rollout, 8 per optimizer step
    assert [row["step"] for row in metrics if "eval/accuracy" in row] == [0, 3, 6]
    assert (finished_run / "config.yaml").is_file() and (finished_run / "run.log").is_file()
    assert list((finished_run / "tensorboard").glob("events.out.tfevents.*"))
    for name in ("reward", "accuracy", "loss", "kl", "response_length"):
        assert (finished_run / "plots" / f"{name}.png").stat().st_size > 1000, name
    # a curve at 0 on every step says nothing and is not drawn (relax.telemetry.plots._informative)
    clipped = any(row.get("train/clipfrac") for row in metrics)
    assert (finished_run / "plots" / "clip_fraction.png").is_file() == clipped
    dumped = [json.loads(line) for line in (finished_run / "samples" / "rollout_000001.jsonl").read_text().splitlines()]
    assert dumped and {"prompt", "response", "reward", "tokens", "rollout_log_probs"} <= set(dumped[0])
    checkpoints = finished_run / "checkpoints"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert {p.name for p in checkpoints.glob("iter_*")} == {"iter_0000002", "iter_0000004", "iter_0000006"}


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("perf/")}


def _kill_after_first_checkpoint_then_resume(args: list[str], run_dir: Path, total_steps: int) -> list[dict]:
    """Start `relax train`, SIGKILL it once a checkpoint exists, resume with --load; the metrics."""
    process = popen_relax("train", *args)
    latest = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    try:
        wait_until(latest.is_file, PROCESS_PATIENCE_S, "the first checkpoint", process=process, interval_s=0.05)
    finally:
        process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    killed_at = int(latest.read_text())
    assert killed_at < total_steps, "the run finished before it could be killed"
    result = run_relax("train", *args, "--load", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(run_dir / "metrics.jsonl")


def _assert_same_metrics(resumed: list[dict], reference: list[dict]) -> None:
    assert [row["step"] for row in resumed] == [row["step"] for row in reference]  # no duplicated or lost steps
    for mine, theirs in zip(resumed, reference):
        mine, theirs = _comparable(mine), _comparable(theirs)
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (mine["step"], key)


def test_sigkill_then_resume_logs_the_same_metrics(tiny_workspace, finished_run, tmp_path):
    run_dir = tmp_path / "killed"
    args = tiny_train_args(tiny_workspace, run_dir, "--num-rollout", "6", "--save-interval", "2",
                           "--eval-interval", "3", "--global-batch-size", "8")
    resumed = _kill_after_first_checkpoint_then_resume(args, run_dir, total_steps=6)
    _assert_same_metrics(resumed, read_metrics(finished_run / "metrics.jsonl"))


def test_sigkill_then_resume_with_critic_and_dynamic_sampling(tiny_workspace, tmp_path):
    """The critic's weights and optimizer and the data cursor moved by dynamic sampling's refills
    come back too: the resumed run logs exactly what an uninterrupted one does."""

    def args(run_dir):
        return tiny_train_args(
            tiny_workspace, run_dir, "--num-rollout", "5", "--save-interval", "2", "--advantage-estimator", "ppo",
            "--critic-lr", "1e-3", "--lambd", "0.9", "--custom-rm-path", "tests.support.e2e_rewards:constant_on_even_rows",
            "--dynamic-sampling-filter-path", "relax.rollout.filters.dynamic_sampling:check_reward_nonzero_std",
        )

    reference = run_relax("train", *args(tmp_path / "full"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    reference_metrics = read_metrics(tmp_path / "full" / "metrics.jsonl")
    assert any(row.get("rollout/dynamic_filter_dropped_groups", 0) > 0 for row in reference_metrics)
    resumed = _kill_after_first_checkpoint_then_resume(args(tmp_path / "killed"), tmp_path / "killed", total_steps=5)
    _assert_same_metrics(resumed, reference_metrics)


def test_export_writes_a_folder_transformers_loads_and_generates(tiny_workspace, finished_run, tmp_path):
    out = tmp_path / "exported"
    result = run_relax("export", str(finished_run / "checkpoints"), str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("1+2=", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    # The exported weights are the trained ones: equal to the checkpoint, different from the start.
    trained, _ = load_hf_model_from_checkpoint(finished_run)
    initial = AutoModelForCausalLM.from_pretrained(tiny_workspace / "model")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained.state_dict()[name]), name
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, initial.model.layers[0].mlp.up_proj.weight)


def test_eval_of_checkpoint_and_exported_folder_agree(tiny_workspace, finished_run, tmp_path):
    out = tmp_path / "exported"
    assert run_relax("export", str(finished_run), str(out)).returncode == 0
    common = ["--eval-prompt-data", "held_out", str(tiny_workspace / "test.jsonl"),
              "--custom-rm-path", "tests.support.e2e_rewards:digit_fraction", "--rollout-max-response-len", "4"]
    from_checkpoint = run_relax("eval", "--load", str(finished_run), *common)
    from_folder = run_relax("eval", "--hf-checkpoint", str(out), *common)
    assert from_checkpoint.returncode == 0, from_checkpoint.stderr[-3000:]
    assert from_folder.returncode == 0, from_folder.stderr[-3000:]
    assert "held_out: accuracy" in from_checkpoint.stdout
    assert from_checkpoint.stdout == from_folder.stdout
    final_eval = read_metrics(finished_run / "metrics.jsonl")[-1]["eval/held_out/reward_mean"]
    assert f"reward {final_eval:.4f}" in from_checkpoint.stdout


def test_custom_reward_that_does_not_import_fails_up_front(tiny_workspace, tmp_path):
    run_dir = tmp_path / "bad"
    args = tiny_train_args(tiny_workspace, run_dir, "--num-rollout", "1")
    args[args.index("tests.support.e2e_rewards:digit_fraction")] = "tests.no_such_module:fn"
    result = run_relax("train", *args)
    assert result.returncode == 2
    assert "tests.no_such_module:fn" in result.stderr
    assert not (run_dir / "metrics.jsonl").exists()


def test_missing_prompt_key_fails_naming_the_row(tiny_workspace, tmp_path):
    result = run_relax("train", *tiny_train_args(tiny_workspace, tmp_path / "r", "--num-rollout", "1",
                                                 "--input-key", "question"))
    assert result.returncode == 2
    assert "train.jsonl: row 1: missing prompt field 'question' (set --input-key)" in result.stderr


def test_a_reward_that_raises_gives_zero_is_counted_and_logged_once(tiny_workspace, tmp_path):
    run_dir = tmp_path / "r"
    args = tiny_train_args(tiny_workspace, run_dir, "--num-rollout", "2", "--skip-eval-before-train")
    args[args.index("tests.support.e2e_rewards:digit_fraction")] = "tests.support.e2e_rewards:fails_on_odd_index"
    result = run_relax("train", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert all(row["reward/num_errors"] > 0 for row in metrics)
    log = (run_dir / "run.log").read_text()
    assert log.count("reward failed for") == 1 and "RuntimeError: reward server said no" in log


def test_kl_loss_against_the_frozen_reference_with_an_entropy_bonus(tiny_workspace, tmp_path):
    run_dir = tmp_path / "kl"
    result = run_relax("train", *tiny_train_args(
        tiny_workspace, run_dir, "--num-rollout", "2", "--skip-eval-before-train", "--use-kl-loss",
        "--kl-loss-coef", "0.1", "--kl-loss-type", "low_var_kl", "--entropy-coef", "0.01",
        "--calculate-per-token-loss", "--lr-warmup-steps", "1", "--lr-decay-style", "cosine"))
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = read_metrics(run_dir / "metrics.jsonl")
    # Before the first update the policy is the reference: KL is exactly 0; after it, positive.
    assert first["train/kl_loss"] == 0.0
    assert second["train/kl_loss"] > 0.0
    assert first["train/loss"] == pytest.approx(first["train/pg_loss"] - 0.01 * first["train/entropy"], abs=1e-6)
