"""Turn prompt samples that carry media into model-ready samples, off the rollout loop.

A multimodal prompt sample holds its prompt (a string with `<image>`/`<video>`/`<audio>`
placeholders, or chat messages) and, in ``multimodal_inputs``, the raw media references of its
row by type. Preparing it (in the `MultimodalProcessor` worker pool) decodes and sizes the media,
renders the chat template, expands each placeholder to the item's token count and stores the
processor tensors in ``multimodal_train_inputs``. The engine and the trainer get those same
tensors, so generation and training see identical inputs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoFeatureExtractor, AutoImageProcessor

from relax.backends.models.family import (
    MediaTokens,
    audio_in_video_tokens,
    audio_token_counter,
    expand_placeholders,
    has_timestamped_video,
    placeholder_counts,
    timestamped_video_tokens,
)
from relax.data.chat_template import render_prompt
from relax.data.dataset import AnswerRoom
from relax.data.multimodal import (
    MediaError,
    MultimodalProcessor,
    MultimodalSettings,
    ProcessedRow,
    VisionSpec,
    fetch_image,
)
from relax.data.multimodal.pool import model_inputs
from relax.data.sample import Sample

logger = logging.getLogger("relax")

# The columns of the rows handed to the worker pool (the dataset's own column names are resolved at load).
POOL_KEYS = {"image": "images", "video": "videos", "audio": "audios"}
PROMPT_KEY = "prompt"


def vision_spec(model_path: str | Path, config) -> VisionSpec:
    """The vision geometry: from the saved image processor, else from the model config."""
    try:
        return VisionSpec.from_image_processor(AutoImageProcessor.from_pretrained(model_path))
    except (OSError, ValueError, KeyError):
        vision = getattr(config, "vision_config", None) or getattr(getattr(config, "thinker_config", None),
                                                                   "vision_config", None)
        if vision is None:
            return VisionSpec()
        return VisionSpec(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                          temporal_patch_size=getattr(vision, "temporal_patch_size", 2))


def audio_feature_extractor(model_path: str | Path, media_tokens: MediaTokens) -> Any:
    if media_tokens.audio is None:
        return None
    try:
        return AutoFeatureExtractor.from_pretrained(model_path)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{model_path}: an audio model needs its feature extractor saved beside it ({err})") from None


def audio_end_token(tokenizer: Any, model_config: Any, model_path: str | Path) -> int:
    """The token that closes an audio item: the config's, else the tokenizer's audio end token (Qwen3-Omni)."""
    configured = getattr(model_config, "audio_end_token_id", None)
    if configured is not None:
        return int(configured)
    name = getattr(tokenizer, "audio_eos_token", None)
    token = tokenizer.convert_tokens_to_ids(name) if name else None
    if token is None or token == tokenizer.unk_token_id:
        raise ValueError(f"{model_path}: --use-audio-in-video needs the audio end token, which neither the model "
                         "config (audio_end_token_id) nor the tokenizer (audio_eos_token) names")
    return int(token)


class MultimodalPreparer:
    def __init__(self, tokenizer: Any, model_config: Any, model_path: str | Path, settings: MultimodalSettings,
                 system_prompt: str | None, template_kwargs: dict[str, Any], pool_size: int,
                 skip_bad_samples: bool, answer_room: AnswerRoom | None = None):
        self.tokenizer = tokenizer
        self.media_tokens = MediaTokens.of(model_config)
        if not self.media_tokens.ids:
            raise ValueError(f"{model_path}: --multimodal-keys is set but the model has no media tokens "
                             f"({type(model_config).__name__} is a text model)")
        self.spec = vision_spec(model_path, model_config)
        self.audio_tokens = audio_token_counter(model_config)
        self.model_config = model_config
        # The room a prompt and its answer share on the engine (`relax.backends.inference.answer_room`; default:
        # the model's positions)
        positions = getattr(model_config.get_text_config(), "max_position_embeddings", None)
        self.answer_room = answer_room or (AnswerRoom.of_positions(positions)
                                           if isinstance(positions, int) and positions > 0 else None)
        if settings.use_audio_in_video:
            self.audio_end_id = audio_end_token(tokenizer, model_config, model_path)
        self.system_prompt = system_prompt
        self.template_kwargs = template_kwargs
        self.skip_bad_samples = skip_bad_samples
        self.processor = MultimodalProcessor(
            settings, POOL_KEYS, self.spec, max_workers=pool_size, skip_bad_samples=skip_bad_samples,
            audio_feature_extractor=audio_feature_extractor(model_path, self.media_tokens), prompt_key=PROMPT_KEY,
        )

    async def prepare(self, samples: list[Sample]) -> tuple[list[Sample], int]:
        """Fill tokens and processor tensors of the samples that still need them; returns the
        samples ready to use (in order) and how many were skipped for bad media."""
        todo = [s for s in samples if s.multimodal_inputs and not s.tokens]
        if not todo:
            return samples, 0
        rows = [{PROMPT_KEY: s.prompt, **{POOL_KEYS[k]: v for k, v in s.multimodal_inputs.items()}} for s in todo]
        result = await self.processor.process(rows, indices=[s.index for s in todo])
        processed = {row.index: row for row in result.rows}
        pending = {id(s) for s in todo}
        ready, skipped = [], 0
        for sample in samples:
            if id(sample) in pending and sample.index not in processed:
                skipped += 1
                continue
            if id(sample) in pending:
                try:
                    self._fill(sample, processed[sample.index])
                except ValueError as err:
                    if not self.skip_bad_samples:
                        raise MediaError(str(err), row=sample.index, field=PROMPT_KEY) from None
                    skipped += 1
                    continue
            ready.append(sample)
        for error in result.errors:
            logger.warning("skipped a sample: %s", error)
        return ready, skipped

    def _fill(self, sample: Sample, row) -> None:
        text = render_prompt(row.messages, self.tokenizer, True, self.system_prompt, self.template_kwargs)
        inputs = {key: torch.from_numpy(value) for key, value in row.model_inputs.items()}
        counts = placeholder_counts(inputs, self.spec.merge_size, self.audio_tokens)
        video_tokens = None
        if row.video_audio:  # each video's sound track sits inside its placeholder, not in an audio placeholder
            audio_counts = counts.pop("audio")
            video_tokens = [
                audio_in_video_tokens(self.model_config, inputs["video_grid_thw"][video], self.spec.merge_size,
                                      float(inputs["video_second_per_grid"][video]), audio_counts[audio],
                                      self.audio_end_id)
                for video, audio in enumerate(row.video_audio)]
            standalone = [n for index, n in enumerate(audio_counts) if index not in set(row.video_audio)]
            if standalone:
                counts["audio"] = standalone
        elif row.videos and has_timestamped_video(self.model_config):
            video_tokens = [
                timestamped_video_tokens(self.model_config, inputs["video_grid_thw"][i], self.spec.merge_size,
                                         clip.grid_seconds(self.spec), self._encode_plain)
                for i, clip in enumerate(row.videos)]
        token_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        tokens = expand_placeholders(list(token_ids), self.media_tokens, counts, video_tokens)
        if self.answer_room is not None and self.answer_room.refuses(len(tokens)):
            # known only now (each item's tokens follow its size); the engine had refused it mid-run, ending the run
            raise ValueError(f"{len(tokens)} prompt tokens with the media expanded leave no room for an answer within "
                             f"{self.answer_room.bound}; smaller media (--image-max-token-num, "
                             "--video-max-token-num), or --skip-bad-samples to skip such rows")
        sample.tokens = tokens
        sample.multimodal_train_inputs = inputs

    def _encode_plain(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def process_images(self, images: list[Any]) -> dict[str, torch.Tensor]:
        """Processor tensors of images an environment returned (PIL images or any media item), sized
        and patchified exactly like prompt images."""
        config = self.processor.config
        row = ProcessedRow(index=0, messages=[], images=[fetch_image(image, config.settings, self.spec)
                                                         for image in images])
        return {key: torch.from_numpy(value) for key, value in model_inputs(row, config).items()}

    def expand_media(self, token_ids: list[int], inputs: dict[str, torch.Tensor]) -> tuple[list[int], dict[str, torch.Tensor]]:
        """``token_ids`` with each media placeholder repeated by its item's token count, and ``inputs``."""
        counts = placeholder_counts(inputs, self.spec.merge_size, self.audio_tokens)
        return expand_placeholders(list(token_ids), self.media_tokens, counts), inputs

    def close(self) -> None:
        self.processor.close()
