"""Video: decode with PyAV, pick frames the qwen-vl-utils way, resize every frame to one token-budgeted size.

Frame count (`smart_nframes`, qwen-vl-utils semantics)::

    min_frames = ceil_by_factor(video_fps_min_frames, frame_factor)
    max_frames = floor_by_factor(min(video_fps_max_frames, total), frame_factor)
    nframes    = floor_by_factor(min(max(total / source_fps * video_fps, min_frames), max_frames, total), frame_factor)

i.e. about `video_fps` frames per second of video, clamped, and a multiple of `frame_factor` (the encoder's temporal
patch, 2) so no frame is wasted on padding. Frames are taken at `round(linspace(0, total - 1, nframes))`. A clip
shorter than `frame_factor` frames keeps all its frames (qwen-vl-utils raises; the temporal padding of
`vision.patchify` covers it).

Per-frame pixels lie in `[video_min_token_num, video_max_token_num] * (patch*merge)^2`; with a `total_token_budget`
(qwen-vl-utils' `total_pixels`) the upper bound is also capped at an even share of that budget per temporal pair.
The size comes from `image.smart_resize` on the first frame and applies to all frames. Resizing uses PIL bicubic, as
the PIL image processor does, so a video's patches equal the image path's on the same frames.

Decoding is sequential (inter-frame codecs need it), but only the selected frames are converted to RGB and resized,
so memory is O(sampled frames), not O(all frames). A list of image items is accepted as an already-sampled video.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from relax.data.multimodal.errors import MediaError
from relax.data.multimodal.image import ceil_by_factor, floor_by_factor, smart_resize, to_rgb
from relax.data.multimodal.media import load_image, resolve_source
from relax.data.multimodal.settings import MultimodalSettings, VisionSpec


@dataclass
class VideoClip:
    """Sampled, resized frames of one video and the timing the model's rope needs."""

    frames: np.ndarray  # uint8 (T, H, W, 3); H, W multiples of patch*merge
    frame_indices: np.ndarray  # int64 (T,), indices into the source video
    total_frames: int
    source_fps: float
    sample_fps: float  # frames per second of the sampled clip: T / total * source_fps

    def seconds_per_grid(self, spec: VisionSpec) -> float:
        """Seconds one temporal patch spans (`second_per_grid_ts` of Qwen2.5-VL)."""
        return spec.temporal_patch_size / self.sample_fps

    def grid_seconds(self, spec: VisionSpec) -> list[float]:
        """Each temporal patch's time in the source video: the mean of its first and last frame's time, the frame
        list padded with its last frame to whole patches (the timestamps Qwen3-VL's processor writes per frame)."""
        indices = [int(i) for i in self.frame_indices]
        size = spec.temporal_patch_size
        indices += [indices[-1]] * (-len(indices) % size)
        fps = self.source_fps if self.source_fps > 0 else self.sample_fps
        return [(indices[i] + indices[i + size - 1]) / 2 / fps for i in range(0, len(indices), size)]


def smart_nframes(total_frames: int, source_fps: float, settings: MultimodalSettings) -> int:
    """How many frames to sample from a video of `total_frames` at `source_fps` (see the module docstring)."""
    if total_frames < 1:
        raise MediaError("zero-length video (no frames)")
    factor = settings.frame_factor
    if total_frames < factor:
        return total_frames
    min_frames = ceil_by_factor(settings.video_fps_min_frames, factor)
    max_frames = floor_by_factor(min(settings.video_fps_max_frames, total_frames), factor)
    wanted = total_frames / source_fps * settings.video_fps if source_fps > 0 else total_frames
    return max(factor, floor_by_factor(min(max(wanted, min_frames), max_frames, total_frames), factor))


def sample_frame_indices(total_frames: int, nframes: int) -> np.ndarray:
    """Evenly spread frame indices: `round(linspace(0, total - 1, nframes))` (round half to even, like torch)."""
    return np.round(np.linspace(0, total_frames - 1, nframes)).astype(np.int64)


def frame_pixel_bounds(
    nframes: int, settings: MultimodalSettings, spec: VisionSpec, total_token_budget: int | None = None
) -> tuple[int, int]:
    """(min_pixels, max_pixels) of each frame from the video token limits (and an optional whole-video budget)."""
    px = spec.token_pixel_side**2
    min_pixels = settings.video_min_token_num * px
    max_pixels = settings.video_max_token_num * px
    if total_token_budget is not None:
        share = total_token_budget * px * 0.9 / max(nframes, 1) * settings.frame_factor
        max_pixels = max(min(max_pixels, share), int(min_pixels * 1.05))
    return min_pixels, int(max_pixels)


def resize_frames(frames: list[Image.Image], bounds: tuple[int, int], spec: VisionSpec) -> np.ndarray:
    """Stack RGB frames resized (bicubic) to the `smart_resize` size of the first frame."""
    width, height = frames[0].size
    target_h, target_w = smart_resize(height, width, spec.token_pixel_side, *bounds)
    out = np.empty((len(frames), target_h, target_w, 3), dtype=np.uint8)
    for i, frame in enumerate(frames):
        frame = to_rgb(frame)
        if frame.size != (target_w, target_h):
            frame = frame.resize((target_w, target_h), Image.Resampling.BICUBIC)
        out[i] = np.asarray(frame)
    return out


def _open_container(source):
    import av

    try:
        return av.open(source.open(), mode="r")
    except av.FFmpegError as err:
        raise MediaError(f"unreadable video ({err})") from None


def probe_video(item: Any) -> tuple[int, float]:
    """(total_frames, fps) of a video item; counts packets when the container does not store a frame count."""
    source = resolve_source(item)
    with _open_container(source) as container:
        if not container.streams.video:
            raise MediaError("no video stream in file")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
        total = int(stream.frames or 0)
        if total <= 0:
            total = sum(1 for packet in container.demux(stream) if packet.size)
    return total, fps


def decode_frames(item: Any, indices: np.ndarray) -> list[Image.Image]:
    """Decode the frames at `indices` (sorted) as PIL images; indices past a short stream reuse its last frame."""
    import av

    wanted = indices.tolist()
    wanted_set, stop = set(wanted), wanted[-1]
    picked: dict[int, Image.Image] = {}
    last: Image.Image | None = None
    source = resolve_source(item)
    with _open_container(source) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        try:
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted_set:
                    last = picked[i] = frame.to_image()
                if i >= stop:
                    break
        except av.FFmpegError as err:
            if not picked:
                raise MediaError(f"corrupt video ({err})") from None
    if last is None:
        raise MediaError("zero-length video (no decodable frames)")
    return [picked.get(i, last) for i in wanted]


def fetch_video(
    item: Any, settings: MultimodalSettings, spec: VisionSpec, total_token_budget: int | None = None
) -> VideoClip:
    """Load a video item (file/bytes, or a list of image items as pre-sampled frames) into a `VideoClip`."""
    if isinstance(item, (list, tuple)):
        return _clip_from_images(item, settings, spec, total_token_budget)
    total, fps = probe_video(item)
    nframes = smart_nframes(total, fps, settings)
    indices = sample_frame_indices(total, nframes)
    frames = decode_frames(item, indices)
    bounds = frame_pixel_bounds(len(frames), settings, spec, total_token_budget)
    source_fps = fps if fps > 0 else settings.video_fps
    return VideoClip(
        frames=resize_frames(frames, bounds, spec),
        frame_indices=indices,
        total_frames=total,
        source_fps=source_fps,
        sample_fps=nframes / total * source_fps,
    )


def _clip_from_images(
    items: list | tuple, settings: MultimodalSettings, spec: VisionSpec, total_token_budget: int | None
) -> VideoClip:
    if not items:
        raise MediaError("zero-length video (empty frame list)")
    frames = []
    for i, frame_item in enumerate(items):
        try:
            frames.append(load_image(frame_item))
        except MediaError as err:
            raise MediaError(f"frame {i}: {err.reason}") from None
    bounds = frame_pixel_bounds(len(frames), settings, spec, total_token_budget)
    return VideoClip(
        frames=resize_frames(frames, bounds, spec),
        frame_indices=np.arange(len(frames), dtype=np.int64),
        total_frames=len(frames),
        source_fps=settings.video_fps,
        sample_fps=settings.video_fps,
    )
