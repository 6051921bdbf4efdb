"""Tiny real media files for the multimodal tests (PNG via PIL, mp4/m4a via PyAV), plus checks that they are real.

Imported by tests/data/test_multimodal_*.py and tests/e2e/test_multimodal_train.py; tests/data/test_multimodal_video_audio.py checks that the encoders work, so a
broken encoder setup fails there with a clear name rather than as a puzzling decode error elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def write_png(path: Path, height: int = 40, width: int = 60, seed: int = 0, mode: str = "RGB") -> Path:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    Image.fromarray(arr[..., 0] if channels == 1 else arr, mode=mode).save(path)
    return path


def sine(freq: float, seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    return wave if channels == 1 else np.stack([wave] * channels, axis=1)


def write_mp4(path: Path, frames: int = 20, fps: int = 10, width: int = 64, height: int = 48,
              audio_seconds: float | None = None) -> Path:
    """An H.264 mp4 whose frame i has red level 10*i (so tests can tell frames apart); optional AAC track."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        audio = _add_aac(container, 16000) if audio_seconds else None  # every stream before the first packet
        for i in range(frames):
            img = np.zeros((height, width, 3), np.uint8)
            img[..., 0] = 10 * i
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if audio is not None:
            _encode_aac(container, audio, sine(440, audio_seconds, 16000), 16000)
    return path


def write_m4a(path: Path, seconds: float = 1.0, rate: int = 22050) -> Path:
    import av

    with av.open(str(path), "w", format="mp4") as container:
        _encode_aac(container, _add_aac(container, rate), sine(440, seconds, rate), rate)
    return path


def _add_aac(container, rate: int):
    stream = container.add_stream("aac", rate=rate)
    stream.layout = "mono"
    return stream


def _encode_aac(container, stream, wave: np.ndarray, rate: int) -> None:
    import av

    pts = 0
    for start in range(0, len(wave), 1024):
        frame = av.AudioFrame.from_ndarray(wave[None, start : start + 1024], format="fltp", layout="mono")
        frame.sample_rate, frame.pts = rate, pts
        pts += frame.samples
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
