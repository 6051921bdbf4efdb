"""`MultimodalProcessor`: process many rows' media in a worker pool, off the rollout loop.

For each row it resolves the prompt against the media columns (`placeholders.resolve_row`), loads and sizes every
image, video and audio item, and (optionally) computes the model inputs the training forward needs:

- `pixel_values`, `image_grid_thw` (Qwen2-VL layout, `vision.batch_patchify`),
- `pixel_values_videos`, `video_grid_thw`, `video_second_per_grid`,
- `input_features`, `feature_attention_mask` when an audio feature extractor (e.g. `WhisperFeatureExtractor`) is given.

Rows run in a `concurrent.futures` pool. The default is a thread pool: decoding (PIL, PyAV/FFmpeg, libsndfile),
resizing, soxr and the large numpy copies all release the GIL, and threads hand results back without pickling
tens of MB of pixel values per image (see `benchmarks/mm_processing.py` for the measured comparison).
`executor="process"` uses a spawn-context process pool (spawn, not fork: the caller may hold threads and locks).

Failures: a bad row raises `MediaError` naming row and field (a dead worker process too). With
`skip_bad_samples=True` bad rows are dropped instead; `BatchResult.skipped` counts them and `errors` keeps the reasons.

Usage::

    proc = MultimodalProcessor(MultimodalSettings(), keys={"image": "images"}, max_workers=2)
    result = await proc.process(rows)             # or proc.process_batch(rows) from sync code
    for r in result.rows: r.messages, r.images, r.model_inputs["pixel_values"]
    proc.close()
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import BrokenExecutor, Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np
from PIL import Image

from relax.data.multimodal.audio import load_audio, video_sound
from relax.data.multimodal.errors import MediaError, media_context
from relax.data.multimodal.image import fetch_image, smart_resize
from relax.data.multimodal.placeholders import ResolvedPrompt, resolve_row
from relax.data.multimodal.settings import MultimodalSettings, VisionSpec, image_pixel_bounds, parse_multimodal_keys
from relax.data.multimodal.video import VideoClip, fetch_video
from relax.data.multimodal.vision import batch_patchify


@dataclass(frozen=True)
class RowProcessingConfig:
    """Everything a worker needs to process a row; picklable so process workers receive it once."""

    settings: MultimodalSettings = field(default_factory=MultimodalSettings)
    keys: Mapping[str, str] = field(default_factory=dict)
    spec: VisionSpec = field(default_factory=VisionSpec)
    prompt_key: str = "prompt"
    compute_model_inputs: bool = True
    audio_feature_extractor: Any = None  # e.g. WhisperFeatureExtractor; called on the decoded waveforms
    video_total_token_budget: int | None = None


@dataclass
class ProcessedRow:
    """One row's resolved messages, decoded media (prompt order per type) and model inputs."""

    index: int
    messages: list[dict]
    images: list[Image.Image] = field(default_factory=list)  # RGB, smart-resized
    videos: list[VideoClip] = field(default_factory=list)
    audios: list[np.ndarray] = field(default_factory=list)  # mono float32 at audio_sample_rate
    # With use_audio_in_video: for video i, the index in `audios` of its sound track (audios stay in prompt order,
    # a video's track where the video is), which the prompt carries inside the video's placeholder
    video_audio: list[int] = field(default_factory=list)
    model_inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class BatchResult:
    rows: list[ProcessedRow]
    skipped: int = 0
    errors: list[MediaError] = field(default_factory=list)


def process_row(row: Mapping[str, Any], index: int, config: RowProcessingConfig) -> ProcessedRow:
    """Process one row in the calling thread (the pool's unit of work). Raises `MediaError` naming row/field."""
    with media_context(index, config.prompt_key):
        resolved = resolve_row(row, config.keys, row_index=index, prompt_key=config.prompt_key)
    out = ProcessedRow(index=index, messages=resolved.messages)
    _load_media(resolved, index, config, out)
    if config.compute_model_inputs:
        with media_context(index):
            out.model_inputs = model_inputs(out, config)
    return out


def _load_media(resolved: ResolvedPrompt, index: int, config: RowProcessingConfig, out: ProcessedRow) -> None:
    s, spec = config.settings, config.spec
    for ref in resolved.media:
        with media_context(index, ref.field, ref.index):
            if ref.kind == "image":
                out.images.append(fetch_image(ref.value, s, spec))
            elif ref.kind == "video":
                out.videos.append(fetch_video(ref.value, s, spec, config.video_total_token_budget))
                if s.use_audio_in_video:
                    out.video_audio.append(len(out.audios))
                    out.audios.append(video_sound(ref.value, out.videos[-1], s.audio_sample_rate))
            else:
                out.audios.append(load_audio(ref.value, s.audio_sample_rate))


def model_inputs(row: ProcessedRow, config: RowProcessingConfig) -> dict[str, np.ndarray]:
    """Processor tensors (numpy) for the row's media, named as the HF Qwen-VL / Qwen2-Audio processors name them."""
    spec, inputs = config.spec, {}
    if row.images:
        arrays = [np.asarray(encoder_aligned(i, config.settings, spec)) for i in row.images]
        inputs["pixel_values"], inputs["image_grid_thw"] = batch_patchify(arrays, spec)
    if row.videos:
        inputs["pixel_values_videos"], inputs["video_grid_thw"] = batch_patchify([v.frames for v in row.videos], spec)
        inputs["video_second_per_grid"] = np.asarray([v.seconds_per_grid(spec) for v in row.videos], np.float32)
    if row.audios and config.audio_feature_extractor is not None:
        fe = config.audio_feature_extractor
        feats = fe(row.audios, sampling_rate=config.settings.audio_sample_rate, return_attention_mask=True,
                   return_tensors="np")
        inputs["input_features"] = feats["input_features"]
        inputs["feature_attention_mask"] = feats["attention_mask"]
    return inputs


def encoder_aligned(image: Image.Image, settings: MultimodalSettings, spec: VisionSpec) -> Image.Image:
    """The image itself if its sides are multiples of patch*merge, else re-sized like the HF processor would.

    Only matters with `image_resize_scale_factor` set to 0 or a non-multiple: the engine then sees the unaligned
    image, while the encoder still needs whole patches.
    """
    f = spec.token_pixel_side
    if image.width % f == 0 and image.height % f == 0:
        return image
    h, w = smart_resize(image.height, image.width, f, *image_pixel_bounds(settings, spec))
    return image.resize((w, h), Image.Resampling.BICUBIC)


_WORKER_CONFIG: RowProcessingConfig | None = None


def _init_worker(config: RowProcessingConfig) -> None:
    global _WORKER_CONFIG
    _WORKER_CONFIG = config
    torch = sys.modules.get("torch")  # one busy worker per core: keep torch, if something loaded it, single-threaded
    if torch is not None:
        torch.set_num_threads(1)


def _process_in_worker(row: Mapping[str, Any], index: int) -> ProcessedRow:
    assert _WORKER_CONFIG is not None, "worker not initialised"
    return process_row(row, index, _WORKER_CONFIG)


class MultimodalProcessor:
    """A pool that turns dataset rows into `ProcessedRow`s; see the module docstring."""

    def __init__(
        self,
        settings: MultimodalSettings | None = None,
        keys: str | Mapping[str, str] | None = None,
        spec: VisionSpec | None = None,
        *,
        max_workers: int = 2,
        executor: str = "thread",
        skip_bad_samples: bool = False,
        compute_model_inputs: bool = True,
        audio_feature_extractor: Any = None,
        prompt_key: str = "prompt",
        video_total_token_budget: int | None = None,
    ):
        if executor not in ("thread", "process"):
            raise ValueError(f"executor must be 'thread' or 'process', got {executor!r}")
        self.config = RowProcessingConfig(
            settings=settings or MultimodalSettings(),
            keys=parse_multimodal_keys(keys),
            spec=spec or VisionSpec(),
            prompt_key=prompt_key,
            compute_model_inputs=compute_model_inputs,
            audio_feature_extractor=audio_feature_extractor,
            video_total_token_budget=video_total_token_budget,
        )
        self.max_workers = max(1, int(max_workers))
        self.executor_kind = executor
        self.skip_bad_samples = skip_bad_samples
        self._executor: Executor | None = None

    # -- pool lifecycle -------------------------------------------------------------------------------------------
    def _pool(self) -> Executor:
        if self._executor is None:
            if self.executor_kind == "thread":
                self._executor = ThreadPoolExecutor(self.max_workers, thread_name_prefix="relax-mm")
            else:
                self._executor = ProcessPoolExecutor(
                    self.max_workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_init_worker,
                    initargs=(self.config,),
                )
        return self._executor

    def _submit(self, row: Mapping[str, Any], index: int) -> Future:
        if self.executor_kind == "thread":
            return self._pool().submit(process_row, row, index, self.config)
        return self._pool().submit(_process_in_worker, row, index)

    def close(self) -> None:
        """Shut the pool down (waits for running rows, cancels queued ones)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- processing -----------------------------------------------------------------------------------------------
    def process_row(self, row: Mapping[str, Any], index: int = 0) -> ProcessedRow:
        """Process one row in the calling thread, no pool."""
        return process_row(row, index, self.config)

    def process_batch(self, rows: Sequence[Mapping[str, Any]], indices: Sequence[int] | None = None) -> BatchResult:
        """Process rows in the pool and wait (sync callers). Row order is kept."""
        indices = self._indices(rows, indices)
        futures = [self._submit(row, i) for row, i in zip(rows, indices)]
        outcomes: list[ProcessedRow | BaseException] = []
        for future, index in zip(futures, indices):
            outcome = self._outcome(future, index)
            if isinstance(outcome, MediaError) and not self.skip_bad_samples:
                for f in futures:
                    f.cancel()
                raise outcome
            outcomes.append(outcome)
        return self._collect(outcomes)

    async def process(self, rows: Sequence[Mapping[str, Any]], indices: Sequence[int] | None = None) -> BatchResult:
        """Process rows in the pool without blocking the event loop. Row order is kept."""
        indices = self._indices(rows, indices)
        futures = [asyncio.wrap_future(self._submit(row, i)) for row, i in zip(rows, indices)]
        results = await asyncio.gather(*futures, return_exceptions=True)
        outcomes = [self._as_media_error(r, i) if isinstance(r, BaseException) else r for r, i in zip(results, indices)]
        if not self.skip_bad_samples:
            for outcome in outcomes:
                if isinstance(outcome, MediaError):
                    raise outcome
        return self._collect(outcomes)

    @staticmethod
    def _indices(rows: Sequence, indices: Sequence[int] | None) -> list[int]:
        if indices is None:
            return list(range(len(rows)))
        if len(indices) != len(rows):
            raise ValueError(f"{len(indices)} indices for {len(rows)} rows")
        return list(indices)

    def _outcome(self, future: Future, index: int) -> ProcessedRow | MediaError:
        try:
            return future.result()
        except BaseException as err:  # noqa: BLE001 - converted, never swallowed silently
            return self._as_media_error(err, index)

    def _as_media_error(self, err: BaseException, index: int) -> MediaError:
        if isinstance(err, MediaError):
            return err.located(index)
        if isinstance(err, BrokenExecutor):
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None  # a dead process pool cannot be reused; the next call starts a fresh one
            return MediaError(f"worker process died ({type(err).__name__}: {err})", index)
        if isinstance(err, (KeyboardInterrupt, SystemExit, asyncio.CancelledError)):
            raise err
        return MediaError(f"{type(err).__name__}: {err}", index)

    @staticmethod
    def _collect(outcomes: list) -> BatchResult:
        rows = [o for o in outcomes if isinstance(o, ProcessedRow)]
        errors = [o for o in outcomes if isinstance(o, MediaError)]
        return BatchResult(rows=rows, skipped=len(errors), errors=errors)
