"""The prompt data and its media (sections: data, multimodal)"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, field_validator

from relax.config.base import setting
from relax.data.chat_template import template_kwargs_problem


class DataSettings(BaseModel):
    """The prompt data and its media."""
    prompt_data: str | None = setting(
        None,
        "Training prompts: a .jsonl, .json (JSON lines or one array of objects) or .parquet file, optionally sliced "
        "as `file.jsonl@[0:100]`.",
        "data", path=True,
    )
    input_key: str = setting("input", "Row field holding the prompt (a string or a list of chat messages).", "data")
    label_key: str | None = setting("label", "Row field holding the reference answer given to the reward.", "data")
    chosen_key: str = setting("chosen", "Row field holding the preferred completion of --loss-type dpo or rm (a "
                              "string or a list of assistant messages).", "data")
    rejected_key: str = setting("rejected", "Row field holding the dispreferred completion of --loss-type dpo or rm.",
                                "data")
    margin_key: str | None = setting(
        None, "--loss-type rm: row field holding how much the chosen completion must outscore the rejected one (a "
        "number; the Bradley-Terry loss becomes -log sigmoid(r_c - r_r - margin), as Llama 2's and TRL's). "
        "Default: no margin.", "data")
    metadata_key: str = setting("metadata", "Row field holding a dict copied into `Sample.metadata`.", "data")
    apply_chat_template: bool = setting(
        False, "Render prompts with the tokenizer's chat template (a string prompt becomes one user message).", "data"
    )
    apply_chat_template_kwargs: dict[str, Any] = setting(
        {}, "Extra keyword arguments for `apply_chat_template` (JSON), e.g. `{\"enable_thinking\": false}`.", "data"
    )
    system_prompt: str | None = setting(None, "A system message put before every prompt (needs the chat template).", "data")
    tool_key: str | None = setting(
        None,
        "Row field listing the tools the prompt offers: tool names (`python`, `calculator`, a --tools function's "
        "name) or OpenAI-style function specs, as a list or a JSON string. The chat template shows them to the "
        "model and they go into `Sample.metadata[\"tools\"]` for relax.rollout.agentic.tool_env (docs/agentic.md).",
        "data",
    )
    rollout_shuffle: bool = setting(False, "Shuffle the prompts, with a new order each epoch.", "data")
    rollout_seed: int = setting(42, "Seed of the prompt order and of rollout sampling.", "data")
    multimodal_keys: dict[str, str] = setting(
        {},
        "Media columns by type (JSON), e.g. `{\"image\": \"images\", \"audio\": \"audios\"}`. `<image>`, `<video>`, "
        "`<audio>` in prompts take the next item of that column; inline typed message items work too. Media may be "
        "paths (relative to the data file), file:// URLs, bytes, base64, data URIs or {bytes|base64|path} dicts.",
        "multimodal",
    )
    image_min_token_num: int = setting(4, "Fewest tokens per image (smart resize).", "multimodal", ge=1)
    image_max_token_num: int = setting(16384, "Most tokens per image (smart resize).", "multimodal", ge=1)
    image_resize_scale_factor: int | None = setting(
        None, "Image sides are resized to multiples of this (default patch x merge of the model; 0: off).",
        "multimodal", ge=0,
    )
    video_min_token_num: int = setting(128, "Fewest tokens per video frame budget.", "multimodal", ge=1)
    video_max_token_num: int = setting(768, "Most tokens per video frame budget.", "multimodal", ge=1)
    video_fps: float = setting(2.0, "Frames sampled per second of video.", "multimodal", gt=0)
    video_fps_min_frames: int = setting(4, "Fewest frames sampled from a video.", "multimodal", ge=1)
    video_fps_max_frames: int = setting(768, "Most frames sampled from a video.", "multimodal", ge=1)
    frame_factor: int = setting(2, "Sampled frame counts are multiples of this.", "multimodal", ge=1)
    audio_sample_rate: int = setting(16000, "Audio is resampled to this rate (Hz).", "multimodal", ge=1)
    use_audio_in_video: bool = setting(
        False, "Give an omni model each video's sound track too, inside the video's tokens and interleaved with its "
        "frames by time (the Qwen3-Omni thinker's use_audio_in_video); a video without sound gets silence of its "
        "length. Needs video in --multimodal-keys.", "multimodal")
    mm_processor_pool_size: int = setting(
        2, "Worker threads that decode and process media off the rollout loop.", "multimodal", ge=1
    )
    skip_bad_samples: bool = setting(
        False, "Skip (and count) rows whose media cannot be read instead of stopping with an error.", "multimodal"
    )
    freeze_vision_tower: bool = setting(False, "Do not train the vision encoder.", "multimodal")
    freeze_audio_tower: bool = setting(False, "Do not train the audio encoder.", "multimodal")

    @field_validator("apply_chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any]) -> dict[str, Any]:
        problem = template_kwargs_problem(value)
        if problem:
            raise ValueError(problem)
        return value
