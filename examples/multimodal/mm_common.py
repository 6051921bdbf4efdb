"""Shared pieces of the multimodal example builders: tokenizer, chat templates, tiny Qwen-VL / Qwen-Omni configs,
the processor workaround for the missing torchvision, jsonl/config writing, and the supervised warm-start loop.

Everything runs offline (no model hub) on a CPU with transformers 5.x. See README.md in this folder.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# Qwen special tokens. The VL family uses <|vision_start|><|image_pad|><|vision_end|> (and <|video_pad|>); the
# Omni family uses <|vision_bos|><|IMAGE|><|vision_eos|>, <|VIDEO|> and <|audio_bos|><|AUDIO|><|audio_eos|>, as the
# released Qwen2.5-VL / Qwen2.5-Omni tokenizers do.
SPECIALS = [
    PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN,
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
    "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>", "<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>", "<|VIDEO|>",
]

# The attributes the multimodal processors read from the tokenizer (``tokenizer.image_token`` etc.).
VL_EXTRA_SPECIALS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
OMNI_EXTRA_SPECIALS = {
    "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "audio_token": "<|AUDIO|>",
    "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
    "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
}


def chatml_template(image: str, video: str, audio: str) -> str:
    """A ChatML jinja template: string contents verbatim, content lists with {"type": "image"|"video"|"audio"|"text"}
    items rendered as one placeholder per media item (the processor later repeats the pad token per feature)."""
    return (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
        f"{{% if c['type'] == 'image' %}}{image}"
        f"{{% elif c['type'] == 'video' %}}{video}"
        f"{{% elif c['type'] == 'audio' %}}{audio}"
        "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


VL_CHAT_TEMPLATE = chatml_template(
    "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>",
    "<|audio_bos|><|AUDIO|><|audio_eos|>",
)
OMNI_CHAT_TEMPLATE = chatml_template(
    "<|vision_bos|><|IMAGE|><|vision_eos|>", "<|vision_bos|><|VIDEO|><|vision_eos|>",
    "<|audio_bos|><|AUDIO|><|audio_eos|>",
)


def build_tokenizer(
    sentences: list[str], single_token_words: list[str], omni: bool = False, vocab_size: int = 512
) -> PreTrainedTokenizerFast:
    """Byte-level BPE (vocab ``vocab_size``) trained on ``sentences`` plus filler text, with the Qwen specials, the
    named multimodal tokens and a ChatML template. Each word of ``single_token_words`` must end up as one token
    (checked), so that answers are one token plus <|im_end|>."""
    rng = random.Random(0)
    filler = "the quick brown fox jumps over a lazy dog while five wizards box and quickly vex jim " * 3
    corpus = []
    for _ in range(40):
        corpus.extend(sentences)
        corpus.extend(single_token_words)
        corpus.append(" ".join(rng.sample(filler.split(), 8)))
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, padding_side="left",
        extra_special_tokens=OMNI_EXTRA_SPECIALS if omni else VL_EXTRA_SPECIALS,
    )
    tokenizer.chat_template = OMNI_CHAT_TEMPLATE if omni else VL_CHAT_TEMPLATE
    for word in single_token_words:
        ids = tokenizer.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            raise RuntimeError(f"answer {word!r} is not a single token: {ids}")
    return tokenizer


SHAPES_QUESTION = "How many shapes are in the picture? Answer with a digit."
VIDEO_QUESTION = "Which way does the dot move?"
TONES_QUESTION = "Is the second tone higher or lower than the first?"


def build_vl_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer of the Qwen2.5-VL examples (shapes and video): answers 1-4, left, right are single tokens."""
    return build_tokenizer([SHAPES_QUESTION, VIDEO_QUESTION], ["1", "2", "3", "4", "left", "right"])


def build_omni_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer of the Qwen2.5-Omni example (tones): answers higher, lower are single tokens."""
    return build_tokenizer([TONES_QUESTION], ["higher", "lower"], omni=True)


def video_inputs(videos: list, image_processor) -> dict[str, torch.Tensor]:
    """``pixel_values_videos`` and ``video_grid_thw`` for a list of videos (each a list of PIL frames or HxWx3 uint8
    arrays), computed with the PIL image processor's resize/rescale/normalize and the Qwen2-VL video patch layout
    (the same as ``Qwen2VLVideoProcessor.patchify``, which needs torchvision). Frames are padded to a multiple of
    ``temporal_patch_size`` by repeating the last one."""
    import numpy as np
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    ip = image_processor
    tps, ps, ms = ip.temporal_patch_size, ip.patch_size, ip.merge_size
    all_patches, grids = [], []
    for frames in videos:
        processed = []
        for frame in frames:
            array = np.asarray(frame, dtype=np.uint8)
            height, width = array.shape[:2]
            new_h, new_w = smart_resize(height, width, factor=ps * ms, min_pixels=ip.size["shortest_edge"],
                                        max_pixels=ip.size["longest_edge"])
            image = Image.fromarray(array).convert("RGB").resize((new_w, new_h), Image.BICUBIC)
            chw = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) * ip.rescale_factor
            mean = np.asarray(ip.image_mean, dtype=np.float32)[:, None, None]
            std = np.asarray(ip.image_std, dtype=np.float32)[:, None, None]
            processed.append((chw - mean) / std)
        video = np.stack(processed)
        if pad := -len(video) % tps:
            video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
        t, c, h, w = video.shape
        gt, gh, gw = t // tps, h // ps, w // ps
        patches = video.reshape(gt, tps, c, gh // ms, ms, ps, gw // ms, ms, ps)
        patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        all_patches.append(patches.reshape(gt * gh * gw, c * tps * ps * ps))
        grids.append([gt, gh, gw])
    return {
        "pixel_values_videos": torch.from_numpy(np.concatenate(all_patches)),
        "video_grid_thw": torch.tensor(grids, dtype=torch.long),
    }


def token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    return tokenizer.convert_tokens_to_ids(token)


def placeholder_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Ids a sampled completion must never contain (pass as ``suppress_tokens`` to ``generate``)."""
    return [token_id(tokenizer, t) for t in ("<|image_pad|>", "<|video_pad|>", "<|AUDIO|>", "<|IMAGE|>", "<|VIDEO|>")]


def no_video(cls):
    """The processor class with its video slot optional: without torchvision there is no video processor, and the
    Qwen processors' constructors reject ``video_processor=None`` (environment-notes §1, pitfall 1)."""

    class Processor(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and "video" in argument_name:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    Processor.__name__ = cls.__name__
    return Processor


def mrope(head_dim: int) -> dict[str, Any]:
    """Multimodal rope settings; the three sections must sum to head_dim / 2."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [t, h, half - t - h]}


def text_config(tokenizer: PreTrainedTokenizerFast, hidden: int, layers: int, heads: int, kv_heads: int) -> dict:
    return {
        "vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 1024,
        "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None,
        "rope_parameters": mrope(hidden // heads), "tie_word_embeddings": True,
    }


def vision_config(out_hidden: int, hidden: int = 64, depth: int = 2, heads: int = 2) -> dict:
    """A Qwen2.5-VL vision tower: 14-px patches, 2x2 merge (one token per 28x28 pixels)."""
    return {
        "depth": depth, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_heads": heads, "out_hidden_size": out_hidden,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [depth - 1],
    }


# ----------------------------------------------------------------------------------------------------------- files


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_config(path: Path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n")


# --------------------------------------------------------------------------------------------------- warm start


def set_threads(threads: int = 2) -> None:
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass


def run_warm_start(
    model: torch.nn.Module,
    make_batch: Callable[[int], dict[str, torch.Tensor]],
    evaluate: Callable[[], float],
    *,
    lr: float,
    max_steps: int,
    eval_every: int,
    target: float,
    band: tuple[float, float],
    time_budget_s: float,
    warmup_steps: int = 10,
) -> tuple[int, float, list[tuple[int, float]]]:
    """AdamW on batches from ``make_batch(step)`` until the dev accuracy reaches ``target`` (checked every
    ``eval_every`` steps), ``max_steps`` pass or ``time_budget_s`` is spent.

    If an evaluation overshoots the band's upper bound, the weights of the last evaluation that was inside the band
    (or, failing that, the closest one below it) are restored. Returns (steps done, dev accuracy of the kept weights,
    history of (step, dev accuracy)).
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup_steps))
    history: list[tuple[int, float]] = []
    started = time.perf_counter()
    best_state, best_acc, best_step, best_in_band = None, float("nan"), 0, False
    step = 0
    while step < max_steps:
        model.train()
        batch = make_batch(step)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % 10 == 0:
            print(f"  sft step {step:4d}  loss {loss.item():.4f}  ({time.perf_counter() - started:.0f} s)", flush=True)
        if step % eval_every == 0 or step == max_steps:
            model.eval()
            acc = evaluate()
            history.append((step, acc))
            print(f"  sft step {step:4d}  dev greedy accuracy {acc:.1%}  ({time.perf_counter() - started:.0f} s)",
                  flush=True)
            in_band = band[0] <= acc <= band[1]
            if in_band or (acc < band[0] and not best_in_band):
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                best_acc, best_step, best_in_band = acc, step, in_band
            if in_band and acc >= target:
                break
            if acc > band[1]:
                print(f"  overshot the band: restoring the weights of step {best_step}", flush=True)
                break
            if time.perf_counter() - started > time_budget_s:
                print("  warm-start time budget spent", flush=True)
                break
    if best_state is not None:
        model.load_state_dict(best_state)
        step, final = best_step, best_acc
    else:
        final = history[-1][1] if history else float("nan")
    model.eval()
    return step, final, history
