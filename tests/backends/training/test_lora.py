"""LoRA (``--lora-rank``, issue 18) on the real loop: only the adapters train and are checkpointed, the engine samples
with the merged weights (its log-probs equal the trainer's after each sync), a resumed run continues, and `relax
export` writes either the merged model or a peft adapter folder, which give the same logits."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from relax.backends.training.lora import LoraSettings, inject, is_adapter, merge_into_base, merged_named_weights
from relax.cli.main import main
from relax.telemetry.metrics_file import read_metrics
from tests.support.runs import tiny_train_args

LORA = ("--lora-rank", "4", "--lora-alpha", "8", "--target-modules", "linear_qkv", "linear_proj", "linear_fc1")


def _train(workspace, run_dir, steps: int, *extra: str) -> int:
    return main(["train", *tiny_train_args(workspace, run_dir, "--num-rollout", str(steps), "--save-interval", "1",
                                           "--skip-eval-before-train", "--dump-samples", "0", "--no-use-tensorboard",
                                           "--use-tis", "--lr", "1e-2", *extra)])


def _size(directory) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def test_a_lora_run_trains_adapters_only_syncs_merged_weights_resumes_and_exports(tiny_workspace, tmp_path):
    run_dir = tmp_path / "lora"
    assert _train(tiny_workspace, run_dir, 2, *LORA) == 0
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row]
    for row in rows:  # step 2 samples with step 1's merged weights: a stale or wrong merge would differ
        assert math.isfinite(row["train/loss"]) and abs(row["train/tis_mismatch_kl"]) < 1e-5, row
    log = (run_dir / "run.log").read_text()
    assert "LoRA rank 4 on ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj']" in log

    full_dir = tmp_path / "full"
    assert _train(tiny_workspace, full_dir, 2) == 0
    lora_step, full_step = (directory / "checkpoints" / "iter_0000002" for directory in (run_dir, full_dir))
    assert _size(lora_step) < 0.5 * _size(full_step)  # adapters and their optimizer state only

    assert _train(tiny_workspace, run_dir, 3, *LORA, "--load", str(run_dir)) == 0
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row] == [1, 2, 3]

    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    assert main(["export", str(run_dir), str(merged_dir)]) == 0
    assert main(["export", str(run_dir), str(adapter_dir), "--adapter"]) == 0
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_workspace / "model")
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir)
    with_adapter = PeftModel.from_pretrained(base, adapter_dir)
    ids = torch.tensor([[5, 9, 14, 3, 7, 22]])
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(ids).logits, merged(ids).logits, atol=1e-5, rtol=1e-5)
        plain = transformers.AutoModelForCausalLM.from_pretrained(tiny_workspace / "model")
        assert not torch.allclose(plain(ids).logits, merged(ids).logits, atol=1e-4)  # the adapters changed it


def test_the_merged_weights_are_what_peft_merges(tiny_workspace):
    settings = LoraSettings(rank=4, alpha=8, target_modules=("all-linear",))
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_workspace / "model")
    inject(model, settings)
    torch.manual_seed(0)
    for name, parameter in model.named_parameters():
        if is_adapter(name):
            parameter.data.normal_(std=0.1)
    assert all(p.requires_grad == is_adapter(n) for n, p in model.named_parameters())
    ours = {name: tensor.clone() for name, tensor in merged_named_weights(model)}
    theirs = merge_into_base(model).state_dict()
    assert ours.keys() == {name for name in theirs if not name.endswith("lm_head.weight") or name in ours}
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize(("args", "message"), [
    (["--lora-alpha", "16"], "--lora-alpha needs --lora-rank > 0"),
    (["--lora-rank", "4", "--target-modules", "no_such_module"], "--target-modules no_such_module"),
])
def test_lora_flags_are_checked(tiny_workspace, tmp_path, args, message, capsys):
    assert _train(tiny_workspace, tmp_path / "run", 1, *args) != 0
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("scope", "targets", "in_vision", "in_language"), [
    ("all", ("all-linear",), True, True),
    ("language", ("all-linear",), False, True),
    ("vision", ("qkv", "proj"), True, False),
])
def test_lora_scope_chooses_the_towers(tmp_path, scope, targets, in_vision, in_language):
    from relax.backends.models.family import load_model
    from tests.support.tiny_mm_assets import build_tiny_vl

    model = load_model(build_tiny_vl(tmp_path), torch.float32)
    inject(model, LoraSettings(rank=2, alpha=4, target_modules=targets, scope=scope))
    adapters = [name for name, _ in model.named_parameters() if is_adapter(name)]
    assert any(".visual." in f".{name}" for name in adapters) == in_vision
    assert any(".visual." not in f".{name}" for name in adapters) == in_language
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(adapters)


def test_lora_scope_vision_needs_named_targets(tmp_path):
    with pytest.raises(ValueError, match="--lora-scope vision needs --target-modules names"):
        LoraSettings(rank=2, alpha=4, target_modules=("all-linear",), scope="vision").peft_config()
