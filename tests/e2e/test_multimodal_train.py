"""Images, video and audio through rollout, reward and training, on tiny random Qwen2.5-VL, Qwen3-VL (dense and
MoE), Qwen3.5 and Qwen2.5-Omni models: real media files, the real engine and trainer, no stand-ins."""

import asyncio
import functools
import json
import math

import pytest
import torch

from relax.backends.models.family import MediaTokens, audio_token_count, expand_placeholders, placeholder_counts
from relax.cli.args import parse_config
from relax.config import ConfigError
from relax.core.build import build_roles
from relax.core.loops.sync import SyncController
from relax.core.placement.in_process import InProcessPlacement
from relax.data.dataset import DatasetError
from relax.data.multimodal import MediaError
from relax.telemetry.tracking import Tracker
from tests.support.tiny_mm_assets import (
    build_tiny_omni,
    build_tiny_qwen3_5_vl,
    build_tiny_qwen3_vl,
    build_tiny_vl,
    make_audio_rows,
    make_image_rows,
    make_video_rows,
)


def _args(model, rows, out, kind, *extra):
    return ["--hf-checkpoint", str(model), "--prompt-data", str(rows), "--input-key", "prompt",
            "--label-key", "label", "--multimodal-keys", json.dumps({kind: kind + "s"}), "--apply-chat-template",
            "--custom-rm-path", "tests.support.e2e_rewards:digit_fraction", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "3", "--micro-batch-size", "8", "--lr", "1e-3", "--output-dir", str(out),
            "--use-tis", "--dump-samples", "0", "--num-rollout", "2", *extra]


def _train_two_steps(cfg):
    roles = build_roles(cfg)
    tower = {n: p.detach().clone() for n, p in roles.actor.backend.model.hf_model.named_parameters()
             if ".visual." in f".{n}" or "audio_tower" in n}
    with Tracker(cfg.output_dir, use_tensorboard=False) as tracker:
        controller = SyncController(cfg, InProcessPlacement(cfg, roles), tracker)
        metrics = [asyncio.run(controller.train_step(step)) for step in range(2)]
    return roles, tower, metrics


def _encoder_moved(roles, before) -> bool:
    now = dict(roles.actor.backend.model.hf_model.named_parameters())
    return any(not torch.equal(now[name], value) for name, value in before.items())


@pytest.mark.parametrize("kind", ["image", "video", "audio", "qwen3-vl-image", "qwen3-vl-video",
                                  "qwen3-vl-moe-video", "qwen3.5-video"])
def test_media_flow_through_rollout_and_training(kind, tmp_path):
    builders = {"audio": build_tiny_omni, "qwen3-vl-image": build_tiny_qwen3_vl, "qwen3-vl-video": build_tiny_qwen3_vl,
                "qwen3-vl-moe-video": functools.partial(build_tiny_qwen3_vl, experts=True),
                "qwen3.5-video": build_tiny_qwen3_5_vl}
    model = builders.get(kind, build_tiny_vl)(tmp_path)
    kind = kind.rpartition("-")[2]
    rows = {"image": make_image_rows, "video": make_video_rows, "audio": make_audio_rows}[kind](tmp_path, 8)
    # small frames for the tiny clips (upstream's default floor, 128 tokens per frame, would upscale them)
    extra = ["--video-min-token-num", "4", "--video-max-token-num", "16"] if kind == "video" else []
    cfg = parse_config(_args(model, rows, tmp_path / "run", kind, *extra))
    roles, tower, metrics = _train_two_steps(cfg)
    for step in metrics:
        train = {k: v for k, v in step.items() if k.startswith("train/")}
        assert all(math.isfinite(v) for v in train.values()), train
        # the engine's and the trainer's log-probs of the same multimodal samples agree
        assert abs(step["train/tis_mismatch_kl"]) < 1e-3 and step["train/tis_mismatch_k3_kl"] < 1e-4
        assert step["rollout/skipped_bad_samples"] == 0
    assert _encoder_moved(roles, tower), "the gradient did not reach the encoder"
    # the engine serves the trained weights, encoder included
    engine_weights = dict(roles.rollout.engine.model.named_parameters())
    for name, param in roles.actor.backend.model.hf_model.named_parameters():
        assert torch.equal(engine_weights[name], param.detach()), name


def test_frozen_vision_tower_stays_put_and_the_rest_trains(tmp_path):
    cfg = parse_config(_args(build_tiny_vl(tmp_path), make_image_rows(tmp_path, 8), tmp_path / "run", "image",
                             "--freeze-vision-tower"))
    roles, tower, _ = _train_two_steps(cfg)
    assert not _encoder_moved(roles, tower)
    assert roles.actor.backend.optimizer.param_groups[0]["params"]  # the language model still trains


def _rewrite_rows(path, change):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    change(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_bad_media_names_the_row_and_field_or_is_skipped_and_counted(tmp_path):
    model = build_tiny_vl(tmp_path)
    rows = make_image_rows(tmp_path, 8)
    (rows.parent / "corrupt.png").write_bytes(b"not a png at all")
    _rewrite_rows(rows, lambda r: r[2].__setitem__("images", ["corrupt.png"]))
    cfg = parse_config(_args(model, rows, tmp_path / "run", "image", "--rollout-batch-size", "8"))
    roles = build_roles(cfg)
    with Tracker(cfg.output_dir, use_tensorboard=False) as tracker:
        with pytest.raises(MediaError, match=r"row 3, field 'images'\[0\]"):
            asyncio.run(SyncController(cfg, InProcessPlacement(cfg, roles), tracker).train_step(0))
    cfg = parse_config(_args(model, rows, tmp_path / "run2", "image", "--rollout-batch-size", "8",
                             "--skip-bad-samples"))
    _, _, metrics = _train_two_steps(cfg)
    assert metrics[0]["rollout/skipped_bad_samples"] == 1 and metrics[0]["rollout/num_samples"] == 7 * 4


def test_a_prompt_whose_media_fill_the_model_s_positions_names_its_row_or_is_skipped_and_counted(tmp_path, capsys):
    """A 1600-pixel image expands to 3,272 prompt tokens, past the tiny model's 1,024 positions: known only once the
    media are processed, it had reached the engine, which refused it mid-run with a traceback (exit 1, which a
    supervised run restarts into the same row)."""
    from PIL import Image

    from relax.cli.main import main

    model = build_tiny_vl(tmp_path)
    rows = make_image_rows(tmp_path, 8)
    Image.new("RGB", (1600, 1600), "white").save(rows.parent / "large.png")
    _rewrite_rows(rows, lambda r: r[2].__setitem__("images", ["large.png"]))
    args = _args(model, rows, tmp_path / "run", "image", "--rollout-batch-size", "8", "--skip-eval-before-train")
    code = main(["train", *args])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert "row 3, field 'prompt': 3272 prompt tokens with the media expanded leave no room for an answer within " \
           "the model's 1024 positions" in err
    cfg = parse_config(_args(model, rows, tmp_path / "run2", "image", "--rollout-batch-size", "8",
                             "--skip-bad-samples"))
    _, _, metrics = _train_two_steps(cfg)
    assert metrics[0]["rollout/skipped_bad_samples"] == 1 and metrics[0]["rollout/num_samples"] == 7 * 4


@pytest.mark.parametrize("change, message", [
    (lambda r: r[1].__setitem__("images", []), r"row 2.*'images'"),  # a placeholder without media
    (lambda r: r[3].__setitem__("prompt", "How many?"), r"row 4.*'images'"),  # media without a placeholder
])
def test_placeholder_mismatch_fails_at_load_naming_the_row(tmp_path, change, message):
    rows = make_image_rows(tmp_path, 6)
    _rewrite_rows(rows, change)
    cfg = parse_config(_args(build_tiny_vl(tmp_path), rows, tmp_path / "run", "image"))
    with pytest.raises(DatasetError, match=message):
        build_roles(cfg)


def test_multimodal_flags_are_checked_up_front(tmp_path):
    with pytest.raises(ConfigError, match="--multimodal-keys.*--apply-chat-template"):
        parse_config(["--multimodal-keys", '{"image": "images"}'])
    with pytest.raises(ConfigError, match="unknown media type"):
        parse_config(["--multimodal-keys", '{"picture": "images"}', "--apply-chat-template"])


def test_placeholder_expansion_arithmetic():
    tokens = MediaTokens(image=7, video=8, audio=9)
    # a 1x4x6 grid with merge 2 is 24 patches -> 6 tokens; 3000 mel frames -> 1500 -> 750 audio tokens
    counts = placeholder_counts({"image_grid_thw": torch.tensor([[1, 4, 6]]),
                                 "feature_attention_mask": torch.ones(1, 3000)}, merge_size=2)
    assert counts == {"image": [6], "audio": [750]}
    assert audio_token_count(100) == 25
    assert expand_placeholders([1, 7, 2, 9, 3], tokens, counts) == [1] + [7] * 6 + [2] + [9] * 750 + [3]
    with pytest.raises(ValueError, match="more image placeholders"):
        expand_placeholders([7, 7], tokens, {"image": [1]})
    with pytest.raises(ValueError, match="without a placeholder"):
        expand_placeholders([1], tokens, {"image": [1]})
