"""`relax train --loss-type dpo` (issue 34) end to end on the tiny model: the first step's loss is ln 2 with zero
rewards (the policy is the reference), training raises the implicit reward accuracy, the update does not depend on how
the completions are split into micro-batches (the per-completion gradient surrogate is exact), SimPO runs without a
reference model, the trained policy exports as a Hugging Face model, and the flags that cannot apply are refused
naming them."""

from __future__ import annotations

import json
import math

import pytest
from transformers import AutoModelForCausalLM

from relax.cli.args import parse_config
from relax.config import ConfigError
from relax.core.roles import roles_for_config
from relax.telemetry.metrics_file import read_metrics
from tests.support.runs import run_relax


def _pairs(workspace, tmp_path):
    """Preference pairs from the tiny workspace's addition rows: the right sum chosen, the next number rejected."""
    rows = [json.loads(line) for line in (workspace / "train.jsonl").read_text().splitlines()]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"input": r["input"], "chosen": r["label"],
                                        "rejected": str(int(r["label"]) + 1)}) + "\n" for r in rows))
    return path


def _dpo_args(workspace, pairs, out, *extra):
    return ["train", "--hf-checkpoint", str(workspace / "model"), "--prompt-data", str(pairs),
            "--loss-type", "dpo", "--dpo-beta", "0.5", "--rollout-batch-size", "8", "--lr", "1e-3",
            "--rm-type", "exact_match", "--eval-prompt-data", "held_out", str(workspace / "test.jsonl"),
            "--rollout-max-response-len", "4", "--eval-interval", "100", "--output-dir", str(out), *extra]


def _rows(out):
    return [row for row in read_metrics(out / "metrics.jsonl") if "train/loss" in row]


def test_dpo_trains_and_its_update_does_not_depend_on_the_micro_batches(tiny_workspace, tmp_path):
    pairs = _pairs(tiny_workspace, tmp_path)
    whole, split = tmp_path / "whole", tmp_path / "split"
    for out, micro in ((whole, "16"), (split, "1")):
        result = run_relax(*_dpo_args(tiny_workspace, pairs, out, "--num-rollout", "6", "--micro-batch-size", micro))
        assert result.returncode == 0, result.stderr[-2000:]
    rows = _rows(whole)
    assert rows[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy == reference: Δ = 0
    assert rows[0]["train/rewards_chosen"] == pytest.approx(0.0, abs=1e-6)
    later = rows[1:]  # each step trains on new pairs: the trained policy prefers the right sums on them
    assert sum(r["train/rewards_accuracy"] for r in later) / len(later) > 0.5
    assert sum(r["train/rewards_margin"] for r in later) / len(later) > 0
    assert sum(r["train/loss"] for r in later) / len(later) < math.log(2)
    for a, b in zip(rows, _rows(split)):  # one completion per micro-batch: the same steps
        for key in ("train/loss", "train/rewards_margin", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    exported = tmp_path / "hf"
    result = run_relax("export", str(whole), str(exported))
    assert result.returncode == 0, result.stderr[-2000:]
    assert type(AutoModelForCausalLM.from_pretrained(exported)).__name__ == "Qwen3ForCausalLM"


def test_dpo_with_context_parallel_ranks_takes_the_single_process_steps(tiny_workspace, tmp_path):
    """`relax train --loss-type dpo --context-parallel-size 2` on two ranks: each rank holds half of
    every packed row's tokens (the policy's and the reference's forwards alike), the sequence log-probs are sums over
    both halves, and three steps give the one-process run's losses, implicit rewards and gradient norms."""
    from tests.support.runs import assert_ranks_take_the_one_process_steps

    pairs = _pairs(tiny_workspace, tmp_path)
    assert_ranks_take_the_one_process_steps(
        lambda out, *extra: _dpo_args(tiny_workspace, pairs, out, "--num-rollout", "3", "--clip-grad", "1.0", *extra),
        tmp_path, 3, "--context-parallel-size", "2", abs_tol=1e-6)


def test_simpo_needs_no_reference_and_the_other_variants_do(tiny_workspace, tmp_path):
    pairs = _pairs(tiny_workspace, tmp_path)
    base = _dpo_args(tiny_workspace, pairs, tmp_path / "x")[1:]
    assert "reference" in roles_for_config(parse_config(base))
    assert "reference" in roles_for_config(parse_config([*base, "--dpo-loss", "ipo"]))
    assert "reference" not in roles_for_config(parse_config([*base, "--dpo-loss", "simpo"]))
    out = tmp_path / "simpo"
    result = run_relax(*_dpo_args(tiny_workspace, pairs, out, "--dpo-loss", "simpo", "--simpo-gamma", "0.5",
                                  "--num-rollout", "3"))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = _rows(out)
    assert len(rows) == 3 and all(math.isfinite(row["train/loss"]) for row in rows)


@pytest.mark.parametrize("extra, named", [
    (["--global-batch-size", "8"], "--global-batch-size must be 2 x --rollout-batch-size = 16"),
    (["--offload"], "--loss-type dpo has no rollout phase"),
    (["--fully-async"], "--loss-type dpo has no rollout to run asynchronously"),
    (["--dpo-label-smoothing", "0.5"], "--dpo-label-smoothing"),
])
def test_flags_that_cannot_apply_are_refused_naming_them(tiny_workspace, tmp_path, extra, named):
    args = _dpo_args(tiny_workspace, _pairs(tiny_workspace, tmp_path), tmp_path / "x")[1:]
    with pytest.raises(ConfigError) as err:
        parse_config([*args, *extra])
    assert named in str(err.value)
