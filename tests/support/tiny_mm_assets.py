"""Tiny random Qwen2.5-VL and Qwen2.5-Omni-thinker folders (model + tokenizer + processor parts) and small generated
image / audio / video datasets, built offline in about a second each, for tests of the multimodal paths.

Folders load with ``AutoModelForImageTextToText``, ``AutoTokenizer``, ``AutoImageProcessor`` and (Omni)
``AutoFeatureExtractor``. Processors must be assembled by hand (no torchvision, so no video processor): see
``vl_processor`` / ``omni_processor``. Dataset rows use paths relative to the jsonl file's folder.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5OmniThinkerConfig,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    WhisperFeatureExtractor,
)

SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>", "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>", "<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>",
    "<|VIDEO|>",
]
QWEN3_OMNI_SPECIALS = ["<|audio_start|>", "<|audio_pad|>", "<|audio_end|>"]  # Qwen3-Omni's audio tokens
VL_EXTRA = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
OMNI_EXTRA = {
    "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "audio_token": "<|AUDIO|>",
    "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
    "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
}


def _template(image: str, video: str, audio: str) -> str:
    return (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
        f"{{% if c['type'] == 'image' %}}{image}{{% elif c['type'] == 'video' %}}{video}"
        f"{{% elif c['type'] == 'audio' %}}{audio}"
        "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


VL_TEMPLATE = _template("<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>",
                        "<|audio_bos|><|AUDIO|><|audio_eos|>")
OMNI_TEMPLATE = _template("<|vision_bos|><|IMAGE|><|vision_eos|>", "<|vision_bos|><|VIDEO|><|vision_eos|>",
                          "<|audio_bos|><|AUDIO|><|audio_eos|>")
QWEN3_OMNI_EXTRA = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|audio_pad|>",
                    "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
                    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"}
QWEN3_OMNI_TEMPLATE = _template("<|vision_start|><|image_pad|><|vision_end|>",
                                "<|vision_start|><|video_pad|><|vision_end|>", "<|audio_start|><|audio_pad|><|audio_end|>")
QUESTIONS = {"image": "How many shapes?", "audio": "Higher or lower?", "video": "Which way does the dot move?"}


def build_tokenizer(omni: bool, qwen3_omni: bool = False) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS + (QWEN3_OMNI_SPECIALS if qwen3_omni else []),
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(list(QUESTIONS.values()) * 20 + ["higher lower left right 1 2 3 4"] * 20,
                                trainer=trainer)
    extra = QWEN3_OMNI_EXTRA if qwen3_omni else OMNI_EXTRA if omni else VL_EXTRA
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  padding_side="left", extra_special_tokens=extra)
    tok.chat_template = QWEN3_OMNI_TEMPLATE if qwen3_omni else OMNI_TEMPLATE if omni else VL_TEMPLATE
    return tok


def _ids(tok, *tokens):
    return [tok.convert_tokens_to_ids(t) for t in tokens]


def _text_config(tok) -> dict:
    return {"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
                "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id, "bos_token_id": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}


VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64, "patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [1]}


# The tiny MoE layouts: four experts, two per token.
_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def image_processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112},
                                    patch_size=14, temporal_patch_size=2, merge_size=2)


def build_tiny_vl(tmp_path: Path, seed: int = 0) -> Path:
    """A random Qwen2.5-VL (~0.2 M parameters) + tokenizer + image processor in ``tmp_path / "tiny_vl"``."""
    folder = Path(tmp_path) / "tiny_vl"
    tok = build_tokenizer(omni=False)
    torch.manual_seed(seed)
    image_id, video_id, start, end = _ids(tok, "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    config = Qwen2_5_VLConfig(text_config=_text_config(tok), vision_config=VISION, image_token_id=image_id,
                              video_token_id=video_id, vision_start_token_id=start, vision_end_token_id=end)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    image_processor().save_pretrained(folder)
    return folder


def build_tiny_omni(tmp_path: Path, seed: int = 0) -> Path:
    """A random Qwen2.5-Omni thinker + tokenizer + one ``preprocessor_config.json`` holding both the
    WhisperFeatureExtractor (chunk_length 2: clips padded to 2 s = 200 frames, not 30 s) and the image processor
    keys, in ``tmp_path / "tiny_omni"``."""
    folder = Path(tmp_path) / "tiny_omni"
    tok = build_tokenizer(omni=True)
    torch.manual_seed(seed)
    audio, image, video, abos, aeos, vbos, veos, user = _ids(
        tok, "<|AUDIO|>", "<|IMAGE|>", "<|VIDEO|>", "<|audio_bos|>", "<|audio_eos|>", "<|vision_bos|>",
        "<|vision_eos|>", "<|im_start|>")
    config = Qwen2_5OmniThinkerConfig(
        audio_config={"d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                          "num_mel_bins": 128, "max_source_positions": 1500, "n_window": 100, "output_dim": 64},
        vision_config=VISION, text_config=_text_config(tok), audio_token_index=audio, image_token_index=image,
        video_token_index=video, audio_start_token_id=abos, audio_end_token_id=aeos, vision_start_token_id=vbos,
        vision_end_token_id=veos, user_token_id=user)
    Qwen2_5OmniThinkerForConditionalGeneration(config).save_pretrained(folder)
    return _save_omni_processors(folder, tok, image_processor())


def _save_omni_processors(folder: Path, tok, images: Qwen2VLImageProcessorPil) -> Path:
    """The tokenizer, and one ``preprocessor_config.json`` holding the image processor's keys and a
    WhisperFeatureExtractor's (128 mel bins; chunk_length 2: clips padded to 2 s = 200 frames, not 30 s)."""
    tok.save_pretrained(folder)
    images.save_pretrained(folder)
    image_keys = json.loads((folder / "preprocessor_config.json").read_text())
    WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, return_attention_mask=True,
                            chunk_length=2).save_pretrained(folder)
    audio_keys = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps({**image_keys, **audio_keys}, indent=2))
    return folder


def build_tiny_qwen3_omni(tmp_path: Path, seed: int = 0) -> Path:
    """A random Qwen3-Omni MoE thinker (four experts, two per token; Qwen3-VL's deepstack vision tower; Qwen3-Omni's
    chunked audio encoder) + tokenizer + one ``preprocessor_config.json`` with the WhisperFeatureExtractor (clips
    padded to 2 s) and the image processor (16-px patches), in ``tmp_path / "tiny_qwen3_omni"``."""
    import transformers

    folder = Path(tmp_path) / "tiny_qwen3_omni"
    tok = build_tokenizer(omni=True, qwen3_omni=True)
    torch.manual_seed(seed)
    audio, image, video, astart, vstart, user = _ids(
        tok, "<|audio_pad|>", "<|image_pad|>", "<|video_pad|>", "<|audio_start|>", "<|vision_start|>", "<|im_start|>")
    text = _text_config(tok)
    text.update(head_dim=16, **_EXPERTS, decoder_sparse_step=1,
                rope_parameters=dict(text["rope_parameters"], mrope_interleaved=True))
    config = transformers.Qwen3OmniMoeThinkerConfig(
        audio_config={"d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                      "num_mel_bins": 128, "max_source_positions": 1500, "output_dim": 64,
                      "downsample_hidden_size": 16},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "patch_size": 16, "num_position_embeddings": 64, "deepstack_visual_indexes": [1]},
        text_config=text, audio_token_id=audio, image_token_id=image, video_token_id=video,
        audio_start_token_id=astart, vision_start_token_id=vstart, user_token_id=user)
    transformers.Qwen3OmniMoeThinkerForConditionalGeneration(config).save_pretrained(folder)
    return _save_omni_processors(folder, tok, qwen3_vl_image_processor())


def qwen3_vl_image_processor() -> Qwen2VLImageProcessorPil:
    """Qwen3-VL's geometry (16-px patches, 2x2 merge) on small images."""
    return Qwen2VLImageProcessorPil(size={"shortest_edge": 64 * 64, "longest_edge": 128 * 128}, patch_size=16,
                                    temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def _build_qwen3_vision_language(folder: Path, class_prefix: str, text_extra: dict, vision_extra: dict) -> Path:
    """A random ``{class_prefix}ForConditionalGeneration`` (interleaved mrope text, a two-block vision tower) with the
    VL tokenizer and `qwen3_vl_image_processor`, saved to ``folder``."""
    import transformers

    tok = build_tokenizer(omni=False)
    torch.manual_seed(0)
    text = _text_config(tok)
    text.update(head_dim=16, rope_parameters=dict(text["rope_parameters"], mrope_interleaved=True), **text_extra)
    image_id, video_id, start, end = _ids(tok, "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    config = getattr(transformers, f"{class_prefix}Config")(
        text_config=text, image_token_id=image_id, video_token_id=video_id, vision_start_token_id=start,
        vision_end_token_id=end,
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "patch_size": 16, "num_position_embeddings": 64, **vision_extra})
    getattr(transformers, f"{class_prefix}ForConditionalGeneration")(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    qwen3_vl_image_processor().save_pretrained(folder)
    return folder


def build_tiny_qwen3_vl(tmp_path, experts: bool = False) -> Path:
    """A random Qwen3-VL (16-px patches, deepstack, interleaved mrope) with its image processor; ``experts``: the
    Qwen3-VL MoE layout (four experts, two per token)."""
    return _build_qwen3_vision_language(
        tmp_path / ("tiny_qwen3_vl_moe" if experts else "tiny_qwen3_vl"), "Qwen3VLMoe" if experts else "Qwen3VL",
        {**_EXPERTS, "decoder_sparse_step": 1} if experts else {}, {"deepstack_visual_indexes": [1]})


def build_tiny_qwen3_5_vl(tmp_path, experts: bool = False) -> Path:
    """A random Qwen3.5 vision-language model (three gated-DeltaNet layers and one full-attention layer, a vision
    tower without deepstack) with its image processor; ``experts``: the Qwen3.5 MoE layout."""
    linear = {"num_hidden_layers": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
              "linear_key_head_dim": 16, "linear_value_head_dim": 16}
    return _build_qwen3_vision_language(
        tmp_path / ("tiny_qwen3_5_vl_moe" if experts else "tiny_qwen3_5_vl"), "Qwen3_5Moe" if experts else "Qwen3_5",
        {**linear, **({**_EXPERTS, "shared_expert_intermediate_size": 32} if experts else {})}, {})


def no_video(cls):
    """``cls`` accepting ``video_processor=None`` (torchvision is unusable, so there is no video processor)."""

    class Processor(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and "video" in argument_name:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    Processor.__name__ = cls.__name__
    return Processor


def vl_processor(folder: Path):
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLProcessor

    tok = AutoTokenizer.from_pretrained(folder)
    return no_video(Qwen2_5_VLProcessor)(image_processor=AutoImageProcessor.from_pretrained(folder), tokenizer=tok,
                                         chat_template=tok.chat_template)


def omni_processor(folder: Path):
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer, Qwen2_5OmniProcessor

    tok = AutoTokenizer.from_pretrained(folder)
    return no_video(Qwen2_5OmniProcessor)(
        image_processor=AutoImageProcessor.from_pretrained(folder),
        feature_extractor=AutoFeatureExtractor.from_pretrained(folder), tokenizer=tok, chat_template=tok.chat_template)


# -------------------------------------------------------------------------------------------------------- datasets


def _write_rows(folder: Path, name: str, rows: list[dict]) -> Path:
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_image_rows(tmp_path: Path, n: int, seed: int = 0, size: int = 56) -> Path:
    """``n`` PNGs with 1-4 black squares, rows {"prompt": "<image>...", "images": ["images/i_00001.png"], "label"}."""
    from PIL import Image, ImageDraw

    folder = Path(tmp_path) / "image_data"
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(1, n + 1):
        count = rng.randint(1, 4)
        image = Image.new("RGB", (size, size), "white")
        draw = ImageDraw.Draw(image)
        for k in range(count):  # a 2x2 grid of cells, one square per used cell
            x, y = (k % 2) * size // 2 + 4, (k // 2) * size // 2 + 4
            draw.rectangle((x, y, x + size // 4, y + size // 4), fill="black")
        name = f"images/i_{i:05d}.png"
        image.save(folder / name)
        rows.append({"prompt": "<image>" + QUESTIONS["image"], "images": [name], "label": str(count)})
    return _write_rows(folder, "rows", rows)


def make_audio_rows(tmp_path: Path, n: int, seed: int = 0, seconds: float = 1.0) -> Path:
    """``n`` 16 kHz wavs with two tones, rows {"prompt": "<audio>...", "audios": ["audio/a_00001.wav"], "label"}."""
    import soundfile

    folder = Path(tmp_path) / "audio_data"
    (folder / "audio").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    half = int(16000 * seconds / 2)
    t = np.arange(half) / 16000
    for i in range(1, n + 1):
        first = rng.uniform(300, 1000)
        label = rng.choice(["higher", "lower"])
        second = first * 1.5 if label == "higher" else first / 1.5
        clip = np.concatenate([0.5 * np.sin(2 * np.pi * first * t), 0.5 * np.sin(2 * np.pi * second * t)])
        name = f"audio/a_{i:05d}.wav"
        soundfile.write(folder / name, clip.astype(np.float32), 16000)
        rows.append({"prompt": "<audio>" + QUESTIONS["audio"], "audios": [name], "label": label})
    return _write_rows(folder, "rows", rows)


def make_video_rows(tmp_path: Path, n: int, seed: int = 0, frames: int = 8, size: int = 56,
                    sound: bool = False) -> Path:
    """``n`` mp4 clips (PyAV, libx264) of a dot moving left or right, rows {"prompt": "<video>...",
    "videos": ["videos/v_00001.mp4"], "label": "left"|"right"}; ``sound``: every other clip also has an AAC
    track (a tone rising for "right", falling for "left"), the others are silent."""
    import av
    from PIL import Image, ImageDraw

    folder = Path(tmp_path) / "video_data"
    (folder / "videos").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(1, n + 1):
        label = rng.choice(["left", "right"])
        step = 4 if label == "right" else -4
        x0 = 8 if label == "right" else size - 8
        name = f"videos/v_{i:05d}.mp4"
        with av.open(str(folder / name), mode="w") as container:
            stream = container.add_stream("libx264", rate=4)
            stream.width, stream.height, stream.pix_fmt = size, size, "yuv420p"
            track = container.add_stream("aac", rate=16000, layout="mono") if sound and i % 2 else None
            for k in range(frames):
                image = Image.new("RGB", (size, size), "white")
                x = x0 + step * k
                ImageDraw.Draw(image).ellipse((x - 5, size // 2 - 5, x + 5, size // 2 + 5), fill="black")
                for packet in stream.encode(av.VideoFrame.from_image(image)):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
            if track is not None:  # as long as the video (frames / 4 fps), in AAC's 1024-sample frames
                t = np.arange(16000 * frames // 4) / 16000
                pitch = 440 * (1 + t) if label == "right" else 880 / (1 + t)
                samples = (0.3 * np.sin(2 * np.pi * pitch * t)).astype(np.float32)
                for start in range(0, len(samples), 1024):
                    chunk = np.zeros((1, 1024), np.float32)
                    piece = samples[start:start + 1024]
                    chunk[0, :len(piece)] = piece
                    frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="mono")
                    frame.sample_rate = 16000
                    for packet in track.encode(frame):
                        container.mux(packet)
                for packet in track.encode():
                    container.mux(packet)
        rows.append({"prompt": "<video>" + QUESTIONS["video"], "videos": [name], "label": label})
    return _write_rows(folder, "rows", rows)
