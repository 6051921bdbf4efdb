"""Image sizing for Qwen-VL-family encoders: `smart_resize`, RGB conversion, extreme aspect ratios.

`smart_resize` is the qwen-vl-utils rule: round each side to the nearest multiple of `factor`
(= patch_size * merge_size, 28 for Qwen2-VL), then, if the area leaves `[min_pixels, max_pixels]`, rescale both sides
by the same `beta` (floor when shrinking, ceil when growing) so the aspect ratio is kept as closely as the grid allows.
The result is exactly a whole number of LLM tokens: `(h / factor) * (w / factor)`.

qwen-vl-utils and the HF processors reject an aspect ratio above 200. Like upstream Relax, `fetch_image` first widens
the short side of such images to a ratio of 199 (keeping the long side's pixels), so a rare panorama or ruler image
costs a few tokens instead of killing the row; `smart_resize` itself still raises for callers that want the check.
"""

from __future__ import annotations

import math
from typing import Any

from PIL import Image

from relax.data.multimodal.media import load_image
from relax.data.multimodal.settings import MultimodalSettings, VisionSpec, image_alignment_factor, image_pixel_bounds

MAX_ASPECT_RATIO = 200
SAFE_ASPECT_RATIO = 199


def round_by_factor(number: float, factor: int) -> int:
    """Nearest multiple of `factor` (Python's round: halves go to the even quotient)."""
    return round(number / factor) * factor


def ceil_by_factor(number: float, factor: int) -> int:
    """Smallest multiple of `factor` >= `number`."""
    return math.ceil(number / factor) * factor


def floor_by_factor(number: float, factor: int) -> int:
    """Largest multiple of `factor` <= `number`."""
    return math.floor(number / factor) * factor


def smart_resize(
    height: int, width: int, factor: int | None = 28, min_pixels: int = 4 * 28 * 28, max_pixels: int = 16384 * 28 * 28
) -> tuple[int, int]:
    """Target `(height, width)`: sides multiples of `factor` (None: no alignment), area within the pixel bounds.

    Raises ValueError for an aspect ratio above 200 or inconsistent bounds.
    """
    if height < 1 or width < 1:
        raise ValueError(f"image has an empty side: {height}x{width}")
    if max_pixels < min_pixels:
        raise ValueError(f"max_pixels ({max_pixels}) must be >= min_pixels ({min_pixels})")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got {ratio}")
    f = factor or 1
    h_bar = max(f, round_by_factor(height, f))
    w_bar = max(f, round_by_factor(width, f))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(f, floor_by_factor(height / beta, f))
        w_bar = max(f, floor_by_factor(width / beta, f))
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = ceil_by_factor(height * beta, f)
        w_bar = ceil_by_factor(width * beta, f)
    return h_bar, w_bar


def widened_size(height: int, width: int) -> tuple[int, int]:
    """Size with the short side grown so the aspect ratio is at most 199 (unchanged when already <= 200)."""
    if max(height, width) / max(min(height, width), 1) <= MAX_ASPECT_RATIO:
        return height, width
    short = math.ceil(max(height, width) / SAFE_ASPECT_RATIO)
    return (height, short) if height > width else (short, width)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB copy of `image`; transparent pixels are composited over white (as upstream), not turned black."""
    if image.mode == "RGB":
        return image
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA"):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


def resize_image(image: Image.Image, settings: MultimodalSettings, spec: VisionSpec) -> Image.Image:
    """RGB image resized (bicubic) to the `smart_resize` target for this model and these settings."""
    image = to_rgb(image)
    height, width = widened_size(image.height, image.width)
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), Image.Resampling.LANCZOS)
    min_pixels, max_pixels = image_pixel_bounds(settings, spec)
    target_h, target_w = smart_resize(height, width, image_alignment_factor(settings, spec), min_pixels, max_pixels)
    if (target_h, target_w) == (height, width):
        return image
    return image.resize((target_w, target_h), Image.Resampling.BICUBIC)


def fetch_image(item: Any, settings: MultimodalSettings, spec: VisionSpec) -> Image.Image:
    """Load an image item (any form `media.resolve_source` accepts, or a PIL image) and `resize_image` it."""
    return resize_image(load_image(item), settings, spec)
