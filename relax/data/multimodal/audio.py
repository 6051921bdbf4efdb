"""Audio: decode to mono float32 at `audio_sample_rate`.

wav/flac/ogg/mp3 are read with soundfile (libsndfile, fast, no FFmpeg); anything soundfile cannot read (mp4/m4a/aac
containers, the audio track of a video) goes through PyAV. Resampling uses soxr (the resampler librosa itself
calls, without librosa's multi-second numba JIT on first use); the PyAV path resamples inside FFmpeg's swresample
while decoding, which avoids holding the source-rate signal. Channels are averaged to mono.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from relax.data.multimodal.errors import MediaError
from relax.data.multimodal.media import MediaSource, resolve_source


def to_mono(samples: np.ndarray) -> np.ndarray:
    """Average channels of a `(n, channels)` array; a 1-D array is returned unchanged."""
    return samples if samples.ndim == 1 else samples.mean(axis=1, dtype=np.float32)


def resample(samples: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    """Resample mono float32 audio with soxr (high quality); identity when the rates match."""
    if source_rate == target_rate or samples.size == 0:
        return samples.astype(np.float32, copy=False)
    import soxr

    return soxr.resample(samples, source_rate, target_rate, quality="HQ").astype(np.float32, copy=False)


def _read_soundfile(source: MediaSource) -> tuple[np.ndarray, int] | None:
    """(samples, rate) via soundfile, or None when libsndfile does not know the format."""
    import soundfile as sf

    try:
        samples, rate = sf.read(source.open(), dtype="float32", always_2d=False)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):
        return None
    return to_mono(samples), int(rate)


def _read_pyav(source: MediaSource, target_rate: int) -> np.ndarray:
    """Mono float32 at `target_rate` via PyAV (decode + swresample), for containers soundfile cannot read."""
    import av

    try:
        with av.open(source.open(), mode="r") as container:
            if not container.streams.audio:
                raise MediaError("unreadable audio (no audio stream in file)")
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=target_rate)
            chunks = []
            for frame in container.decode(stream):
                chunks.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(frame))
            chunks.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(None))
    except av.FFmpegError as err:
        raise MediaError(f"unreadable audio ({err})") from None
    return np.concatenate(chunks).astype(np.float32, copy=False) if chunks else np.zeros(0, np.float32)


def video_sound(item: Any, clip: Any, sample_rate: int = 16000) -> np.ndarray:
    """A video's sound track as `load_audio` gives it, or silence as long as the video (``clip``: its
    `VideoClip`) when it has no audio stream, so every video of a use_audio_in_video run has its track."""
    try:
        return load_audio(item, sample_rate)
    except MediaError as err:
        if "no audio stream" not in str(err):
            raise
    seconds = clip.total_frames / clip.source_fps if clip.source_fps > 0 else len(clip.frames) / clip.sample_fps
    return np.zeros(max(1, round(seconds * sample_rate)), np.float32)


def load_audio(item: Any, sample_rate: int = 16000) -> np.ndarray:
    """Decode an audio item to mono float32 at `sample_rate`.

    Accepts any form `media.resolve_source` accepts, a `datasets`-style `{"array", "sampling_rate"}` dict, or a
    numpy waveform (taken to be at `sample_rate`). Multichannel `(n, channels)` input is averaged to mono.
    """
    if isinstance(item, dict) and "array" in item:  # HF `datasets` Audio feature: already decoded
        waveform = to_mono(np.asarray(item["array"], dtype=np.float32))
        samples = resample(waveform, int(item.get("sampling_rate") or sample_rate), sample_rate)
    elif isinstance(item, np.ndarray):  # a bare waveform is taken to be at `sample_rate` already
        samples = to_mono(np.asarray(item, dtype=np.float32))
    else:
        source = resolve_source(item)
        decoded = _read_soundfile(source)
        samples = resample(*decoded, sample_rate) if decoded is not None else _read_pyav(source, sample_rate)
    if samples.size == 0:
        raise MediaError("empty audio (0 samples)")
    if not np.isfinite(samples).all():
        raise MediaError("audio contains NaN or infinite samples")
    return samples
