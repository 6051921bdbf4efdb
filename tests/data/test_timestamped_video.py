"""Video in the Qwen3-VL families (Qwen3-VL dense and MoE, Qwen3.5; issue 18).

Their processor writes a video as one block per temporal patch, each after its time in the source video
(``<1.5 seconds><|vision_start|>pads<|vision_end|>``), and their rope index splits the video's grid per patch. The
prompt Relax builds is token for token the one transformers' processor rule gives, our rope positions give the
model's own forward, and the timestamps follow the processor's rule for any frame sampling.
"""

from __future__ import annotations

import asyncio
import functools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoTokenizer, Qwen3VLProcessor

from relax.backends.models.family import has_timestamped_video, load_model
from relax.data.multimodal import MultimodalSettings, VisionSpec, fetch_video
from relax.data.multimodal.video import VideoClip
from relax.data.sample import Sample
from relax.rollout.generation.multimodal import MultimodalPreparer
from tests.support.rope_checks import ours_and_native_logits
from tests.support.tiny_mm_assets import build_tiny_qwen3_5_vl, build_tiny_qwen3_vl, make_video_rows

SETTINGS = MultimodalSettings(video_min_token_num=4, video_max_token_num=16)
BUILDERS = {"qwen3_vl": build_tiny_qwen3_vl, "qwen3_vl_moe": functools.partial(build_tiny_qwen3_vl, experts=True),
            "qwen3_5": build_tiny_qwen3_5_vl}


def _fake_processor(temporal_patch_size: int, merge_size: int = 2) -> SimpleNamespace:
    """What transformers' ``Qwen3VLProcessor.replace_video_token`` reads from its processor."""
    fake = SimpleNamespace(vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
                           video_token="<|video_pad|>",
                           video_processor=SimpleNamespace(merge_size=merge_size,
                                                           temporal_patch_size=temporal_patch_size))
    fake._calculate_timestamps = functools.partial(Qwen3VLProcessor._calculate_timestamps, fake)
    return fake


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    folder = BUILDERS[request.param](root)
    rows_path = make_video_rows(root, 3, frames=7)  # an odd frame count: the last patch repeats its last frame
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    tokenizer, config = AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder)
    preparer = MultimodalPreparer(tokenizer, config, folder, SETTINGS, None, {}, pool_size=1, skip_bad_samples=False)
    videos = [str(rows_path.parent / row["videos"][0]) for row in rows]
    samples = [Sample(index=i, prompt=row["prompt"], multimodal_inputs={"video": [video]})
               for i, (row, video) in enumerate(zip(rows, videos))]
    ready, skipped = asyncio.run(preparer.prepare(samples))
    assert skipped == 0
    spec = preparer.spec
    preparer.close()
    return SimpleNamespace(folder=folder, tokenizer=tokenizer, config=config, samples=ready, spec=spec,
                           videos=videos)


def test_the_prompt_is_the_processors_token_for_token(family):
    assert has_timestamped_video(family.config)
    for sample, video in zip(family.samples, family.videos):
        clip = fetch_video(video, SETTINGS, family.spec)
        grid = sample.multimodal_train_inputs["video_grid_thw"].numpy()
        metadata = SimpleNamespace(fps=clip.source_fps, frames_indices=clip.frame_indices.copy())
        text = Qwen3VLProcessor.replace_video_token(
            _fake_processor(family.spec.temporal_patch_size), {"video_grid_thw": grid, "video_metadata": [metadata]},
            0)
        expected = family.tokenizer(f"<|vision_start|>{text}<|vision_end|>", add_special_tokens=False)["input_ids"]
        start = sample.tokens.index(expected[0])
        assert sample.tokens[start:start + len(expected)] == expected
        assert "seconds>" in text and text.count("<|vision_start|>") == int(grid[0][0])


def test_our_positions_are_the_models_own(family):
    model = load_model(family.folder, torch.float32).eval()
    for sample in family.samples:
        ours, native = ours_and_native_logits(model, sample)
        assert torch.allclose(ours, native, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(indices=st.lists(st.integers(0, 10_000), min_size=1, max_size=40).map(sorted),
       fps=st.floats(1.0, 120.0), patch=st.sampled_from([1, 2, 3]))
def test_patch_times_follow_the_processors_rule(indices, fps, patch):
    clip = VideoClip(frames=np.zeros((len(indices), 1, 1, 3), np.uint8), frame_indices=np.asarray(indices),
                     total_frames=max(indices) + 1, source_fps=fps, sample_fps=fps)
    spec = VisionSpec(patch_size=14, merge_size=2, temporal_patch_size=patch)
    expected = Qwen3VLProcessor._calculate_timestamps(_fake_processor(patch), list(indices), fps, patch)
    assert clip.grid_seconds(spec) == pytest.approx(expected, rel=1e-12, abs=1e-12)
