"""Media processing for image, video and audio inputs (the `relax.data` side package; no engine/trainer imports).

Layers, bottom up (each module's docstring says why it works the way it does):

- `errors`:       `MediaError(ValueError)`, always naming row and field; `media_context(row, field, index)`.
- `settings`:     `MultimodalSettings` (upstream's `--image-*`, `--video-*`, `--frame-factor`, `--audio-sample-rate`,
                  `--image-resize-scale-factor` knobs), `VisionSpec` (patch/merge/temporal geometry + mean/std of the
                  checkpoint), `parse_multimodal_keys` (`--multimodal-keys`).
- `media`:        `resolve_source(item) -> MediaSource` for path / file:// / bytes / base64 / data: / dict items;
                  `load_image(item) -> PIL.Image`. http(s) is refused (no network during rollout).
- `image`:        `smart_resize(h, w, factor, min_pixels, max_pixels)`, `to_rgb`, `resize_image`, `fetch_image`.
- `video`:        `smart_nframes`, `sample_frame_indices`, `frame_pixel_bounds`, `fetch_video -> VideoClip` (PyAV).
- `audio`:        `load_audio(item, sample_rate) -> float32 mono` (soundfile, PyAV for containers, soxr).
- `vision`:       `patchify(frames, spec)` / `batch_patchify` -> Qwen2-VL `pixel_values(_videos)` + `grid_thw`,
                  bit-identical to the HF image processor, no torchvision.
- `placeholders`: `resolve_row` / `resolve_prompt`: `<image>`/`<video>`/`<audio>` and typed items -> chat messages.
- `pool`:         `MultimodalProcessor` (thread/process pool, sync `process_batch` and async `process`),
                  `process_row`, `ProcessedRow`, `BatchResult`.
"""

from relax.data.multimodal.audio import load_audio
from relax.data.multimodal.errors import MediaError, media_context
from relax.data.multimodal.image import fetch_image, resize_image, smart_resize, to_rgb
from relax.data.multimodal.media import MediaSource, load_image, resolve_source
from relax.data.multimodal.placeholders import MediaRef, ResolvedPrompt, resolve_prompt, resolve_row
from relax.data.multimodal.pool import (
    BatchResult,
    MultimodalProcessor,
    ProcessedRow,
    RowProcessingConfig,
    process_row,
)
from relax.data.multimodal.settings import (
    MEDIA_TYPES,
    MultimodalSettings,
    VisionSpec,
    image_alignment_factor,
    image_pixel_bounds,
    parse_multimodal_keys,
)
from relax.data.multimodal.video import (
    VideoClip,
    fetch_video,
    frame_pixel_bounds,
    sample_frame_indices,
    smart_nframes,
)
from relax.data.multimodal.vision import batch_patchify, num_tokens, patchify

__all__ = [
    "MEDIA_TYPES",
    "BatchResult",
    "MediaError",
    "MediaRef",
    "MediaSource",
    "MultimodalProcessor",
    "MultimodalSettings",
    "ProcessedRow",
    "ResolvedPrompt",
    "RowProcessingConfig",
    "VideoClip",
    "VisionSpec",
    "batch_patchify",
    "fetch_image",
    "fetch_video",
    "frame_pixel_bounds",
    "image_alignment_factor",
    "image_pixel_bounds",
    "load_audio",
    "load_image",
    "media_context",
    "num_tokens",
    "parse_multimodal_keys",
    "patchify",
    "process_row",
    "resize_image",
    "resolve_prompt",
    "resolve_row",
    "resolve_source",
    "sample_frame_indices",
    "smart_nframes",
    "smart_resize",
    "to_rgb",
]
