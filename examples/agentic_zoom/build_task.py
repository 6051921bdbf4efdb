"""Build the zoom-in task offline, deterministically: generated images, jsonl rows, a tiny Qwen2.5-VL warm-started on
zoom episodes, and a relax config.

Each picture is a 224x224 PNG: a few large grey shapes, a few small grey squares, and ONE small coloured square
(8 px; red, green, blue or yellow). The question asks for the colour of the small square. The run shows the model
the picture downscaled to 112x112 (16 vision tokens, ``image_max_token_num: 16``), where the square is a 4-px smudge;
``image_zoom_in_tool`` crops the full-resolution original, so a zoom on the right region shows the square at 4x that
scale (a 56x56 crop, 4 vision tokens). Chance is 25%.

The model is the multimodal examples' tiny Qwen2.5-VL (``build_shapes_task.build_model``) with a tokenizer trained
on this task's text (``mm_common.build_tokenizer``; the colours are single tokens). A short supervised warm start
on complete episodes teaches it the format, so that RL has episodes to work with:

    user:      <image>What colour is the small square? ...
    assistant: <tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [400, 100, 600, 300]}}</tool_call>
    tool:      <tool_response><image>Zoomed in on [400, 100, 600, 300].</tool_response>     (the env's real crop)
    assistant: <answer>red</answer>

The episodes are encoded with relax's own media preparer, observation encoder and ``ZoomEnv``, so the warm start sees
exactly the token layout of the RL episodes. Learning to ground the box is left to RL (and mostly beyond a 1 M
parameter model); the point of the example is that the whole vision-language multi-turn loop runs.

Outputs (under ``--out``, default: this script's folder):
  data/train.jsonl, data/test.jsonl  rows {"prompt": "<image>What colour ...", "images": ["images/train_00001.png"],
                                     "label": "red", "metadata": {"target_bbox": [x1, y1, x2, y2]}} (grid 0-1000);
                                     image paths are relative to the jsonl file's folder
  data/images/*.png
  model/                             Qwen2_5_VLForConditionalGeneration + tokenizer + image processor (warm-started)
  config.yaml                        for `PYTHONPATH=. relax train --config examples/agentic_zoom/config.yaml`

Usage: python examples/agentic_zoom/build_task.py [--out DIR] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from transformers import AutoConfig, Qwen2VLImageProcessorPil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "multimodal"))
sys.path.insert(0, str(ROOT))
from build_shapes_task import build_model  # the multimodal examples' tiny Qwen2.5-VL
from mm_common import EOS_TOKEN, build_tokenizer, set_threads, write_config, write_jsonl

from examples.agentic_zoom.env_zoom import GRID, TOOL_NAME, ZoomEnv
from relax.backends.models.family import concat_inputs, forward_inputs
from relax.data.multimodal import MultimodalSettings
from relax.data.sample import Sample
from relax.rollout.agentic.multi_turn import ObservationEncoder
from relax.rollout.generation.multimodal import MultimodalPreparer

SEED = 20261130
CANVAS = 224               # original pictures; the run shows them at 112x112 (image_max_token_num 16)
TARGET_SIZE = 8            # the small coloured square, px of the original
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 225), "yellow": (235, 200, 30)}
QUESTION = ("What colour is the small square? Zoom in with image_zoom_in_tool, then answer with "
            "<answer>colour</answer>.")
IMAGE_MIN_TOKENS, IMAGE_MAX_TOKENS = 4, 16
NUM_TRAIN, NUM_TEST = 1000, 100

# Warm start: AdamW on complete episodes (the loss on the model's two turns only).
SFT_STEPS, SFT_BATCH, SFT_LR, SFT_EPISODES = 150, 16, 2e-3, 256

# ----------------------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Example:
    image: Image.Image
    colour: str
    target_bbox: list[int]  # the coloured square on the 0-GRID grid


def to_grid(box: tuple[int, int, int, int]) -> list[int]:
    return [round(v * GRID / CANVAS) for v in box]


def draw_picture(rng: random.Random) -> Example:
    """Grey distractors (3-5 large shapes, 3 small squares) and one small coloured square, on white."""
    image = Image.new("RGB", (CANVAS, CANVAS), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(3, 5)):
        size = rng.randint(30, 60)
        x, y = rng.randint(0, CANVAS - size), rng.randint(0, CANVAS - size)
        grey = rng.randint(110, 200)
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((x, y, x + size, y + size), fill=(grey, grey, grey))
    for _ in range(3):
        x, y = rng.randint(4, CANVAS - TARGET_SIZE - 4), rng.randint(4, CANVAS - TARGET_SIZE - 4)
        grey = rng.randint(60, 140)
        draw.rectangle((x, y, x + TARGET_SIZE - 1, y + TARGET_SIZE - 1), fill=(grey, grey, grey))
    colour = rng.choice(sorted(COLOURS))
    x, y = rng.randint(4, CANVAS - TARGET_SIZE - 4), rng.randint(4, CANVAS - TARGET_SIZE - 4)
    box = (x, y, x + TARGET_SIZE, y + TARGET_SIZE)
    draw.rectangle((x, y, x + TARGET_SIZE - 1, y + TARGET_SIZE - 1), fill=COLOURS[colour])
    return Example(image, colour, to_grid(box))


def make_examples(seed: int, n: int) -> list[Example]:
    rng = random.Random(seed)
    return [draw_picture(rng) for _ in range(n)]


def write_split(data_dir: Path, split: str, examples: list[Example]) -> Path:
    (data_dir / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, example in enumerate(examples, start=1):
        name = f"images/{split}_{i:05d}.png"
        example.image.save(data_dir / name)
        rows.append({"prompt": "<image>" + QUESTION, "images": [name], "label": example.colour,
                     "metadata": {"target_bbox": example.target_bbox}})
    path = data_dir / f"{split}.jsonl"
    write_jsonl(path, rows)
    return path


def zoom_box(rng: random.Random, target: list[int]) -> list[int]:
    """A demonstration box around the target: 200 or 250 grid units a side (45-56 px), corners on multiples of 50
    (coarse boxes are what a 1 M-parameter model can learn to write), placed at random among those inside the grid."""
    side = rng.choice([200, 250])
    x1 = rng.choice(_box_starts(target[0], target[2], side))
    y1 = rng.choice(_box_starts(target[1], target[3], side))
    return [x1, y1, x1 + side, y1 + side]


def _box_starts(low: int, high: int, side: int) -> list[int]:
    """Starts on multiples of 50 of a span of ``side`` inside the grid that covers ``[low, high]``."""
    return [start for start in range(0, GRID - side + 1, 50) if start <= low and start + side >= high]


def tool_call_text(box: list[int]) -> str:
    return "<tool_call>" + json.dumps({"name": TOOL_NAME, "arguments": {"bbox_2d": box}}) + "</tool_call>"


def answer_text(colour: str) -> str:
    return f"<answer>{colour}</answer>"


# ------------------------------------------------------------------------------------------------ tokenizer, model


def build_zoom_tokenizer():
    """Byte-level BPE on the task's text (question, calls, results, answers); each colour is one token."""
    rng = random.Random(SEED)
    boxes = [zoom_box(rng, example.target_bbox) for example in make_examples(SEED + 6, 60)]
    sentences = [QUESTION, *(tool_call_text(box) for box in boxes),
                 *(f"<tool_response>\nZoomed in on {box}.\n</tool_response>" for box in boxes),
                 *(answer_text(colour) for colour in COLOURS)]
    return build_tokenizer(sentences, sorted(COLOURS), vocab_size=768)


def image_processor() -> Qwen2VLImageProcessorPil:
    """The saved vision geometry (14-px patches, 2x2 merge); the run's image sizes come from its config."""
    return Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": CANVAS * CANVAS},
                                    patch_size=14, temporal_patch_size=2, merge_size=2)


def media_preparer(tokenizer, model_dir: Path) -> MultimodalPreparer:
    """relax's own media processing, sized as the run's config sizes it."""
    settings = MultimodalSettings(image_min_token_num=IMAGE_MIN_TOKENS, image_max_token_num=IMAGE_MAX_TOKENS)
    return MultimodalPreparer(tokenizer, AutoConfig.from_pretrained(model_dir), model_dir, settings, None, {},
                              pool_size=1, skip_bad_samples=False)


# ---------------------------------------------------------------------------------------------------- warm start


@dataclass
class Episode:
    """One encoded demonstration: token ids, labels (-100 outside the model's turns) and media tensors."""

    ids: list[int]
    labels: list[int]
    media: dict[str, torch.Tensor]


def encode_episodes(examples: list[Example], tokenizer, preparer: MultimodalPreparer, seed: int) -> list[Episode]:
    """Each example as the multi-turn loop would record it: prompt, zoom call, the env's crop, answer."""
    rng = random.Random(seed)
    prompts = [Sample(index=i, prompt="<image>" + QUESTION, multimodal_inputs={"image": [example.image]})
               for i, example in enumerate(examples)]
    prompts, _ = asyncio.run(preparer.prepare(prompts))
    encoder = ObservationEncoder(tokenizer, {}, preparer)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    episodes = []
    for prompt, example in zip(prompts, examples):
        call = tool_call_text(zoom_box(rng, example.target_bbox))
        env = ZoomEnv(example.image, tokenizer.chat_template)
        observation, done, _ = env.step(call)
        assert not done and "multi_modal_data" in observation, observation
        call_ids = tokenizer(call, add_special_tokens=False)["input_ids"] + [eos]
        observation_ids, crop_media = encoder.encode(env.format_observation(observation))
        answer_ids = tokenizer(answer_text(example.colour), add_special_tokens=False)["input_ids"] + [eos]
        between = encoder.close_turn(call_ids) + observation_ids
        ids = prompt.tokens + call_ids + between + answer_ids
        labels = [-100] * len(prompt.tokens) + call_ids + [-100] * len(between) + answer_ids
        episodes.append(Episode(ids, labels, concat_inputs([prompt.multimodal_train_inputs, crop_media])))
    return episodes


def collate(episodes: list[Episode], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Right-padded ids, attention mask and labels, and the episodes' media concatenated in order."""
    length = max(len(e.ids) for e in episodes)
    ids = torch.tensor([e.ids + [pad_id] * (length - len(e.ids)) for e in episodes])
    labels = torch.tensor([e.labels + [-100] * (length - len(e.labels)) for e in episodes])
    mask = torch.tensor([[1] * len(e.ids) + [0] * (length - len(e.ids)) for e in episodes])
    return ids, mask, labels, concat_inputs([e.media for e in episodes])


def warm_start(model, episodes: list[Episode], pad_id: int, steps: int, batch_size: int, lr: float,
               seed: int) -> float:
    """AdamW on shuffled batches of episodes for ``steps`` steps; returns the last loss."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(1, steps + 1):
        ids, mask, labels, media = collate(rng.sample(episodes, min(batch_size, len(episodes))), pad_id)
        inputs = forward_inputs(model, media, ids, torch.device("cpu"), torch.float32)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, **inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == steps:
            print(f"  sft step {step:4d}  loss {loss.item():.4f}", flush=True)
    model.eval()
    return loss.item()


# --------------------------------------------------------------------------------------------------------- main


CONFIG_LINES = """# Multi-turn GRPO with the zoom-in tool on generated images and a tiny Qwen2.5-VL (built and warm-started by
# examples/agentic_zoom/build_task.py). Run from the repository root, with it on PYTHONPATH (the env and reward
# are imported as examples.agentic_zoom.env_zoom):
#   PYTHONPATH=. relax train --config examples/agentic_zoom/config.yaml --num-rollout 3
hf_checkpoint: {out}/model
prompt_data: {out}/data/train.jsonl
eval_prompt_data:
  held_out: {out}/data/test.jsonl
input_key: prompt
label_key: label
multimodal_keys:
  image: images
image_min_token_num: {min_tokens}     # the 224x224 pictures are shown at 112x112 (16 tokens); a 56x56 crop is 4
image_max_token_num: {max_tokens}
apply_chat_template: true
custom_rm_path: examples.agentic_zoom.env_zoom:zoom_reward

# An episode: the zoom call (about 40 tokens), the crop (about 35), the answer (8); up to 3 model turns.
rollout_interaction_env_path: examples.agentic_zoom.env_zoom
max_turns: 3
rollout_max_response_len: 48          # per model turn
rollout_max_context_len: 320          # prompt (about 60 tokens) + the whole episode
env_step_timeout: 30

rollout_batch_size: 4
n_samples_per_prompt: 4
micro_batch_size: 16
rollout_temperature: 1.0
rollout_shuffle: true
num_rollout: 20
use_tis: true                         # logs train/tis_mismatch_kl: engine and trainer saw the same images

advantage_estimator: grpo
lr: 1.0e-4
clip_grad: 1.0
eval_interval: 10

output_dir: runs/agentic_zoom""".splitlines()


def relative_to_cwd(path: Path) -> Path:
    path = path.resolve()
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def build(out_dir: Path, num_train: int = NUM_TRAIN, num_test: int = NUM_TEST, sft_steps: int = SFT_STEPS,
          sft_episodes: int = SFT_EPISODES, sft_batch: int = SFT_BATCH, threads: int = 1) -> dict[str, float]:
    """Write data, model and config under ``out_dir``; returns the build's figures."""
    started = time.perf_counter()
    set_threads(threads)
    torch.manual_seed(SEED)
    data_dir, model_dir = out_dir / "data", out_dir / "model"
    shutil.rmtree(data_dir, ignore_errors=True)
    shutil.rmtree(model_dir, ignore_errors=True)
    write_split(data_dir, "train", make_examples(SEED + 1, num_train))
    write_split(data_dir, "test", make_examples(SEED + 2, num_test))

    tokenizer = build_zoom_tokenizer()
    model = build_model(tokenizer)
    tokenizer.save_pretrained(model_dir)
    image_processor().save_pretrained(model_dir)
    model.save_pretrained(model_dir)  # the preparer reads the config from here; the warm-started weights follow
    preparer = media_preparer(tokenizer, model_dir)
    try:
        episodes = encode_episodes(make_examples(SEED + 3, sft_episodes), tokenizer, preparer, SEED + 4)
    finally:
        preparer.close()
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tokenizer)}; "
          f"episodes of {min(len(e.ids) for e in episodes)}-{max(len(e.ids) for e in episodes)} tokens", flush=True)
    loss = warm_start(model, episodes, tokenizer.pad_token_id, sft_steps, sft_batch, SFT_LR, SEED + 5)
    model.save_pretrained(model_dir)

    rel = relative_to_cwd(out_dir)
    lines = [line.format(out=rel, min_tokens=IMAGE_MIN_TOKENS, max_tokens=IMAGE_MAX_TOKENS) for line in CONFIG_LINES]
    write_config(out_dir / "config.yaml", lines)
    elapsed = time.perf_counter() - started
    print(f"wrote {out_dir}/data ({num_train} train, {num_test} test), {out_dir}/model (warm start: {sft_steps} "
          f"steps, last loss {loss:.3f}) and {out_dir}/config.yaml in {elapsed:.0f} s")
    return {"sft_loss": loss, "seconds": elapsed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    build(args.out, threads=args.threads)


if __name__ == "__main__":
    main()
