"""Build the AUDIO task "is the second tone higher or lower" offline: generated two-tone clips (.wav), jsonl rows, a
tiny Qwen2.5-Omni thinker with its tokenizer and Whisper feature extractor, a short supervised warm start, and a relax
config.

Each clip is 1 s at 16 kHz: a 0.5 s sine tone, then a second 0.5 s tone whose frequency is 1.04-1.5x higher or lower
(first tone 300-1200 Hz, random amplitude, 10 ms fades, faint noise). The question is the same for every clip, so
the answer cannot be guessed from the text. Chance is 50%. The warm start stops when the greedy accuracy on a dev set
(generated in memory, disjoint by seed) reaches the target inside the 55-70% band.

The feature extractor is saved with ``chunk_length=1`` (1 s windows: 100 mel frames, 25 audio tokens per clip)
instead of Whisper's 30 s (3000 frames), so the default processing no longer pads every clip 30x; the thinker only
uses the frames that ``feature_attention_mask`` marks anyway.

Outputs (under ``--out``, default: ``examples/multimodal/tones``):
  data/train.jsonl, data/test.jsonl   rows {"prompt": "<audio>Is the second tone ...", "audios": ["audio/train_00001.wav"],
                                      "label": "higher"}; audio paths are relative to the jsonl file's folder
  data/audio/*.wav
  model/                              Qwen2_5OmniThinkerForConditionalGeneration + tokenizer + preprocessor_config.json
                                      (WhisperFeatureExtractor and Qwen2VLImageProcessorPil keys merged in one file,
                                      as in the released Qwen2.5-Omni checkpoints)
  config.yaml                         for `relax train --config examples/multimodal/tones/config.yaml`

Usage: python examples/multimodal/build_tones_task.py [--out DIR] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import soundfile
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mm_common import (
    EOS_TOKEN,
    TONES_QUESTION,
    build_omni_tokenizer,
    no_video,
    placeholder_ids,
    run_warm_start,
    set_threads,
    text_config,
    token_id,
    vision_config,
    write_config,
    write_jsonl,
)
from transformers import (
    GenerationConfig,
    Qwen2_5OmniProcessor,
    Qwen2_5OmniThinkerConfig,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    WhisperFeatureExtractor,
)

SEED = 20261130
QUESTION = TONES_QUESTION
ANSWERS = ["higher", "lower"]
SAMPLE_RATE = 16000
TONE_SECONDS = 0.5
CLIP_SECONDS = 1             # = the feature extractor's chunk_length: no padding at all
# Frequency ratio of the two tones (1.04 is under a semitone). With 1.25-2x the model went from 47% to 96% in 20
# SFT steps: too easy to stop inside the band, and no headroom left for RL.
RATIO_MIN, RATIO_MAX = 1.04, 1.5
NUM_TRAIN, NUM_TEST, NUM_DEV = 2000, 200, 200

TEXT_HIDDEN, TEXT_LAYERS, TEXT_HEADS, TEXT_KV_HEADS = 128, 4, 4, 2
AUDIO_D_MODEL, AUDIO_LAYERS = 64, 2

SFT_LR = 5e-4
SFT_BATCH = 32
SFT_MAX_STEPS = 600
SFT_EVAL_EVERY = 5
SFT_TARGET = 0.60
SFT_BAND = (0.55, 0.70)
SFT_TIME_BUDGET_S = 240


# ----------------------------------------------------------------------------------------------------------- data


def tone(rng: random.Random, frequency: float) -> np.ndarray:
    n = int(SAMPLE_RATE * TONE_SECONDS)
    t = np.arange(n) / SAMPLE_RATE
    wave = rng.uniform(0.3, 0.7) * np.sin(2 * np.pi * frequency * t + rng.uniform(0, 2 * np.pi))
    fade = int(0.01 * SAMPLE_RATE)
    ramp = np.linspace(0.0, 1.0, fade)
    wave[:fade] *= ramp
    wave[-fade:] *= ramp[::-1]
    return wave


def make_clip(rng: random.Random) -> tuple[np.ndarray, str]:
    first = float(np.exp(rng.uniform(np.log(300), np.log(1200))))
    ratio = float(np.exp(rng.uniform(np.log(RATIO_MIN), np.log(RATIO_MAX))))
    label = rng.choice(ANSWERS)
    second = first * ratio if label == "higher" else first / ratio
    noise = np.random.default_rng(rng.randrange(2**32)).normal(0, 0.01, int(SAMPLE_RATE * CLIP_SECONDS))
    clip = np.concatenate([tone(rng, first), tone(rng, second)]) + noise
    return clip.astype(np.float32), label


def make_examples(seed: int, n: int) -> list[tuple[np.ndarray, str]]:
    rng = random.Random(seed)
    return [make_clip(rng) for _ in range(n)]


def write_split(data_dir: Path, split: str, examples) -> None:
    (data_dir / "audio").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (clip, label) in enumerate(examples, start=1):
        name = f"audio/{split}_{i:05d}.wav"
        soundfile.write(data_dir / name, clip, SAMPLE_RATE, subtype="FLOAT")
        rows.append({"prompt": "<audio>" + QUESTION, "audios": [name], "label": label})
    write_jsonl(data_dir / f"{split}.jsonl", rows)


# ------------------------------------------------------------------------------------------------ tokenizer, model


def build_processor_parts():
    tokenizer = build_omni_tokenizer()
    feature_extractor = WhisperFeatureExtractor(
        feature_size=128, sampling_rate=SAMPLE_RATE, return_attention_mask=True, chunk_length=CLIP_SECONDS
    )
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    processor = no_video(Qwen2_5OmniProcessor)(
        image_processor=image_processor, feature_extractor=feature_extractor, tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
    return tokenizer, feature_extractor, image_processor, processor


def build_model(tokenizer) -> Qwen2_5OmniThinkerForConditionalGeneration:
    config = Qwen2_5OmniThinkerConfig(
        audio_config={
            "d_model": AUDIO_D_MODEL, "encoder_layers": AUDIO_LAYERS, "encoder_attention_heads": 2,
            "encoder_ffn_dim": 2 * AUDIO_D_MODEL, "num_mel_bins": 128, "max_source_positions": 1500, "n_window": 100,
            "output_dim": TEXT_HIDDEN,
        },
        vision_config=vision_config(out_hidden=TEXT_HIDDEN, hidden=32),
        text_config=text_config(tokenizer, TEXT_HIDDEN, TEXT_LAYERS, TEXT_HEADS, TEXT_KV_HEADS),
        audio_token_index=token_id(tokenizer, "<|AUDIO|>"), image_token_index=token_id(tokenizer, "<|IMAGE|>"),
        video_token_index=token_id(tokenizer, "<|VIDEO|>"),
        audio_start_token_id=token_id(tokenizer, "<|audio_bos|>"),
        audio_end_token_id=token_id(tokenizer, "<|audio_eos|>"),
        vision_start_token_id=token_id(tokenizer, "<|vision_bos|>"),
        vision_end_token_id=token_id(tokenizer, "<|vision_eos|>"),
        user_token_id=token_id(tokenizer, "<|im_start|>"),
        tie_word_embeddings=True,
    )
    model = Qwen2_5OmniThinkerForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        suppress_tokens=placeholder_ids(tokenizer),
    )
    return model


def save_preprocessors(model_dir: Path, feature_extractor, image_processor) -> None:
    """Both processors write ``preprocessor_config.json``; merge their keys into one file (no key is shared), as the
    released Qwen2.5-Omni checkpoints do. AutoFeatureExtractor reads ``feature_extractor_type`` and
    AutoImageProcessor reads ``image_processor_type`` from it."""
    image_processor.save_pretrained(model_dir)
    image_keys = json.loads((model_dir / "preprocessor_config.json").read_text())
    feature_extractor.save_pretrained(model_dir)
    audio_keys = json.loads((model_dir / "preprocessor_config.json").read_text())
    assert not set(image_keys) & set(audio_keys)
    (model_dir / "preprocessor_config.json").write_text(json.dumps({**image_keys, **audio_keys}, indent=2) + "\n")


def chat_prompt(tokenizer) -> str:
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": QUESTION}]}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# ------------------------------------------------------------------------------------------------- SFT and eval


def encode(processor, prompt: str, examples, with_answers: bool) -> dict[str, torch.Tensor]:
    """Processor output (input_ids with the expanded <|AUDIO|> run, input_features, feature_attention_mask); with
    answers, the answer token and <|im_end|> are appended and only they carry labels."""
    batch = processor(text=[prompt] * len(examples), audio=[clip for clip, _ in examples], return_tensors="pt")
    if not with_answers:
        return dict(batch)
    tokenizer = processor.tokenizer
    answer_ids = torch.tensor(
        [tokenizer.encode(label, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(EOS_TOKEN)]
         for _, label in examples]
    )
    input_ids = torch.cat([batch["input_ids"], answer_ids], dim=1)
    labels = torch.full_like(input_ids, -100)
    labels[:, -answer_ids.shape[1]:] = answer_ids
    return {
        "input_ids": input_ids,
        "attention_mask": torch.cat([batch["attention_mask"], torch.ones_like(answer_ids)], dim=1),
        "input_features": batch["input_features"],
        "feature_attention_mask": batch["feature_attention_mask"],
        "labels": labels,
    }


@torch.no_grad()
def greedy_accuracy(model, processor, prompt: str, examples, batch_size: int = 100, max_new_tokens: int = 4) -> float:
    tokenizer = processor.tokenizer
    eos = tokenizer.eos_token_id
    correct = 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        batch = encode(processor, prompt, chunk, with_answers=False)
        out = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                             pad_token_id=tokenizer.pad_token_id, suppress_tokens=placeholder_ids(tokenizer))
        for completion, (_, label) in zip(out[:, batch["input_ids"].shape[1]:].tolist(), chunk):
            if eos in completion and tokenizer.decode(completion[:completion.index(eos)]).strip() == label:
                correct += 1
    return correct / len(examples)


# --------------------------------------------------------------------------------------------------------- main


CONFIG_LINES = """# GRPO on the generated two-tone pitch task with a tiny Qwen2.5-Omni thinker (built and warm-started by
# examples/multimodal/build_tones_task.py). Run from the repository root:
#   relax train --config examples/multimodal/tones/config.yaml
hf_checkpoint: {out}/model
prompt_data: {out}/data/train.jsonl
eval_prompt_data:
  held_out: {out}/data/test.jsonl
input_key: prompt
label_key: label
multimodal_keys:
  audio: audios
audio_sample_rate: 16000
apply_chat_template: true
rm_type: exact_match

rollout_batch_size: 8
n_samples_per_prompt: 8
rollout_max_response_len: 4
rollout_temperature: 1.0
rollout_shuffle: true
num_rollout: 400
micro_batch_size: 64

advantage_estimator: grpo
lr: 1.0e-4
clip_grad: 1.0
eval_interval: 50

output_dir: runs/mm_tones""".splitlines()


def build(out_dir: Path, threads: int) -> dict[str, float]:
    started = time.perf_counter()
    set_threads(threads)
    torch.manual_seed(SEED)
    data_dir = out_dir / "data"
    shutil.rmtree(data_dir, ignore_errors=True)
    train, test = make_examples(SEED + 1, NUM_TRAIN), make_examples(SEED + 2, NUM_TEST)
    dev = make_examples(SEED + 3, NUM_DEV)
    write_split(data_dir, "train", train)
    write_split(data_dir, "test", test)
    print(f"wrote {len(train)} train / {len(test)} test clips to {data_dir} ({time.perf_counter() - started:.1f} s)",
          flush=True)

    tokenizer, feature_extractor, image_processor, processor = build_processor_parts()
    model = build_model(tokenizer)
    prompt = chat_prompt(tokenizer)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tokenizer)}; prompt "
          f"{len(encode(processor, prompt, dev[:1], False)['input_ids'][0])} tokens", flush=True)

    def make_batch(step: int):
        return encode(processor, prompt, make_examples(SEED * 7 + step, SFT_BATCH), with_answers=True)

    steps, dev_acc, _ = run_warm_start(
        model, make_batch, lambda: greedy_accuracy(model, processor, prompt, dev),
        lr=SFT_LR, max_steps=SFT_MAX_STEPS, eval_every=SFT_EVAL_EVERY, target=SFT_TARGET, band=SFT_BAND,
        time_budget_s=SFT_TIME_BUDGET_S,
    )
    test_acc = greedy_accuracy(model, processor, prompt, test)

    model_dir = out_dir / "model"
    shutil.rmtree(model_dir, ignore_errors=True)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    save_preprocessors(model_dir, feature_extractor, image_processor)
    rel = out_dir.resolve()
    try:
        rel = rel.relative_to(Path.cwd())
    except ValueError:
        pass
    write_config(out_dir / "config.yaml", [line.format(out=rel) for line in CONFIG_LINES])
    elapsed = time.perf_counter() - started
    print(f"warm start: {steps} steps; dev greedy accuracy {dev_acc:.1%}; held-out test greedy accuracy "
          f"{test_acc:.1%} ({NUM_TEST} clips, chance 50%)")
    print(f"wrote {out_dir}/data, {out_dir}/model and {out_dir}/config.yaml in {elapsed:.0f} s")
    return {"steps": steps, "dev": dev_acc, "test": test_acc, "seconds": elapsed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "tones")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    build(args.out, args.threads)


if __name__ == "__main__":
    main()
