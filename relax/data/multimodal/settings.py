"""`MultimodalSettings` (upstream's multimodal knobs), `VisionSpec` (the vision encoder's geometry) and
`parse_multimodal_keys` (the `--multimodal-keys` flag).

Field names equal upstream's flag names with underscores (`--video-fps` -> `video_fps`) and the defaults follow
qwen-vl-utils, so a config written for upstream Relax means the same thing here.

Token limits become pixel limits through the vision geometry: one LLM token covers a
`(patch_size * merge_size)^2` pixel square (28 x 28 for Qwen2/2.5-VL, 32 x 32 for Qwen3-VL), so
`image_max_token_num=16384` allows 16384 * 784 ~= 12.85 M pixels per image and `image_min_token_num=4` needs 3136.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MEDIA_TYPES = ("image", "video", "audio")
MULTIMODAL_KEYS_FLAG = "--multimodal-keys"

# OpenAI CLIP normalisation, the default of every Qwen2-VL-family image processor.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class MultimodalSettings:
    """Upstream's multimodal knobs; see the module docstring for how tokens map to pixels."""

    image_min_token_num: int = 4
    image_max_token_num: int = 16384
    video_min_token_num: int = 128
    video_max_token_num: int = 768
    video_fps: float = 2.0
    video_fps_min_frames: int = 4
    video_fps_max_frames: int = 768
    frame_factor: int = 2
    audio_sample_rate: int = 16000
    # Each video's sound track joins the prompt as audio interleaved with its frames (the omni thinkers'
    # use_audio_in_video); a silent video gets silence of its length.
    use_audio_in_video: bool = False
    # None: align image sizes to patch_size * merge_size; 0: no alignment (only the pixel bounds apply).
    image_resize_scale_factor: int | None = None

    def __post_init__(self) -> None:
        for name in ("image_min_token_num", "video_min_token_num", "video_fps_min_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.image_max_token_num < self.image_min_token_num:
            raise ValueError("image_max_token_num must be >= image_min_token_num")
        if self.video_max_token_num < self.video_min_token_num:
            raise ValueError("video_max_token_num must be >= video_min_token_num")
        if self.video_fps_max_frames < self.video_fps_min_frames:
            raise ValueError("video_fps_max_frames must be >= video_fps_min_frames")
        if self.video_fps <= 0:
            raise ValueError(f"video_fps must be > 0, got {self.video_fps}")
        if self.frame_factor < 1:
            raise ValueError(f"frame_factor must be >= 1, got {self.frame_factor}")
        if self.audio_sample_rate <= 0:
            raise ValueError(f"audio_sample_rate must be > 0, got {self.audio_sample_rate}")
        if self.image_resize_scale_factor is not None and self.image_resize_scale_factor < 0:
            raise ValueError("image_resize_scale_factor must be None, 0 (disabled) or a positive integer")

    @classmethod
    def from_config(cls, config: Any) -> MultimodalSettings:
        """Build from any object or mapping that carries some of the fields (e.g. the run's pydantic config)."""
        get = config.get if isinstance(config, Mapping) else lambda k, d: getattr(config, k, d)
        defaults = cls()
        return cls(**{f: get(f, getattr(defaults, f)) for f in cls.__dataclass_fields__})


@dataclass(frozen=True)
class VisionSpec:
    """Geometry and normalisation of the vision encoder's input, read from its image processor.

    Kept apart from `MultimodalSettings` because it is a property of the checkpoint, not a user knob.
    """

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, ...] = field(default=CLIP_MEAN)
    image_std: tuple[float, ...] = field(default=CLIP_STD)

    @property
    def token_pixel_side(self) -> int:
        """Side of the pixel square one LLM token covers (28 for Qwen2-VL)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_image_processor(cls, processor: Any) -> VisionSpec:
        """Read the geometry from a Hugging Face Qwen-VL image processor (or anything with the same attributes)."""
        d = cls()
        return cls(
            patch_size=int(getattr(processor, "patch_size", d.patch_size)),
            merge_size=int(getattr(processor, "merge_size", d.merge_size)),
            temporal_patch_size=int(getattr(processor, "temporal_patch_size", d.temporal_patch_size)),
            image_mean=tuple(float(x) for x in getattr(processor, "image_mean", d.image_mean)),
            image_std=tuple(float(x) for x in getattr(processor, "image_std", d.image_std)),
        )


def image_alignment_factor(settings: MultimodalSettings, spec: VisionSpec) -> int | None:
    """The multiple image sides are rounded to: `image_resize_scale_factor`, its default patch*merge, or None (0)."""
    if settings.image_resize_scale_factor is None:
        return spec.token_pixel_side
    return settings.image_resize_scale_factor or None


def image_pixel_bounds(settings: MultimodalSettings, spec: VisionSpec) -> tuple[int, int]:
    """(min_pixels, max_pixels) of one image: the token limits times the pixels one token covers."""
    px = spec.token_pixel_side**2
    return settings.image_min_token_num * px, settings.image_max_token_num * px


def parse_multimodal_keys(value: str | Mapping[str, str] | None) -> dict[str, str]:
    """Validate `--multimodal-keys`: a JSON object (or dict) mapping a media type to a dataset column.

    `{"image": "images", "video": "videos", "audio": "audios"}`. None or "" means no media columns. Every error
    names the flag so the user knows which option to fix.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{MULTIMODAL_KEYS_FLAG} is not valid JSON ({err.msg}): {value!r}") from None
    if not isinstance(value, Mapping):  # ValueError, not TypeError: callers catch one type for a bad flag
        raise ValueError(  # noqa: TRY004
            f"{MULTIMODAL_KEYS_FLAG} must be a JSON object mapping media type to column, got {value!r}"
        )
    keys: dict[str, str] = {}
    for media_type, column in value.items():
        if media_type not in MEDIA_TYPES:
            raise ValueError(
                f"{MULTIMODAL_KEYS_FLAG}: unknown media type {media_type!r}; expected one of {', '.join(MEDIA_TYPES)}"
            )
        if not isinstance(column, str) or not column:
            raise ValueError(f"{MULTIMODAL_KEYS_FLAG}: column for {media_type!r} must be a non-empty string")
        keys[media_type] = column
    if len(set(keys.values())) != len(keys):
        raise ValueError(f"{MULTIMODAL_KEYS_FLAG}: two media types map to the same column: {keys}")
    return keys
