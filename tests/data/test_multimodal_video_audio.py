"""Video frame sampling, Qwen2-VL patchification (checked against transformers), audio decoding and the worker pool.

Videos are real H.264 mp4 files written with PyAV into tmp_path; audio is real wav/flac/m4a.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from relax.data.multimodal import (
    MediaError,
    MultimodalProcessor,
    MultimodalSettings,
    VisionSpec,
    batch_patchify,
    fetch_video,
    frame_pixel_bounds,
    load_audio,
    num_tokens,
    patchify,
    sample_frame_indices,
    smart_nframes,
)
from tests.support.media_files import sine, write_m4a, write_mp4, write_png

SETTINGS = MultimodalSettings()
SPEC = VisionSpec()


# ------------------------------------------------------------------------------------------------ frame counts
@pytest.mark.parametrize(
    "total, fps, expected",
    [
        (300, 30.0, 20),  # 10 s at 2 fps
        (301, 30.0, 20),  # 20.07 -> floor to a multiple of 2
        (91, 30.0, 6),  # 6.07 -> 6
        (90, 25.0, 6),  # 7.2 -> 6 (floor, not round)
        (20, 10.0, 4),  # 2 s -> 4 = min_frames
        (7, 10.0, 4),  # 1.4 -> raised to min_frames 4 (<= floor(7/2)*2 = 6)
        (3, 10.0, 2),  # min_frames 4 > max_frames floor(3/2)*2 = 2 -> 2
        (1, 10.0, 1),  # shorter than frame_factor: keep the one frame (patchify pads it)
        (10_000, 25.0, 768),  # 800 wanted -> video_fps_max_frames
    ],
)
def test_smart_nframes_follows_the_qwen_vl_utils_formula(total, fps, expected):
    assert smart_nframes(total, fps, SETTINGS) == expected


def test_smart_nframes_uses_the_settings():
    s = MultimodalSettings(video_fps=1.0, video_fps_min_frames=5, video_fps_max_frames=9, frame_factor=4)
    assert smart_nframes(600, 30.0, s) == 8  # 20 wanted -> max floor(9/4)*4 = 8
    assert smart_nframes(60, 30.0, s) == 8  # 2 wanted -> min ceil(5/4)*4 = 8
    with pytest.raises(MediaError, match="zero-length video"):
        smart_nframes(0, 30.0, s)


@pytest.mark.parametrize(
    "total, n, expected",
    [(10, 4, [0, 3, 6, 9]), (11, 4, [0, 3, 7, 10]), (6, 4, [0, 2, 3, 5]), (6, 3, [0, 2, 5]), (20, 4, [0, 6, 13, 19])],
)
def test_frames_are_sampled_by_rounded_linspace(total, n, expected):
    # (6, 3): linspace gives 0, 2.5, 5 and 2.5 rounds half to even -> 2, as torch.round does
    assert sample_frame_indices(total, n).tolist() == expected
    assert sample_frame_indices(total, n).tolist() == torch.linspace(0, total - 1, n).round().long().tolist()


def test_frame_pixel_bounds_from_video_token_limits():
    assert frame_pixel_bounds(20, SETTINGS, SPEC) == (128 * 784, 768 * 784)
    # with a whole-video budget of 128000 tokens and 400 frames: 128000*784*0.9/400*2 = 451584 px per frame
    assert frame_pixel_bounds(400, SETTINGS, SPEC, total_token_budget=128_000) == (100_352, 451_584)
    # the floor is 1.05 * min_pixels
    assert frame_pixel_bounds(100_000, SETTINGS, SPEC, total_token_budget=128_000)[1] == int(100_352 * 1.05)


# ------------------------------------------------------------------------------------------------------- video
@pytest.fixture(scope="module")
def mp4(tmp_path_factory):
    return write_mp4(tmp_path_factory.mktemp("video") / "clip.mp4", frames=20, fps=10, audio_seconds=2.0)


def test_fetch_video_samples_and_resizes(mp4):
    clip = fetch_video(str(mp4), SETTINGS, SPEC)
    assert clip.frame_indices.tolist() == [0, 6, 13, 19]
    assert clip.total_frames == 20 and clip.source_fps == 10.0 and clip.sample_fps == 2.0
    # 48x64 is below 128 tokens: beta = sqrt(100352/3072) = 5.715 -> ceil(9.8)*28 = 280, ceil(13.06)*28 = 392
    assert clip.frames.shape == (4, 280, 392, 3) and clip.frames.dtype == np.uint8
    reds = clip.frames[..., 0].mean(axis=(1, 2))
    assert np.allclose(reds, [0, 60, 130, 190], atol=4)  # the right frames (red = 10 * index) were kept
    assert clip.seconds_per_grid(SPEC) == 1.0


def test_fetch_video_from_bytes_and_from_image_list(mp4, tmp_path):
    from_bytes = fetch_video(mp4.read_bytes(), SETTINGS, SPEC)
    assert from_bytes.frames.shape == (4, 280, 392, 3)
    frames = [str(write_png(tmp_path / f"f{i}.png", 56, 56, seed=i)) for i in range(3)]
    clip = fetch_video(frames, SETTINGS, SPEC)
    assert clip.frames.shape[0] == 3 and clip.sample_fps == SETTINGS.video_fps


def _write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: _write(p, b""), "empty media file"),
        (lambda p: _write(p, b"\x00\x00\x00\x18ftypmp42 but nothing more"), "unreadable video"),
        (lambda p: sf.write(str(p.with_suffix(".wav")), sine(440, 0.1, 8000), 8000) or str(p.with_suffix(".wav")),
         "no video stream"),
    ],
)
def test_bad_videos_raise_media_error(tmp_path, make, message):
    with pytest.raises(MediaError, match=message):
        fetch_video(make(tmp_path / "bad.mp4"), SETTINGS, SPEC)


# ------------------------------------------------------------------------------------------------ patchify
def _hf_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384})


def _reference_video_patchify(frames: np.ndarray, spec: VisionSpec) -> np.ndarray:
    """The tensor steps of transformers' `Qwen2VLVideoProcessor.patchify` (its module imports torchvision, which
    cannot load here), applied to HF-normalised frames."""
    ip = _hf_image_processor()
    normalized = np.stack([ip.normalize(ip.rescale(f.transpose(2, 0, 1), 1 / 255), ip.image_mean, ip.image_std)
                           for f in frames])
    videos = torch.from_numpy(normalized)[None]  # (B, T, C, H, W)
    b, t, c, h, w = videos.shape
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    if pad := -t % tp:
        videos = torch.cat((videos, videos[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
        t += pad
    patches = videos.view(b, t // tp, tp, c, h // p // m, m, p, w // p // m, m, p)
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(b, (t // tp) * (h // p) * (w // p), c * tp * p * p)[0].numpy()


def test_image_patchify_is_bit_identical_to_the_hf_image_processor():
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (56, 84, 3), dtype=np.uint8), rng.integers(0, 256, (112, 56, 3), dtype=np.uint8)]
    ref = _hf_image_processor()(images=[Image.fromarray(i) for i in images], return_tensors="np")
    pixel_values, grid = batch_patchify(images, SPEC)
    assert grid.tolist() == ref["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 4]]
    assert np.array_equal(pixel_values, ref["pixel_values"])
    assert [num_tokens(g, SPEC) for g in grid] == [6, 8]


@pytest.mark.parametrize("nframes", [4, 3])
def test_video_patchify_matches_the_hf_video_layout_and_per_frame_image_path(nframes):
    rng = np.random.default_rng(nframes)
    frames = rng.integers(0, 256, (nframes, 56, 84, 3), dtype=np.uint8)
    pixel_values, grid = patchify(frames, SPEC)
    assert grid == (2, 4, 6) and pixel_values.shape == (48, 3 * 2 * 14 * 14)
    assert np.array_equal(pixel_values, _reference_video_patchify(frames, SPEC))
    # Per frame: temporal slot k of group g equals the image processor's output for frame 2g+k (the last frame is
    # repeated to fill an odd count).
    ip = _hf_image_processor()
    ours = pixel_values.reshape(2, 24, 3, 2, 14, 14)
    for g in range(2):
        for k in range(2):
            frame = frames[min(2 * g + k, nframes - 1)]
            ref = ip(images=[Image.fromarray(frame)], return_tensors="np")["pixel_values"].reshape(24, 3, 2, 14, 14)
            assert np.array_equal(ours[g, :, :, k], ref[:, :, 0])


def test_patchify_rejects_unaligned_frames():
    with pytest.raises(ValueError, match="smart_resize first"):
        patchify(np.zeros((2, 50, 56, 3), np.uint8), SPEC)


# ------------------------------------------------------------------------------------------------------- audio
def test_wav_stereo_is_mixed_to_mono_and_resampled(tmp_path):
    path = tmp_path / "a.wav"
    sf.write(str(path), sine(440, 2.0, 44100, channels=2), 44100)
    audio = load_audio(str(path), 16000)
    assert audio.dtype == np.float32 and audio.ndim == 1 and audio.shape == (32000,)
    spectrum = np.abs(np.fft.rfft(audio))
    assert abs(np.argmax(spectrum) * 16000 / len(audio) - 440) < 1.0  # the tone survives resampling


@pytest.mark.parametrize("fmt", ["flac", "mp3"])
def test_flac_and_mp3_decode_with_soundfile(tmp_path, fmt):
    path = tmp_path / f"a.{fmt}"
    sf.write(str(path), sine(440, 1.0, 16000), 16000, format=fmt.upper())
    audio = load_audio(str(path), 16000)
    assert abs(len(audio) - 16000) < 1200 and np.abs(audio).max() > 0.2  # mp3 adds encoder padding


def test_m4a_and_video_audio_track_decode_with_pyav(tmp_path, mp4):
    audio = load_audio(str(write_m4a(tmp_path / "a.m4a", seconds=1.0, rate=22050)), 16000)
    assert abs(len(audio) - 16000) < 2100 and audio.dtype == np.float32  # AAC priming adds up to ~2k samples
    assert abs(len(load_audio(str(mp4), 16000)) - 32000) < 2100


def test_audio_forms_bytes_base64_and_datasets_dict(tmp_path):
    path = tmp_path / "a.wav"
    sf.write(str(path), sine(440, 0.5, 8000), 8000)
    raw = path.read_bytes()
    expected = load_audio(str(path), 16000)
    assert np.array_equal(load_audio(raw, 16000), expected)
    assert np.array_equal(load_audio(base64.b64encode(raw).decode(), 16000), expected)
    from_array = load_audio({"array": sine(440, 0.5, 8000), "sampling_rate": 8000}, 16000)
    assert np.allclose(from_array, expected, atol=1e-4)  # the wav holds 16-bit PCM, the array float32


def test_bad_audio_raises_media_error(tmp_path):
    with pytest.raises(MediaError, match="unreadable audio"):
        load_audio(b"RIFF....WAVEfmt garbage" * 4)
    empty = tmp_path / "empty.wav"
    sf.write(str(empty), np.zeros(0, np.float32), 16000)
    with pytest.raises(MediaError, match="empty audio"):
        load_audio(str(empty))


# -------------------------------------------------------------------------------------------------------- pool
@pytest.fixture(scope="module")
def rows(tmp_path_factory, mp4):
    root = tmp_path_factory.mktemp("rows")
    wav = root / "a.wav"
    sf.write(str(wav), sine(440, 1.0, 8000), 8000)
    img0, img1 = write_png(root / "0.png", 56, 84, seed=0), write_png(root / "1.png", 30, 50, seed=1)
    return [
        {"prompt": "Look <image> and <video>, listen <audio>", "images": [str(img0)], "videos": [str(mp4)],
         "audios": [str(wav)]},
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
         "images": [img1.read_bytes()]},
        {"prompt": "text only"},
    ]


KEYS = '{"image": "images", "video": "videos", "audio": "audios"}'


def test_process_batch_returns_messages_media_and_model_inputs(rows):
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000)
    with MultimodalProcessor(keys=KEYS, max_workers=2, audio_feature_extractor=fe) as proc:
        result = proc.process_batch(rows, indices=[10, 11, 12])
    assert result.skipped == 0 and [r.index for r in result.rows] == [10, 11, 12]
    first, second, third = result.rows
    assert [c["type"] for c in first.messages[0]["content"]] == ["text", "image", "text", "video", "text", "audio"]
    assert first.model_inputs["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert first.model_inputs["video_grid_thw"].tolist() == [[2, 20, 28]]  # 4 frames of 280x392
    assert first.model_inputs["pixel_values_videos"].shape == (2 * 20 * 28, 1176)
    assert first.model_inputs["video_second_per_grid"].tolist() == [1.0]
    assert first.model_inputs["input_features"].shape == (1, 128, 3000)
    assert second.images[0].size == (84, 56) and second.model_inputs["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert third.model_inputs == {} and third.messages == [
        {"role": "user", "content": [{"type": "text", "text": "text only"}]}
    ]


def test_bad_row_raises_or_is_skipped_and_counted(rows):
    bad = {"prompt": "<image>", "images": [b"not an image"]}
    batch = [rows[1], bad, rows[2]]
    with (
        MultimodalProcessor(keys=KEYS, max_workers=2) as proc,
        pytest.raises(MediaError, match=r"^row 2, field 'images'\[0\]: corrupt image"),
    ):
        proc.process_batch(batch)
    with MultimodalProcessor(keys=KEYS, max_workers=2, skip_bad_samples=True) as proc:
        result = proc.process_batch(batch)
    assert result.skipped == 1 and [r.index for r in result.rows] == [0, 2]
    assert result.errors[0].row == 1 and result.errors[0].field == "images"


def test_async_process_does_not_block_the_event_loop(rows):
    async def main():
        with MultimodalProcessor(keys=KEYS, max_workers=2, skip_bad_samples=True) as proc:
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.001)

            task = asyncio.create_task(ticker())
            result = await proc.process(rows + [{"prompt": "<image>", "images": ["/missing.png"]}])
            task.cancel()
            return result, ticks

    result, ticks = asyncio.run(main())
    assert len(result.rows) == 3 and result.skipped == 1 and "file not found" in str(result.errors[0])
    assert ticks > 1


def test_process_pool_executor_round_trips_results_and_errors(rows):
    bad = {"prompt": "<audio>", "audios": [b"garbage audio bytes"]}
    with MultimodalProcessor(keys=KEYS, max_workers=2, executor="process") as proc:
        result = proc.process_batch(rows[1:])
        assert result.rows[0].model_inputs["image_grid_thw"].tolist() == [[1, 4, 6]]
        with pytest.raises(MediaError, match=r"^row 5, field 'audios'\[0\]: unreadable audio"):
            proc.process_batch([bad], indices=[4])


def test_float32_rescale_equals_the_hf_float64_rescale_for_every_byte():
    from relax.data.multimodal.vision import rescale_matches_hf

    assert rescale_matches_hf()


# ---- the generated media files are real ----------------------------------------------------------
def test_generated_mp4_has_the_requested_frames_and_rate(tmp_path):
    import av

    path = write_mp4(tmp_path / "v.mp4", frames=12, fps=6)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert float(stream.average_rate) == 6.0
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    assert len(decoded) == 12
    assert abs(int(decoded[5][..., 0].mean()) - 50) <= 3  # red level 10*i survives H.264


def test_generated_m4a_has_an_audio_stream(tmp_path):
    import av

    with av.open(str(write_m4a(tmp_path / "a.m4a"))) as container:
        assert container.streams.audio and container.streams.audio[0].rate == 22050
