"""Reward models (issue 34) end to end on the tiny model: `relax train --loss-type rm` trains a scalar head with the
Bradley-Terry loss, its update does not depend on how the completions are split into micro-batches, its evaluation
ranks held-out pairs; `relax export` writes a folder that `AutoModelForSequenceClassification` loads and that scores
the held-out pairs exactly as the trainer did; `--rm-path` makes it the reward of an RL run whose held-out sets a rule
grades (`--eval-rm-type`); the flags that cannot apply are refused naming them."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from relax.cli.args import parse_config
from relax.config import ConfigError
from relax.core.loops.preference import score_position
from relax.core.roles import roles_for_config
from relax.data.dataset import PromptFormat
from relax.data.preference_dataset import load_preference_pairs, pair_samples
from relax.telemetry.metrics_file import read_metrics
from tests.support.runs import run_relax


def _pairs(source, path, margin: bool = False):
    """Pairs from addition rows: the right sum chosen, a sum off by one rejected (and a margin, when asked)."""
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    path.write_text("".join(json.dumps({"input": r["input"], "chosen": r["label"], "rejected": str(int(r["label"]) + 1),
                                        **({"margin": 0.5} if margin else {})}) + "\n" for r in rows))
    return path


def _rm_args(workspace, tmp_path, out, *extra):
    pairs = _pairs(workspace / "train.jsonl", tmp_path / "pairs.jsonl")
    held_out = _pairs(workspace / "test.jsonl", tmp_path / "held_out_pairs.jsonl")
    return ["train", "--hf-checkpoint", str(workspace / "model"), "--prompt-data", str(pairs), "--loss-type", "rm",
            "--rollout-batch-size", "8", "--lr", "1e-3", "--eval-prompt-data", "held_out", str(held_out),
            "--eval-interval", "100", "--output-dir", str(out), *extra]


def _rows(out):
    return [row for row in read_metrics(out / "metrics.jsonl") if "train/loss" in row]


def test_reward_model_trains_ranks_held_out_pairs_and_exports_for_sequence_classification(tiny_workspace, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    for out, micro in ((whole, "16"), (split, "1")):
        result = run_relax(*_rm_args(tiny_workspace, tmp_path, out, "--num-rollout", "6", "--micro-batch-size", micro))
        assert result.returncode == 0, result.stderr[-2000:]
    assert roles_for_config(parse_config(_rm_args(tiny_workspace, tmp_path, whole)[1:])) == ("actor", "rollout")
    rows = _rows(whole)
    assert len(rows) == 6 and all(math.isfinite(r["train/loss"]) for r in rows)
    for a, b in zip(rows, _rows(split)):  # one completion per micro-batch: the same steps
        for key in ("train/loss", "train/rewards_margin", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    evaluations = [r for r in read_metrics(whole / "metrics.jsonl") if "eval/held_out/pair_accuracy" in r]
    assert [r["step"] for r in evaluations] == [0, 6]
    assert evaluations[-1]["eval/accuracy"] == evaluations[-1]["eval/held_out/pair_accuracy"]

    exported = tmp_path / "rm"
    result = run_relax("export", str(whole), str(exported))
    assert result.returncode == 0, result.stderr[-2000:]
    model = AutoModelForSequenceClassification.from_pretrained(exported).eval()
    assert type(model).__name__ == "Qwen3ForSequenceClassification" and model.config.num_labels == 1
    # The export scores the held-out pairs as the trainer's last evaluation did (same pooling position).
    tokenizer = AutoTokenizer.from_pretrained(exported)
    pairs = pair_samples(load_preference_pairs(str(tmp_path / "held_out_pairs.jsonl"), tokenizer,
                                               PromptFormat(input_key="input"), "chosen", "rejected"))
    with torch.no_grad():
        scores = [model(input_ids=torch.tensor([s.tokens])).logits.item() for s in pairs]
    accuracy = sum(c > r for c, r in zip(scores[0::2], scores[1::2])) / (len(pairs) // 2)
    assert accuracy == pytest.approx(evaluations[-1]["eval/held_out/pair_accuracy"], abs=1e-9)
    margin = sum(c - r for c, r in zip(scores[0::2], scores[1::2])) / (len(pairs) // 2)
    assert margin == pytest.approx(evaluations[-1]["eval/held_out/margin"], rel=1e-3, abs=1e-4)

    # --rm-path: the exported model rewards an RL run; a rule grades its held-out set.
    out = tmp_path / "rl"
    result = run_relax("train", "--hf-checkpoint", str(tiny_workspace / "model"), "--prompt-data",
                       str(tiny_workspace / "train.jsonl"), "--rm-path", str(exported), "--eval-rm-type", "exact_match",
                       "--eval-prompt-data", "held_out", str(tiny_workspace / "test.jsonl"),
                       "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4", "--num-rollout", "2",
                       "--output-dir", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = read_metrics(out / "metrics.jsonl")
    trained = [r for r in metrics if "rollout/reward_mean" in r]
    assert len(trained) == 2 and all(r["reward/rm_scores"] == 16 for r in trained)
    assert all(r.get("reward/num_errors", 0) == 0 for r in trained)
    # the rewards are the model's scores (real numbers), the held-out accuracy the rule's (a share of 16 prompts)
    assert any(r["rollout/reward_mean"] not in (0.0, 1.0) for r in trained)
    assert not any("rollout/accuracy" in r for r in trained)  # a score is not a verdict: no accuracy from it
    assert all(abs(r["eval/accuracy"] * 16 - round(r["eval/accuracy"] * 16)) < 1e-9
               for r in metrics if "eval/accuracy" in r)

    # `relax eval` grades with --eval-rm-type too, shows no accuracy for a reward model's scores, and refuses a
    # reward model's own run (its evaluation is the pair accuracy in its metrics)
    base = ["eval", "--hf-checkpoint", str(tiny_workspace / "model"), "--rm-path", str(exported),
            "--eval-prompt-data", "held_out", str(tiny_workspace / "test.jsonl"), "--rollout-max-response-len", "4"]
    graded = run_relax(*base, "--eval-rm-type", "exact_match")
    assert graded.returncode == 0 and "held_out: accuracy " in graded.stdout, graded.stderr[-2000:]
    scored = run_relax(*base)
    assert scored.returncode == 0 and "held_out: reward " in scored.stdout, scored.stderr[-2000:]
    refused = run_relax("eval", "--load", str(whole))
    assert refused.returncode != 0 and "held-out pair accuracy, is in its metrics.jsonl" in refused.stderr


def test_score_position_is_the_last_token_that_is_not_padding():
    from relax.data.sample import Sample

    sample = Sample(tokens=[5, 6, 7, 8, 0, 0], response_length=4)
    assert score_position(sample, pad_token_id=0) == 1
    assert score_position(sample, pad_token_id=9) == 3
    with pytest.raises(ValueError, match="all padding"):
        score_position(Sample(index=3, tokens=[5, 0, 0], response_length=2), pad_token_id=0)


def test_a_margin_field_is_read_and_checked(tiny_workspace, tmp_path):
    path = _pairs(tiny_workspace / "test.jsonl", tmp_path / "margins.jsonl", margin=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_workspace / "model")
    pairs = load_preference_pairs(str(path), tokenizer, PromptFormat(input_key="input"), "chosen", "rejected",
                                  margin_key="margin")
    assert {p.metadata["margin"] for p in pairs} == {0.5}
    for bad in ("1.0", None, float("nan"), True):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rows[2]["margin"] = bad
        (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(ValueError, match=r"bad.jsonl.*(row|line) 3.*'margin'"):
            load_preference_pairs(str(tmp_path / "bad.jsonl"), tokenizer, PromptFormat(input_key="input"), "chosen",
                                  "rejected", margin_key="margin")


def test_reward_model_with_context_parallel_ranks_takes_the_single_process_steps(tiny_workspace, tmp_path):
    """`relax train --loss-type rm --context-parallel-size 2` on two ranks: each rank holds half of
    every packed row's tokens; a completion's score is read at its last token on whichever rank holds it (the trainer
    scores each response token at its own position) and gathered; three steps give the one-process run's losses,
    scores and held-out pair accuracy."""
    from tests.support.runs import assert_ranks_take_the_one_process_steps

    one, two = assert_ranks_take_the_one_process_steps(
        lambda out, *extra: _rm_args(tiny_workspace, tmp_path, out, "--num-rollout", "3", "--clip-grad", "1.0",
                                     "--eval-interval", "3", *extra),
        tmp_path, 3, "--context-parallel-size", "2", abs_tol=1e-6)
    evals = [[row["eval/accuracy"] for row in read_metrics(out / "metrics.jsonl") if "eval/accuracy" in row]
             for out in (one, two)]
    assert evals[0] == pytest.approx(evals[1]) and len(evals[0]) == 2  # before training and after step 3


@pytest.mark.parametrize("extra, named", [
    (["--global-batch-size", "8"], "--global-batch-size must be 2 x --rollout-batch-size = 16"),
    (["--fully-async"], "--loss-type rm has no rollout to run asynchronously"),
    (["--rm-type", "exact_match"], "--rm-type: --loss-type rm generates nothing to reward"),
    (["--eval-rm-type", "exact_match"], "--eval-rm-type: --loss-type rm generates nothing to reward"),
    (["--lora-rank", "4"], "--loss-type rm with --lora-rank is not built yet"),
])
def test_reward_model_flags_that_cannot_apply_are_refused_naming_them(tiny_workspace, tmp_path, extra, named):
    args = _rm_args(tiny_workspace, tmp_path, tmp_path / "x")[1:]
    with pytest.raises(ConfigError) as err:
        parse_config([*args, *extra])
    assert named in str(err.value)


@pytest.mark.parametrize("extra, named", [
    (["--margin-key", "margin"], "--margin-key: settings of --loss-type rm, which this run is not"),
    (["--dpo-beta", "0.5"], "--dpo-beta: settings of --loss-type dpo"),
    (["--center-rewards-coefficient", "0.1"], "--center-rewards-coefficient: settings of --loss-type rm"),
    (["--eval-rm-type", "exact_match"], "--eval-rm-type grades the held-out sets"),
])
def test_reward_model_settings_elsewhere_are_refused(tiny_workspace, extra, named):
    args = ["--hf-checkpoint", str(tiny_workspace / "model"), "--prompt-data", str(tiny_workspace / "train.jsonl"),
            "--rm-type", "exact_match"]
    with pytest.raises(ConfigError) as err:
        parse_config([*args, *extra])
    assert named in str(err.value)
