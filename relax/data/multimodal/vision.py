"""Qwen2-VL patchification in numpy: `pixel_values` / `pixel_values_videos` and their `grid_thw`, without torchvision.

transformers' video processors import torchvision, which cannot be used with our torch build, so the video path is
implemented here. The layout is exactly `Qwen2VLVideoProcessor.patchify` (and, for one frame, the image processor's):

- frames `(T, H, W, C)` are padded to a multiple of `temporal_patch_size` by repeating the last frame (a single
  image therefore becomes two identical frames, which is what the image processor's temporal broadcast produces);
- `grid = (T / tp, H / patch, W / patch)`;
- rows are ordered `(t, h_block, w_block, h_in_block, w_in_block)` with `merge_size x merge_size` blocks, so each
  group of `merge_size^2` consecutive rows becomes one LLM token after the encoder's patch merger;
- each row is `(C, tp, patch, patch)` flattened: `C * tp * patch^2` = 1176 values for Qwen2-VL.

The transposes run on uint8 (4x less memory traffic than float32); normalisation `(x / 255 - mean) / std` then runs
in place on the one float32 output. The HF processor rescales in float64 and rounds to float32; `x / 255` done
directly in float32 is correctly rounded and gives the same float32 for every byte value (checked exhaustively by
`rescale_matches_hf`, which the tests assert), so the values match the HF image processor bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from relax.data.multimodal.settings import VisionSpec


def rescale_matches_hf() -> bool:
    """True when float32 `x / 255` equals the HF processor's `float32(float64(x) * (1 / 255))` for all 256 bytes."""
    x = np.arange(256)
    return bool(np.array_equal(x.astype(np.float32) / np.float32(255), (x * (1 / 255)).astype(np.float32)))


@lru_cache(maxsize=8)
def _column_stats(mean: tuple[float, ...], std: tuple[float, ...], per_channel: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-column float32 mean and std of a patch row (columns are grouped by channel)."""
    mean_col = np.repeat(np.asarray(mean, dtype=np.float32), per_channel)[None, :]
    std_col = np.repeat(np.asarray(std, dtype=np.float32), per_channel)[None, :]
    mean_col.setflags(write=False)
    std_col.setflags(write=False)
    return mean_col, std_col


def patchify(frames: np.ndarray, spec: VisionSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Normalised, flattened patches `(grid_t * grid_h * grid_w, C * tp * patch^2)` float32 and `(t, h, w)`.

    `frames` is uint8 `(T, H, W, C)` (or `(H, W, C)` for one image) with H and W multiples of patch*merge.
    """
    if frames.ndim == 3:
        frames = frames[None]
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[0] == 0:
        raise ValueError(f"expected non-empty uint8 frames (T, H, W, C), got {frames.dtype} {frames.shape}")
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    t, h, w, c = frames.shape
    if h % (p * m) or w % (p * m):
        raise ValueError(f"frame size {h}x{w} is not a multiple of patch_size*merge_size={p * m}; smart_resize first")
    if pad := -t % tp:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)], axis=0)
        t += pad
    gt, gh, gw = t // tp, h // p, w // p
    blocks = frames.reshape(gt, tp, gh // m, m, p, gw // m, m, p, c)
    # -> (gt, gh/m, gw/m, m_h, m_w, C, tp, p_h, p_w)
    blocks = blocks.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7).reshape(gt * gh * gw, c * tp * p * p)
    out = blocks.astype(np.float32)
    out /= np.float32(255)
    mean_col, std_col = _column_stats(tuple(spec.image_mean), tuple(spec.image_std), tp * p * p)
    out -= mean_col
    out /= std_col
    return out, (gt, gh, gw)


def num_tokens(grid_thw: Sequence[int], spec: VisionSpec) -> int:
    """LLM tokens one image/video occupies: `t * h * w / merge_size^2`."""
    t, h, w = grid_thw
    return t * h * w // (spec.merge_size**2)


def batch_patchify(arrays: Sequence[np.ndarray], spec: VisionSpec) -> tuple[np.ndarray, np.ndarray]:
    """Patchify several images or videos and concatenate them, as the HF processors return a batch.

    Returns `(pixel_values (sum N_i, D) float32, grid_thw (n, 3) int64)`.
    """
    if not arrays:
        d = 3 * spec.temporal_patch_size * spec.patch_size**2
        return np.zeros((0, d), dtype=np.float32), np.zeros((0, 3), dtype=np.int64)
    outputs = [patchify(a, spec) for a in arrays]
    pixel_values = outputs[0][0] if len(outputs) == 1 else np.concatenate([o[0] for o in outputs], axis=0)
    return pixel_values, np.asarray([o[1] for o in outputs], dtype=np.int64)
