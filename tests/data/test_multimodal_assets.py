"""The tiny multimodal assets (tests/support/tiny_mm_assets.py) load offline with the Auto classes, their datasets read back,
and a forward+backward through the multimodal path sends gradients into the vision / audio tower."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.runs import ROOT
from tests.support.tiny_mm_assets import (
    build_tiny_omni,
    build_tiny_vl,
    make_audio_rows,
    make_image_rows,
    make_video_rows,
    omni_processor,
    vl_processor,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    return build_tiny_vl(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory) -> Path:
    return build_tiny_omni(tmp_path_factory.mktemp("omni"))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _completion_logprob(model, batch: dict, completion: torch.Tensor, extra: dict | None = None) -> torch.Tensor:
    """Sum of log-probs of ``completion`` after the prompt, through the full multimodal forward."""
    prompt_len = batch["input_ids"].shape[1]
    inputs = dict(batch, input_ids=torch.cat([batch["input_ids"], completion], 1),
                  attention_mask=torch.cat([batch["attention_mask"], torch.ones_like(completion)], 1), **(extra or {}))
    logits = model(**inputs).logits[:, prompt_len - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, completion.unsqueeze(-1)).sum()


def test_vl_folder_loads_and_image_grads_reach_vision_tower(vl_dir, tmp_path):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(vl_dir)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(AutoImageProcessor.from_pretrained(vl_dir)).__name__ == "Qwen2VLImageProcessorPil"
    tok = AutoTokenizer.from_pretrained(vl_dir)
    assert tok.image_token == "<|image_pad|>" and tok.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id
    processor = vl_processor(vl_dir)

    jsonl = make_image_rows(tmp_path, 3)
    rows = _rows(jsonl)
    assert rows[0]["images"][0].startswith("images/") and rows[0]["label"] in {"1", "2", "3", "4"}
    images = [Image.open(jsonl.parent / r["images"][0]).convert("RGB") for r in rows]  # relative to the jsonl folder
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "n?"}]}],
                                   add_generation_prompt=True, tokenize=False)
    batch = dict(processor(text=[text] * 3, images=images, return_tensors="pt"))
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]] * 3  # 56x56 -> 16 patches -> 4 tokens
    assert int((batch["input_ids"] == model.config.image_token_id).sum()) == 12
    assert int((batch["mm_token_type_ids"] == 1).sum()) == 12

    completion = torch.tensor([[tok.convert_tokens_to_ids("<|im_end|>")]] * 3)
    logprob = _completion_logprob(
        model, batch, completion,
        # mm_token_type_ids must cover prompt + completion in the training forward
        {"mm_token_type_ids": torch.cat([batch["mm_token_type_ids"], torch.zeros_like(completion)], 1)})
    assert torch.isfinite(logprob) and logprob < 0
    logprob.backward()
    grad = model.model.visual.patch_embed.proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0

    # greedy generation with placeholders suppressed never emits an image token
    model.eval()
    out = model.generate(**batch, max_new_tokens=3, do_sample=False,
                         suppress_tokens=[model.config.image_token_id, model.config.video_token_id])
    assert not (out[:, batch["input_ids"].shape[1]:] == model.config.image_token_id).any()


def test_omni_folder_loads_and_audio_grads_reach_audio_tower(omni_dir, tmp_path):
    import soundfile
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(omni_dir)
    assert type(model).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"
    feature_extractor = AutoFeatureExtractor.from_pretrained(omni_dir)
    assert type(feature_extractor).__name__ == "WhisperFeatureExtractor" and feature_extractor.n_samples == 32000
    assert type(AutoImageProcessor.from_pretrained(omni_dir)).__name__ == "Qwen2VLImageProcessorPil"
    tok = AutoTokenizer.from_pretrained(omni_dir)
    assert tok.audio_token == "<|AUDIO|>"
    processor = omni_processor(omni_dir)

    jsonl = make_audio_rows(tmp_path, 2)
    rows = _rows(jsonl)
    clips = [soundfile.read(jsonl.parent / r["audios"][0], dtype="float32")[0] for r in rows]
    assert clips[0].shape == (16000,) and rows[0]["label"] in {"higher", "lower"}
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "?"}]}],
                                   add_generation_prompt=True, tokenize=False)
    batch = dict(processor(text=[text] * 2, audio=clips, return_tensors="pt"))
    # 1 s = 100 valid mel frames of 200 (chunk_length 2), 25 audio tokens each
    assert batch["input_features"].shape == (2, 128, 200)
    assert batch["feature_attention_mask"].sum(1).tolist() == [100, 100]
    assert int((batch["input_ids"] == model.config.audio_token_index).sum()) == 50

    completion = torch.tensor([[tok.convert_tokens_to_ids("<|im_end|>")]] * 2)
    logprob = _completion_logprob(model, batch, completion)
    assert torch.isfinite(logprob) and logprob < 0
    logprob.backward()
    grad = model.model.audio_tower.conv1.weight.grad
    assert grad is not None and grad.abs().sum() > 0

    # the padding length does not change the result beyond float noise: only masked-in frames reach the encoder
    full = dict(processor(text=[text] * 2, audio=clips, return_tensors="pt", audio_kwargs={"max_length": 16000}))
    assert full["input_features"].shape[-1] == 100
    with torch.no_grad():
        a = model(**batch).logits
        b = model(**full).logits
    assert torch.allclose(a, b, atol=1e-2)


def test_video_rows_decode_and_video_grads_reach_vision_tower(vl_dir, tmp_path):
    import av
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    sys.path.insert(0, str(ROOT / "examples" / "multimodal"))
    from mm_common import video_inputs

    jsonl = make_video_rows(tmp_path, 2)
    rows = _rows(jsonl)
    clips = []
    for row in rows:
        with av.open(str(jsonl.parent / row["videos"][0])) as container:
            clips.append([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    assert [len(c) for c in clips] == [8, 8] and clips[0][0].shape == (56, 56, 3)

    image_processor = AutoImageProcessor.from_pretrained(vl_dir)
    # two identical frames give exactly the image processor's patches for that frame
    still = video_inputs([[clips[0][0], clips[0][0]]], image_processor)
    as_image = image_processor(images=[clips[0][0]], return_tensors="pt")
    assert torch.allclose(still["pixel_values_videos"], as_image["pixel_values"], atol=1e-5)

    vision = video_inputs(clips, image_processor)
    assert vision["video_grid_thw"].tolist() == [[4, 4, 4]] * 2 and vision["pixel_values_videos"].shape == (128, 1176)
    tok = AutoTokenizer.from_pretrained(vl_dir)
    model = AutoModelForImageTextToText.from_pretrained(vl_dir)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "?"}]}],
                                   add_generation_prompt=True, tokenize=False).replace("<|video_pad|>", "<|video_pad|>" * 16)
    enc = tok([text] * 2, return_tensors="pt")
    mm = (enc["input_ids"] == model.config.video_token_id).long() * 2
    batch = {**enc, **vision, "mm_token_type_ids": mm}
    completion = torch.tensor([[tok.convert_tokens_to_ids("<|im_end|>")]] * 2)
    logprob = _completion_logprob(model, batch, completion,
                                  {"mm_token_type_ids": torch.cat([mm, torch.zeros_like(completion)], 1)})
    logprob.backward()
    grad = model.model.visual.patch_embed.proj.weight.grad
    assert torch.isfinite(logprob) and grad is not None and grad.abs().sum() > 0
    assert np.isfinite(grad.numpy()).all()
