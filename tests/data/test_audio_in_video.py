"""Qwen3-Omni thinker with video and its sound track (`--use-audio-in-video`; issue 18).

The prompt of a video with sound is laid out as transformers' Qwen3-Omni processor lays it out (audio start, the
video's tokens and the track's tokens merged by time, audio end, inside the vision start/end), the trainer's and the
engine's forwards take the 3D positions the model's own forward computes with ``use_audio_in_video=True``, a silent
video gets silence of its length, and a run trains with the engine's log-probs equal to the trainer's.
"""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from relax.backends.models.family import load_model
from relax.data.multimodal import MultimodalSettings
from relax.data.sample import Sample
from relax.rollout.generation.multimodal import MultimodalPreparer
from relax.telemetry.metrics_file import read_metrics
from tests.support.rope_checks import ours_and_native_logits
from tests.support.tiny_mm_assets import build_tiny_omni, build_tiny_qwen3_omni, make_video_rows

SETTINGS = MultimodalSettings(video_min_token_num=4, video_max_token_num=16, use_audio_in_video=True)


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_omni")
    folder = build_tiny_qwen3_omni(root)
    rows_path = make_video_rows(root, 4, sound=True)  # rows 1 and 3 have sound, 2 and 4 are silent
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = AutoConfig.from_pretrained(folder)
    preparer = MultimodalPreparer(tokenizer, config, folder, SETTINGS, None, {}, pool_size=1, skip_bad_samples=False)
    samples = [Sample(index=i, prompt=row["prompt"] + " <audio>" if i == 2 else row["prompt"],
                      multimodal_inputs={"video": [str(rows_path.parent / row["videos"][0])],
                                         **({"audio": [str(rows_path.parent / row["videos"][0])]} if i == 2 else {})})
               for i, row in enumerate(rows)]
    ready, skipped = asyncio.run(preparer.prepare(samples))
    preparer.close()
    assert skipped == 0
    return SimpleNamespace(folder=folder, rows=rows_path, tokenizer=tokenizer, config=config, samples=ready)


def _hf_layout(config, inputs, video: int, audio_tokens: int, tokenizer) -> list[int]:
    """transformers' own Qwen3-Omni processor rule, called on the video's grid and the track's token count."""
    from transformers import Qwen3OmniMoeProcessor

    processor = SimpleNamespace(audio_bos_token="<|audio_start|>", audio_eos_token="<|audio_end|>",
                                video_token="<|video_pad|>", audio_token="<|audio_pad|>",
                                video_processor=SimpleNamespace(merge_size=2))
    text = Qwen3OmniMoeProcessor.replace_video_with_audio_token(
        processor, {"video_grid_thw": inputs["video_grid_thw"].numpy(),
                    "video_second_per_grid": inputs["video_second_per_grid"].numpy()},
        video, {"num_audio_tokens": [audio_tokens]}, 0, position_id_per_seconds=config.position_id_per_seconds)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_video_with_sound_is_laid_out_as_transformers_lays_it_out(omni):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    audio_pad, video_pad, vision_start, audio_start = omni.tokenizer.convert_tokens_to_ids(
        ["<|audio_pad|>", "<|video_pad|>", "<|vision_start|>", "<|audio_start|>"])
    for sample in omni.samples:
        inputs = sample.multimodal_train_inputs
        frames = inputs["feature_attention_mask"].sum(-1)
        track_tokens = int(_get_feat_extract_output_lengths(frames[0], omni.config.audio_config.n_window))
        expected = _hf_layout(omni.config, inputs, 0, track_tokens, omni.tokenizer)
        start = sample.tokens.index(vision_start) + 1
        assert sample.tokens[start:start + len(expected)] == expected
        assert sample.tokens[start] == audio_start and expected.count(audio_pad) == track_tokens
        video_tokens = int(inputs["video_grid_thw"][0].prod()) // 4
        assert sample.tokens.count(video_pad) == video_tokens
    # the row with a standalone audio item after its video: the video's track is the first audio item (its place
    # in the prompt), the standalone one the second, with its own placeholder run after the video's
    mixed = next(s for s in omni.samples if s.index == 2)
    frames = mixed.multimodal_train_inputs["feature_attention_mask"].sum(-1)
    assert len(frames) == 2
    track, standalone = (int(_get_feat_extract_output_lengths(n, omni.config.audio_config.n_window)) for n in frames)
    assert mixed.tokens.count(audio_pad) == track + standalone
    tail = mixed.tokens[mixed.tokens.index(omni.tokenizer.convert_tokens_to_ids("<|vision_end|>")):]
    assert tail.count(audio_pad) == standalone


def test_a_silent_video_gets_silence_of_its_length(omni):
    silent = next(s for s in omni.samples if s.index == 1)
    frames = silent.multimodal_train_inputs["feature_attention_mask"].sum(-1)
    assert int(frames[0]) == 200  # 2 s (8 frames at 4 fps) of 10 ms mel frames
    assert silent.multimodal_train_inputs["input_features"][0][:, :200].std() < 1e-3  # silence is flat


def test_the_trainers_positions_are_the_models_own_with_use_audio_in_video(omni):
    """Our rope positions (found from the tokens: a vision start right before an audio start) and the model's
    own forward with ``use_audio_in_video=True`` and no positions give the same logits; without the flag the
    model's forward would place the tokens elsewhere."""
    model = load_model(omni.folder, torch.float32).eval()
    for sample in omni.samples:
        ours, native = ours_and_native_logits(model, sample, use_audio_in_video=True)
        _, wrong = ours_and_native_logits(model, sample, use_audio_in_video=False)
        assert torch.allclose(ours, native, atol=1e-5)
        assert not torch.allclose(ours, wrong, atol=1e-3)


def test_a_run_trains_on_videos_with_their_sound(omni, tmp_path):
    from tests.backends.models.test_model_families import LOG_PROB_TOLERANCE, _train

    run_dir = tmp_path / "run"
    data = ["--prompt-data", str(omni.rows), "--input-key", "prompt", "--label-key", "label", "--multimodal-keys",
            json.dumps({"video": "videos"}), "--apply-chat-template", "--use-audio-in-video",
            "--video-min-token-num", "4", "--video-max-token-num", "16"]
    assert _train(omni.folder, data, run_dir, 2) == 0
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert math.isfinite(row["train/loss"]) and abs(row["train/tis_mismatch_kl"]) < LOG_PROB_TOLERANCE, row


def test_use_audio_in_video_is_refused_where_it_cannot_work(omni, tmp_path, capsys):
    from tests.backends.models.test_model_families import _train

    videos = ["--prompt-data", str(omni.rows), "--input-key", "prompt", "--label-key", "label",
              "--apply-chat-template", "--use-audio-in-video"]
    assert _train(omni.folder, [*videos, "--multimodal-keys", json.dumps({"image": "images"})], tmp_path / "a", 1) == 2
    assert "--use-audio-in-video gives each video its sound track: it needs video" in capsys.readouterr().err
    qwen25 = build_tiny_omni(tmp_path)
    assert _train(qwen25, [*videos, "--multimodal-keys", json.dumps({"video": "videos"})], tmp_path / "b", 1) == 2
    assert "the Qwen3-Omni thinker does" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_video_sound_reads_the_track_or_makes_silence(omni):
    from relax.data.multimodal.audio import video_sound
    from relax.data.multimodal.settings import VisionSpec
    from relax.data.multimodal.video import fetch_video

    rows = [json.loads(line) for line in omni.rows.read_text().splitlines()]
    for index, row in enumerate(rows):
        path = str(omni.rows.parent / row["videos"][0])
        clip = fetch_video(path, SETTINGS, VisionSpec(patch_size=16))
        track = video_sound(path, clip, 16000)
        assert track.dtype == np.float32 and abs(len(track) - 32000) < 2048
        assert (np.abs(track).max() > 0.1) == (index % 2 == 0)  # rows 1 and 3 (index 0, 2) have sound


def test_the_engine_never_writes_media_boundaries(omni, tmp_path):
    """A response holding a vision start would read as "media follows" to the families' 3D rope (transformers'
    Qwen3-Omni rope index then fails on it): the engine masks the boundaries with the placeholders."""
    from relax.backends.models.family import MediaTokens
    from tests.support.tiny_mm_assets import build_tiny_vl

    ids = omni.tokenizer.convert_tokens_to_ids
    never = MediaTokens.of(omni.config).never_generated
    assert {ids("<|vision_start|>"), ids("<|audio_start|>"), ids("<|audio_pad|>"), ids("<|video_pad|>")} <= set(never)
    vl = MediaTokens.of(AutoConfig.from_pretrained(build_tiny_vl(tmp_path)))
    assert set(vl.never_generated) == {*vl.ids, *vl.boundaries} and len(vl.boundaries) == 2
