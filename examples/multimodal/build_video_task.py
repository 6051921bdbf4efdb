"""Build the VIDEO task "which way does the dot move" offline: generated 8-frame 56x56 clips written as mp4 (PyAV,
libx264), jsonl rows, a tiny random Qwen2.5-VL model (same family and tokenizer as the shapes task) and a relax
config. No warm start: this task only has to train without errors.

Each clip shows a dark dot (radius 5-8 px, random grey, random vertical position) moving left or right by 3-5 px per
frame across a white 56x56 frame, 8 frames at 4 fps (2 s). With temporal_patch_size 2 and 14-px patches merged 2x2,
a clip becomes 4 x 2 x 2 = 16 video tokens.

Outputs (under ``--out``, default: ``examples/multimodal/video``):
  data/train.jsonl, data/test.jsonl   rows {"prompt": "<video>Which way does the dot move?",
                                      "videos": ["videos/train_00001.mp4"], "label": "left"}; video paths are relative
                                      to the jsonl file's folder
  data/videos/*.mp4
  model/                              Qwen2_5_VLForConditionalGeneration + tokenizer + image processor (random weights)
  config.yaml                         for `relax train --config examples/multimodal/video/config.yaml`

Without torchvision there is no Qwen2-VL *video* processor: decode the frames with PyAV
(``transformers.video_utils.load_video(path, backend="pyav")`` works too) and build ``pixel_values_videos`` /
``video_grid_thw`` with ``mm_common.video_inputs(frames_list, image_processor)`` (README.md).

Usage: python examples/multimodal/build_video_task.py [--out DIR] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mm_common import (
    VIDEO_QUESTION,
    build_vl_tokenizer,
    placeholder_ids,
    set_threads,
    text_config,
    token_id,
    video_inputs,
    vision_config,
    write_config,
    write_jsonl,
)
from transformers import (
    GenerationConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)

SEED = 20261131
QUESTION = VIDEO_QUESTION
FRAME_SIZE, NUM_FRAMES, FPS = 56, 8, 4
NUM_TRAIN, NUM_TEST = 400, 100
TEXT_HIDDEN, TEXT_LAYERS, TEXT_HEADS, TEXT_KV_HEADS = 128, 4, 4, 2


def make_frames(rng: random.Random) -> tuple[list[Image.Image], str]:
    label = rng.choice(["left", "right"])
    speed = rng.randint(3, 5) * (1 if label == "right" else -1)
    radius = rng.randint(5, 8)
    span = speed * (NUM_FRAMES - 1)
    lo, hi = radius + 1 - min(0, span), FRAME_SIZE - radius - 2 - max(0, span)
    x0, y = rng.randint(lo, hi), rng.randint(radius + 1, FRAME_SIZE - radius - 2)
    grey = rng.randint(0, 80)
    frames = []
    for i in range(NUM_FRAMES):
        frame = Image.new("RGB", (FRAME_SIZE, FRAME_SIZE), (255, 255, 255))
        x = x0 + speed * i
        ImageDraw.Draw(frame).ellipse((x - radius, y - radius, x + radius, y + radius), fill=(grey, grey, grey))
        frames.append(frame)
    return frames, label


def write_mp4(path: Path, frames: list[Image.Image]) -> None:
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = FRAME_SIZE, FRAME_SIZE, "yuv420p"
        stream.options = {"crf": "18"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_image(frame)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def read_mp4(path: Path) -> list[np.ndarray]:
    """All frames as HxWx3 uint8 RGB arrays."""
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def write_split(data_dir: Path, split: str, n: int, seed: int) -> list[dict]:
    (data_dir / "videos").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(1, n + 1):
        frames, label = make_frames(rng)
        name = f"videos/{split}_{i:05d}.mp4"
        write_mp4(data_dir / name, frames)
        rows.append({"prompt": "<video>" + QUESTION, "videos": [name], "label": label})
    write_jsonl(data_dir / f"{split}.jsonl", rows)
    return rows


def build_model(tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    config = Qwen2_5_VLConfig(
        text_config=text_config(tokenizer, TEXT_HIDDEN, TEXT_LAYERS, TEXT_HEADS, TEXT_KV_HEADS),
        vision_config=vision_config(out_hidden=TEXT_HIDDEN),
        image_token_id=token_id(tokenizer, "<|image_pad|>"), video_token_id=token_id(tokenizer, "<|video_pad|>"),
        vision_start_token_id=token_id(tokenizer, "<|vision_start|>"),
        vision_end_token_id=token_id(tokenizer, "<|vision_end|>"),
        tie_word_embeddings=True,
    )
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        suppress_tokens=placeholder_ids(tokenizer),
    )
    return model


def video_prompt_batch(tokenizer, image_processor, videos: list[list[np.ndarray]]) -> dict[str, torch.Tensor]:
    """Model inputs for a batch of decoded clips: chat prompt with the <|video_pad|> run expanded to
    ``video_grid_thw.prod() // merge_size**2`` tokens, and ``mm_token_type_ids`` (2 = video)."""
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    vision = video_inputs(videos, image_processor)
    texts = [
        prompt.replace("<|video_pad|>", "<|video_pad|>" * int(grid.prod() // image_processor.merge_size**2))
        for grid in vision["video_grid_thw"]
    ]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    video_id = token_id(tokenizer, "<|video_pad|>")
    return {**encoded, "mm_token_type_ids": (encoded["input_ids"] == video_id).long() * 2, **vision}


CONFIG_LINES = """# GRPO on the generated moving-dot video task with a tiny random Qwen2.5-VL (built by
# examples/multimodal/build_video_task.py; no warm start, this run only has to train without errors).
#   relax train --config examples/multimodal/video/config.yaml
hf_checkpoint: {out}/model
prompt_data: {out}/data/train.jsonl
eval_prompt_data:
  held_out: {out}/data/test.jsonl
input_key: prompt
label_key: label
multimodal_keys:
  video: videos
video_fps: 4.0                 # keep all 8 frames of the 4 fps clips
video_min_token_num: 4         # keep 56x56 frames (4 tokens per frame); the default 128 would upscale them
video_max_token_num: 4
apply_chat_template: true
rm_type: exact_match

rollout_batch_size: 4
n_samples_per_prompt: 4
rollout_max_response_len: 4
rollout_temperature: 1.0
rollout_shuffle: true
num_rollout: 4
micro_batch_size: 16

advantage_estimator: grpo
lr: 1.0e-4
clip_grad: 1.0
eval_interval: 2

output_dir: runs/mm_video""".splitlines()


def build(out_dir: Path, threads: int) -> None:
    started = time.perf_counter()
    set_threads(threads)
    torch.manual_seed(SEED)
    data_dir = out_dir / "data"
    shutil.rmtree(data_dir, ignore_errors=True)
    train = write_split(data_dir, "train", NUM_TRAIN, SEED + 1)
    write_split(data_dir, "test", NUM_TEST, SEED + 2)
    print(f"wrote {NUM_TRAIN} train / {NUM_TEST} test mp4 clips to {data_dir} ({time.perf_counter() - started:.1f} s)",
          flush=True)

    tokenizer = build_vl_tokenizer()
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    model = build_model(tokenizer)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tokenizer)}", flush=True)

    # Smoke check: decode two written clips, run generate and a forward+backward through the video path.
    clips = [read_mp4(data_dir / row["videos"][0]) for row in train[:2]]
    assert all(len(c) == NUM_FRAMES and c[0].shape == (FRAME_SIZE, FRAME_SIZE, 3) for c in clips), "bad decode"
    batch = video_prompt_batch(tokenizer, image_processor, clips)
    generated = model.generate(**batch, do_sample=True, max_new_tokens=4, suppress_tokens=placeholder_ids(tokenizer))
    completion = generated[:, batch["input_ids"].shape[1]:]
    full = dict(batch, input_ids=generated, attention_mask=torch.ones_like(generated),
                mm_token_type_ids=torch.cat([batch["mm_token_type_ids"], torch.zeros_like(completion)], dim=1))
    logits = model(**full).logits[:, batch["input_ids"].shape[1] - 1:-1]
    torch.log_softmax(logits, -1).gather(-1, completion.unsqueeze(-1)).sum().backward()
    grad = model.model.visual.patch_embed.proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0, "no gradient reached the vision tower"
    model.zero_grad(set_to_none=True)
    print(f"smoke check: {batch['input_ids'].shape[1]}-token prompts with "
          f"{int((batch['mm_token_type_ids'][0] == 2).sum())} video tokens; generate + backward OK", flush=True)

    model_dir = out_dir / "model"
    shutil.rmtree(model_dir, ignore_errors=True)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    image_processor.save_pretrained(model_dir)
    rel = out_dir.resolve()
    try:
        rel = rel.relative_to(Path.cwd())
    except ValueError:
        pass
    write_config(out_dir / "config.yaml", [line.format(out=rel) for line in CONFIG_LINES])
    print(f"wrote {out_dir}/data, {out_dir}/model and {out_dir}/config.yaml in {time.perf_counter() - started:.0f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "video")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    build(args.out, args.threads)


if __name__ == "__main__":
    main()
