"""One end-to-end case per row of docs/models.md (issue 18), on a tiny random model of each family.

Each supported family runs the real loop in process (`relax train`'s own entry point): rollout on the embedded
engine (the Hugging Face decode path with the family's cache, or the engine core), reward, two training steps with
a checkpoint after each and the weights synced into the engine between them; a resumed run trains the third step
from the checkpoint; `relax export` writes a folder that transformers loads, with the trained weights. The engine's
per-token log-probs equal the trainer's forward of the same tokens at both steps (`train/tis_mismatch_kl`, which
compares them, stays at float32 rounding; after the first weight sync a stale engine would differ by far more), in
the micro-batch layout the family trains with (packed rows, or padded ones where packing cannot keep the sequences
apart). A family that is not supported yet is refused by `relax train` with its reason.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
import transformers

from relax.backends.models.registry import FAMILIES, family_of, models_markdown, traits
from relax.cli.main import main
from relax.telemetry.metrics_file import read_metrics
from tests.support.runs import ROOT
from tests.support.tiny_families import TEXT_CONFIGS, build_text_family
from tests.support.tiny_mm_assets import (
    build_tiny_omni,
    build_tiny_qwen3_5_vl,
    build_tiny_qwen3_omni,
    build_tiny_qwen3_vl,
    build_tiny_vl,
    make_audio_rows,
    make_image_rows,
)

SUPPORTED = [family for family in FAMILIES if family.not_supported is None]
MULTIMODAL = {"qwen2_5_vl": (build_tiny_vl, make_image_rows, "image"),
              "qwen3_vl": (build_tiny_qwen3_vl, make_image_rows, "image"),
              "qwen3_vl_moe": (functools.partial(build_tiny_qwen3_vl, experts=True), make_image_rows, "image"),
              "qwen2_5_omni": (build_tiny_omni, make_audio_rows, "audio"),
              "qwen3_omni_moe": (build_tiny_qwen3_omni, make_audio_rows, "audio"),
              "qwen3_5": (build_tiny_qwen3_5_vl, make_image_rows, "image")}
# float32 rounding of two different programs (the engine's decode with a cache, the trainer's packed or padded
# forward): measured <= 5e-7 per token on every family here
LOG_PROB_TOLERANCE = 1e-5


def _workspace(family, tmp_path, tiny_workspace) -> tuple:
    if family.test_id in MULTIMODAL:
        build, rows, kind = MULTIMODAL[family.test_id]
        model = build(tmp_path)
        data = ["--prompt-data", str(rows(tmp_path, 8)), "--input-key", "prompt", "--label-key", "label",
                "--multimodal-keys", json.dumps({kind: kind + "s"}), "--apply-chat-template"]
        return model, data
    model = build_text_family(family.test_id, tmp_path / family.test_id)
    return model, ["--prompt-data", str(tiny_workspace / "train.jsonl")]


def _train(model, data, run_dir, steps: int, *extra: str) -> int:
    return main(["train", "--hf-checkpoint", str(model), *data, "--custom-rm-path", "tests.support.e2e_rewards:digit_fraction",
                 "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4",
                 "--micro-batch-size", "4", "--lr", "1e-2", "--output-dir", str(run_dir), "--num-rollout", str(steps),
                 "--save-interval", "1", "--skip-eval-before-train", "--dump-samples", "0", "--no-use-tensorboard",
                 "--use-tis", *extra])


def test_every_model_type_the_issue_names_has_a_row_and_the_table_is_current():

    for model_type in ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_vl", "qwen3_vl_moe",
                       "qwen3_omni_moe", "glm4_moe", "glm_moe_dsa", "kimi_k25", "deepseek_v3", "llama"):
        assert family_of(model_type) is not None, model_type
    docs = ROOT / "docs" / "models.md"
    assert docs.read_text() == models_markdown(), "regenerate: relax model-docs > docs/models.md"
    assert {family.test_id for family in SUPPORTED} <= set(TEXT_CONFIGS) | set(MULTIMODAL)


@pytest.mark.parametrize("family", SUPPORTED, ids=[family.test_id for family in SUPPORTED])
def test_the_whole_loop_runs_on_the_family(family, tmp_path, tiny_workspace):
    model, data = _workspace(family, tmp_path, tiny_workspace)
    config = transformers.AutoConfig.from_pretrained(model)
    assert family_of(config.model_type) is family
    run_dir = tmp_path / "run"
    assert _train(model, data, run_dir, 2) == 0
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert all(math.isfinite(v) for k, v in row.items() if k.startswith("train/") and isinstance(v, float)), row
        # the engine's log-probs are the trainer's, before and after the first weight sync
        assert abs(row["train/tis_mismatch_kl"]) < LOG_PROB_TOLERANCE and row["train/tis_mismatch_k3_kl"] < 1e-8, row
    packed = traits(config).packing_unsupported is None
    log = (run_dir / "run.log").read_text()
    assert ("padded micro-batches" in log) == (not packed)

    assert _train(model, data, run_dir, 3, "--load", str(run_dir)) == 0  # resumed: step 3 from step 2's checkpoint
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert "resumed from" in (run_dir / "run.log").read_text()

    exported = tmp_path / "exported"
    assert main(["export", str(run_dir), str(exported)]) == 0
    from relax.backends.models.family import load_model

    if (Path(model) / "preprocessor_config.json").is_file():  # a vision-language export carries its processor
        assert (exported / "preprocessor_config.json").is_file()
        transformers.AutoImageProcessor.from_pretrained(exported)
    trained, base = load_model(exported, torch.float32), load_model(model, torch.float32)
    assert type(trained) is type(base)
    moved = [name for name, value in trained.state_dict().items()
             if not torch.equal(value, base.state_dict()[name])]
    assert moved, "the exported weights are the base model's"


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.not_supported], ids=lambda f: f.model_types[0])
def test_a_family_that_cannot_work_yet_is_refused_with_its_reason(family, tmp_path, tiny_workspace, capsys):
    model_type = family.model_types[0]
    if model_type not in TEXT_CONFIGS:  # a config folder is enough: the check runs before any weight is read
        folder = tmp_path / model_type
        transformers.CONFIG_MAPPING[model_type]().save_pretrained(folder)
    else:
        folder = build_text_family(model_type, tmp_path / model_type)
    assert _train(folder, ["--prompt-data", str(tiny_workspace / "train.jsonl")], tmp_path / "run", 1) == 2
    error = capsys.readouterr().err
    assert family.not_supported in error and str(folder) in error and "is not supported yet" in error
    assert not (tmp_path / "run").exists()  # refused before a run directory is made


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", SUPPORTED, ids=[family.test_id for family in SUPPORTED])
def test_the_family_trains_in_bf16_on_the_gpu(family, tmp_path, tiny_workspace):
    """The same loop on CUDA in bfloat16 for every supported row, media included (the engine core where it runs the
    family, flash/varlen attention in packed training): the engine's and the trainer's log-probs agree to bf16
    rounding, before and after the first weight sync."""
    model, data = _workspace(family, tmp_path, tiny_workspace)
    run_dir = tmp_path / "run"
    assert _train(model, data, run_dir, 2, "--device", "cuda") == 0
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert math.isfinite(row["train/loss"]) and abs(row["train/tis_mismatch_kl"]) < 0.05, row
