"""Throughput and peak memory of Relax's media pipeline (`relax.data.multimodal`) beside plain transformers calls.

Inputs (generated into a temp dir, so the run needs no data and no network):
- 64 JPEG images of 1024x1024 (quality 90, smooth gradients plus noise, like photos), one per row;
- one 30 s stereo 44.1 kHz wav clip;
- one 10 s H.264 mp4, 640x480 at 30 fps (300 frames), written with PyAV.

Pipelines, each producing the model inputs of a Qwen2-VL / Qwen2-Audio processor:
- images: ours = `MultimodalProcessor` (load, RGB, smart_resize with PIL bicubic, numpy patchify) on rows of one
  image, 8 rows per `process_batch` call; run with a 2-thread pool, a 1-thread pool, and a 2-process pool.
  Baseline = `PIL.Image.open(...).convert("RGB")` + `Qwen2VLImageProcessorPil(images=<8 images>)`, the plain
  processor call (constructed directly with the same pixel bounds; nothing downloaded). Ours returns per-row
  tensors (what a row-wise rollout needs), the baseline one concatenated tensor per call; neither is copied again.
- audio: ours = `load_audio` (soundfile + soxr, mono) + `WhisperFeatureExtractor(feature_size=128,
  sampling_rate=16000)` through `MultimodalProcessor`. Baseline = `transformers.audio_utils.load_audio(path,
  sampling_rate=16000, backend="soundfile")` + the same feature extractor.
- video: ours = `fetch_video` (PyAV decode of the sampled frames, PIL resize) + our Qwen2-VL video patchify. The
  transformers video processor (`Qwen2VLVideoProcessor`) imports torchvision, which cannot be used with our torch
  build, so the baseline is `transformers.video_utils.load_video(path, backend="pyav")` with the same frame indices
  + `Qwen2VLImageProcessorPil` per frame (video pixel bounds), whose per-frame patches are then interleaved into the
  video layout (a reshape; it only makes the outputs comparable).

Each pipeline's outputs are compared with the baseline's (`max_abs_diff`, grid equality) on the same inputs.

Method: every (modality, pipeline) runs in its own fresh subprocess (so one run's allocator state does not inflate
another's memory), does one untimed warm-up item, then `--rounds` timed passes; the best pass is reported.
Peak memory is **RSS sampled with psutil every 10 ms over the process and its children** (pool workers included),
reported as the peak minus the RSS after warm-up ("peak_rss_delta_mb") and as the absolute peak.
All pipelines use numpy/PIL/FFmpeg compute only; torch is kept at 1 thread.

    python benchmarks/mm_processing.py            # ~1.5-3 min on 2 cores; writes benchmarks/results/mm_processing.json
    python benchmarks/mm_processing.py --quick    # 16 images, 10 s audio, 4 s video, 1 round; for a smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Self

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "mm_processing.json"
CHUNK = 8  # rows per processing call (both pipelines), which bounds memory to 8 images' tensors

VARIANTS = {
    "images": ["baseline", "ours_thread2", "ours_thread1", "ours_process2"],
    "audio": ["baseline", "ours"],
    "video": ["baseline", "ours"],
}


# ----------------------------------------------------------------------------------------------- inputs
def make_inputs(root: Path, n_images: int, audio_s: float, video_s: float) -> dict:
    """Write the benchmark's media files into `root` and return their paths."""
    import av
    import soundfile as sf
    from PIL import Image

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:1024, 0:1024].astype(np.float32) / 1024
    images = []
    for i in range(n_images):
        base = np.stack([yy * 255, xx * 255, (yy + xx) * 127], axis=-1) * (0.5 + 0.5 * ((i % 5) / 4))
        arr = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        path = root / f"img{i:02d}.jpg"
        Image.fromarray(arr).save(path, quality=90)
        images.append(str(path))

    t = np.arange(int(audio_s * 44100)) / 44100
    wave = 0.2 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.normal(size=t.shape)
    audio = root / "clip.wav"
    sf.write(str(audio), np.stack([wave, wave * 0.8], axis=1).astype(np.float32), 44100)

    video = root / "clip.mp4"
    with av.open(str(video), "w") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = 640, 480, "yuv420p"
        gy, gx = np.mgrid[0:480, 0:640]
        for i in range(int(video_s * 30)):
            frame = np.stack([(gx + 4 * i) % 256, (gy + 2 * i) % 256, np.full_like(gx, (7 * i) % 256)], -1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame.astype(np.uint8), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return {"images": images, "audio": str(audio), "video": str(video)}


# ----------------------------------------------------------------------------------------------- memory
class RssSampler:
    """Peak RSS (bytes) of this process plus its children, sampled every 10 ms on a daemon thread."""

    def __init__(self, interval: float = 0.01):
        self.proc, self.interval, self.peak = psutil.Process(), interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def tree_rss(self) -> int:
        total = self.proc.memory_info().rss
        for child in self.proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):  # a child may exit between listing and reading
                total += child.memory_info().rss
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.tree_rss())
            time.sleep(self.interval)

    def __enter__(self) -> Self:
        self.peak = self.tree_rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.tree_rss())


# ----------------------------------------------------------------------------------------------- pipelines
def image_processor(min_pixels: int, max_pixels: int):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})


def image_pipelines(variant: str):
    """(process(paths) -> list of (pixel_values, grid) per chunk, close) for one image variant."""
    from PIL import Image

    from relax.data.multimodal import MultimodalProcessor, MultimodalSettings, VisionSpec, image_pixel_bounds

    settings = MultimodalSettings()
    if variant == "baseline":
        ip = image_processor(*image_pixel_bounds(settings, VisionSpec()))

        def run(paths):
            out = []
            for i in range(0, len(paths), CHUNK):
                images = [Image.open(p).convert("RGB") for p in paths[i : i + CHUNK]]
                r = ip(images=images, return_tensors="np")
                if not out:  # keep only the first image (a copy), as the comparison digest
                    out.append(first_image(r["pixel_values"], r["image_grid_thw"]).copy())
            return out

        return run, lambda: None

    workers = int(variant[-1])
    proc = MultimodalProcessor(settings, {"image": "images"}, max_workers=workers,
                               executor="process" if "process" in variant else "thread")

    def run(paths):
        out = []
        for i in range(0, len(paths), CHUNK):
            rows = [{"prompt": "<image>", "images": [p]} for p in paths[i : i + CHUNK]]
            result = proc.process_batch(rows)
            if not out:
                out.append(result.rows[0].model_inputs["pixel_values"])
        return out

    return run, proc.close


def first_image(pixel_values: np.ndarray, grid_thw: np.ndarray) -> np.ndarray:
    """The rows of the first image of a batched processor output (what the comparison digest keeps)."""
    return pixel_values[: int(np.prod(grid_thw[0]))]


def audio_pipelines(variant: str):
    from transformers import WhisperFeatureExtractor

    from relax.data.multimodal import MultimodalProcessor

    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000)
    if variant == "baseline":
        from transformers.audio_utils import load_audio

        def run(path):
            wave = load_audio(path, sampling_rate=16000, backend="soundfile")
            return fe([wave], sampling_rate=16000, return_tensors="np")["input_features"]

        return run, lambda: None
    proc = MultimodalProcessor(keys={"audio": "audios"}, audio_feature_extractor=fe, max_workers=1)

    def run(path):
        return proc.process_row({"prompt": "<audio>", "audios": [path]}).model_inputs["input_features"]

    return run, proc.close


def video_pipelines(variant: str):
    from relax.data.multimodal import MultimodalProcessor, MultimodalSettings, VisionSpec, frame_pixel_bounds
    from relax.data.multimodal.video import probe_video, sample_frame_indices, smart_nframes

    settings, spec = MultimodalSettings(), VisionSpec()
    if variant == "baseline":
        from transformers.video_utils import load_video

        def run(path):
            total, fps = probe_video(path)
            indices = sample_frame_indices(total, smart_nframes(total, fps, settings))
            frames, _ = load_video(path, backend="pyav", sample_indices_fn=lambda metadata, **kw: indices)
            ip = image_processor(*frame_pixel_bounds(len(frames), settings, spec))
            from PIL import Image

            r = ip(images=[Image.fromarray(f) for f in frames], return_tensors="np")
            return interleave_frames(r["pixel_values"], r["image_grid_thw"], spec)

        return run, lambda: None
    proc = MultimodalProcessor(settings, {"video": "videos"}, spec, max_workers=1)

    def run(path):
        m = proc.process_row({"prompt": "<video>", "videos": [path]}).model_inputs
        return m["pixel_values_videos"], m["video_grid_thw"][0]

    return run, proc.close


def interleave_frames(per_frame: np.ndarray, grids: np.ndarray, spec) -> tuple[np.ndarray, np.ndarray]:
    """Turn per-frame image patches (each frame temporally duplicated) into the Qwen2-VL video layout."""
    t = len(grids)
    _, gh, gw = grids[0]
    p, tp = spec.patch_size, spec.temporal_patch_size
    x = per_frame.reshape(t, gh * gw, 3, tp, p, p)[:, :, :, 0]  # (T, N, C, p, p): drop the duplicate slot
    if t % tp:
        x = np.concatenate([x, np.repeat(x[-1:], tp - t % tp, axis=0)])
    x = x.reshape(-1, tp, gh * gw, 3, p, p).transpose(0, 2, 3, 1, 4, 5)
    return x.reshape(-1, 3 * tp * p * p), np.array([x.shape[0], gh, gw])


PIPELINES = {"images": image_pipelines, "audio": audio_pipelines, "video": video_pipelines}


def worker(modality: str, variant: str, inputs: dict, rounds: int) -> dict:
    """Run one pipeline in this (fresh) process: warm-up, timed rounds, peak RSS, and a digest of its output."""
    import torch

    torch.set_num_threads(1)
    run, close = PIPELINES[modality](variant)
    items = inputs["images"] if modality == "images" else inputs[modality]
    warm = [items[0]] if modality == "images" else items
    run(warm)  # lazy imports, lookup tables, pool start-up
    sampler = RssSampler()
    baseline_rss = sampler.tree_rss()
    times = []
    with sampler:
        for _ in range(rounds):
            start = time.perf_counter()
            out = run(items)
            times.append(time.perf_counter() - start)
            first = out[0] if modality == "images" else out
            del out
    close()
    np.save(inputs["digest_dir"] + f"/{modality}_{variant}.npy", _first_tensor(first), allow_pickle=False)
    return {
        "seconds": times,
        "best_s": min(times),
        "peak_rss_mb": sampler.peak / 2**20,
        "peak_rss_delta_mb": (sampler.peak - baseline_rss) / 2**20,
    }


def _first_tensor(first):
    return first[0] if isinstance(first, tuple) else first


# ----------------------------------------------------------------------------------------------- driver
def run_variant(modality: str, variant: str, inputs_file: Path, rounds: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", modality, variant, "--inputs", str(inputs_file), "--rounds",
           str(rounds)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=False)
    if done.returncode:
        raise RuntimeError(f"{modality}/{variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 images, 10 s audio, 4 s video, 1 round")
    parser.add_argument("--rounds", type=int, default=None, help="timed passes per pipeline (default 2; quick 1)")
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--worker", nargs=2, metavar=("MODALITY", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--inputs", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        inputs = json.loads(args.inputs.read_text())
        print(json.dumps(worker(*args.worker, inputs, args.rounds)))
        return

    rounds = args.rounds or (1 if args.quick else 2)
    n_images, audio_s, video_s = (16, 10.0, 4.0) if args.quick else (64, 30.0, 10.0)
    started, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mm_bench_") as tmp:
        root = Path(tmp)
        inputs = make_inputs(root, n_images, audio_s, video_s)
        inputs["digest_dir"] = str(root)
        inputs_file = root / "inputs.json"
        inputs_file.write_text(json.dumps(inputs))
        results: dict = {}
        for modality, variants in VARIANTS.items():
            results[modality] = {}
            for variant in variants:
                results[modality][variant] = r = run_variant(modality, variant, inputs_file, rounds)
                print(f"  {modality:7s} {variant:14s} best {r['best_s']:.3f} s  peak +{r['peak_rss_delta_mb']:.0f} MB",
                      flush=True)
            ref = np.load(root / f"{modality}_baseline.npy")
            for variant in variants[1:]:
                ours = np.load(root / f"{modality}_{variant}.npy")
                same_shape = ours.shape == ref.shape
                results[modality][variant]["same_shape_as_baseline"] = same_shape
                results[modality][variant]["max_abs_diff_vs_baseline"] = (
                    float(np.abs(ours - ref).max()) if same_shape else None
                )
    counts = {"images": n_images, "audio": 1, "video": 1}
    report = build_report(results, counts, rounds, n_images, audio_s, video_s, time.perf_counter() - started)
    # the dev machines are shared: a 1-minute load above the core count means the timings include waiting
    report["machine"]["loadavg_1m_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


def build_report(results, counts, rounds, n_images, audio_s, video_s, wall) -> dict:
    import av
    import PIL
    import soundfile
    import soxr
    import transformers

    rows = []
    for modality, variants in results.items():
        base = variants["baseline"]
        for name, r in variants.items():
            rows.append({
                "modality": modality,
                "pipeline": name,
                "best_s": round(r["best_s"], 4),
                "items_per_s": round(counts[modality] / r["best_s"], 2),
                "speedup_vs_baseline": round(base["best_s"] / r["best_s"], 2),
                "peak_rss_delta_mb": round(r["peak_rss_delta_mb"], 1),
                "peak_rss_mb": round(r["peak_rss_mb"], 1),
                "memory_ratio_vs_baseline": round(r["peak_rss_delta_mb"] / max(base["peak_rss_delta_mb"], 1e-9), 2),
                "max_abs_diff_vs_baseline": r.get("max_abs_diff_vs_baseline"),
                "seconds": [round(s, 4) for s in r["seconds"]],
            })
    return {
        "benchmark": "mm_processing",
        **headline(rows),
        "date": time.strftime("%Y-%m-%d"),
        "config": {"images": f"{n_images} x 1024x1024 JPEG", "audio": f"{audio_s:g} s stereo 44.1 kHz wav",
                   "video": f"{video_s:g} s 640x480 30 fps H.264 mp4", "rounds": rounds, "chunk_rows": CHUNK,
                   "memory": "psutil RSS of process + children, sampled every 10 ms; delta over post-warm-up RSS"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {"transformers": transformers.__version__, "pillow": PIL.__version__, "av": av.__version__,
                     "soundfile": soundfile.__version__, "soxr": soxr.__version__, "numpy": np.__version__},
        "wall_s": round(wall, 1),
        "results": rows,
    }


# The pipeline each modality's headline figures use: Relax's default (a thread pool of 2 workers for images).
DEFAULT_PIPELINE = {"images": "ours_thread2", "audio": "ours", "video": "ours"}


def headline(rows: list[dict]) -> dict:
    """The summary keys: Relax's and the baseline's seconds for the whole input set, ratio = baseline / relax, and
    Relax's peak RSS; the images are the headline, each modality's figures are under ``by_modality``."""
    by_modality = {}
    for modality, pipeline in DEFAULT_PIPELINE.items():
        ours = next((r for r in rows if r["modality"] == modality and r["pipeline"] == pipeline), None)
        base = next((r for r in rows if r["modality"] == modality and r["pipeline"] == "baseline"), None)
        if ours and base:
            by_modality[modality] = {"relax_s": ours["best_s"], "baseline_s": base["best_s"],
                                     "ratio": round(base["best_s"] / ours["best_s"], 2),
                                     "peak_rss_mb": ours["peak_rss_mb"], "baseline_peak_rss_mb": base["peak_rss_mb"]}
    return {**by_modality.get("images", {}), "by_modality": by_modality}


def print_table(report: dict) -> None:
    print(f"\n{'modality':8s} {'pipeline':14s} {'best s':>8s} {'items/s':>8s} {'speedup':>8s} "
          f"{'peak +MB':>9s} {'mem ratio':>9s} {'max|diff|':>10s}")
    for r in report["results"]:
        diff = "-" if r["max_abs_diff_vs_baseline"] is None else f"{r['max_abs_diff_vs_baseline']:.2g}"
        print(f"{r['modality']:8s} {r['pipeline']:14s} {r['best_s']:8.3f} {r['items_per_s']:8.2f} "
              f"{r['speedup_vs_baseline']:7.2f}x {r['peak_rss_delta_mb']:9.0f} {r['memory_ratio_vs_baseline']:8.2f}x "
              f"{diff:>10s}")


if __name__ == "__main__":
    main()
