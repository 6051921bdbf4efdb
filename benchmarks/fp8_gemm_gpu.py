"""Where the FP8 rollout's time goes: one decode step's projections, bf16 against FP8, kernel by kernel.

For each projection of a Qwen3 shape at a decode batch (``--batch`` rows), times on the GPU: each operation is
captured in a CUDA graph of ``--iterations`` repeats and the graph's replay timed with CUDA events, so the figure is
the GPU's time, not the host's launch time (the engine replays its decode steps as CUDA graphs too). The repeats
cycle through copies of the weights that together exceed the L2 cache, so every GEMM reads its weight from HBM as a
decode step does:

- ``bf16``: ``F.linear`` in bf16 (the engine's path without ``--rollout-fp8``);
- ``quantize``: the activation's per-row quantisation (`engine_core.fp8.quantize_rows`);
- ``scaled_mm_rowwise``: ``torch._scaled_mm`` with one scale per row and per output channel (what the engine runs);
- ``scaled_mm_tensorwise``: the same with one scale per tensor (cuBLASLt's FP8 path), for comparison.

It prints a table and the sums over one decoder layer, and writes ``benchmarks/results/fp8_gemm_gpu.json``.

    python -m benchmarks.fp8_gemm_gpu --shape 4b --batch 256
    python -m benchmarks.fp8_gemm_gpu --shape 4b --batch 256 --stacked --out benchmarks/results/fp8_gemm_gpu_4b_stacked.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from relax.backends.inference.engine_core.fp8_format import FP8, quantize_rows

RESULTS = Path(__file__).resolve().parent / "results"
L2_ROTATION_BYTES = 256 * 2**20  # well past the H100's and H200's 50 MB of L2
# (in_features, out_features) of one decoder layer's projections
SHAPES = {
    "0.6b": {"q": (1024, 2048), "k": (1024, 1024), "v": (1024, 1024), "o": (2048, 1024),
             "gate": (1024, 3072), "up": (1024, 3072), "down": (3072, 1024)},
    "4b": {"q": (2560, 4096), "k": (2560, 1024), "v": (2560, 1024), "o": (4096, 2560),
           "gate": (2560, 9728), "up": (2560, 9728), "down": (9728, 2560)},
}


def stacked(shape: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """One layer's products with the projections that read one input stacked: qkv, o, gate_up, down."""
    return {"qkv": (shape["q"][0], shape["q"][1] + shape["k"][1] + shape["v"][1]), "o": shape["o"],
            "gate_up": (shape["gate"][0], shape["gate"][1] + shape["up"][1]), "down": shape["down"]}


def time_ms(fn, iterations: int) -> float:
    """Milliseconds of GPU time per call of ``fn(i)``: ``iterations`` calls captured in one CUDA graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):  # warm-up outside the capture (cuBLAS workspaces, autotuning)
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iterations):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="4b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--stacked", action="store_true",
                        help="q/k/v and gate/up as one product each, as the engine runs them (merged projections; "
                             "engine_core.fp8.SharedProduct)")
    parser.add_argument("--out", type=Path, default=RESULTS / "fp8_gemm_gpu.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows, totals = {}, {}
    projections = stacked(SHAPES[args.shape]) if args.stacked else SHAPES[args.shape]
    for name, (fan_in, fan_out) in projections.items():
        x = torch.randn(args.batch, fan_in, device="cuda", dtype=torch.bfloat16)
        copies = max(2, -(-L2_ROTATION_BYTES // (fan_in * fan_out)))  # FP8 copies alone exceed the L2 cache
        ws = [torch.randn(fan_out, fan_in, device="cuda", dtype=torch.bfloat16) / fan_in ** 0.5 for _ in range(copies)]
        w8s = [quantize_rows(w) for w in ws]
        x8, x_scale = quantize_rows(x)
        one = torch.ones((), device="cuda")
        w8_tensor = [(w / w.abs().max() * 448).to(FP8) for w in ws]
        n = len(ws)
        timings = {
            "bf16": time_ms(lambda i: F.linear(x, ws[i % n]), args.iterations),
            "quantize": time_ms(lambda i: quantize_rows(x), args.iterations),
            "scaled_mm_rowwise": time_ms(lambda i: torch._scaled_mm(
                x8, w8s[i % n][0].t(), scale_a=x_scale, scale_b=w8s[i % n][1].t(), out_dtype=torch.bfloat16),
                args.iterations),
            "scaled_mm_tensorwise": time_ms(lambda i: torch._scaled_mm(
                x8, w8_tensor[i % n].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), args.iterations),
        }
        weight_bytes = fan_in * fan_out * 2
        timings["bf16_fraction_of_bound"] = weight_bytes / 4.3e12 / (timings["bf16"] / 1e3)
        rows[name] = timings
        for key, value in timings.items():
            if not key.endswith("bound"):
                totals[key] = totals.get(key, 0.0) + value
        print(f"{name:5s} " + "  ".join(f"{k} {v:.4f}" for k, v in timings.items()), flush=True)
    print("layer " + "  ".join(f"{k} {v:.4f} ms" for k, v in totals.items()))
    result = {"device": torch.cuda.get_device_name(), "shape": args.shape, "batch": args.batch, "stacked": args.stacked,
              "layer_ms": {k: round(v, 4) for k, v in totals.items()},
              "fp8_rowwise_with_quantize_vs_bf16": round(totals["bf16"] / (totals["scaled_mm_rowwise"]
                                                                            + totals["quantize"]), 3),
              "projections_ms": rows, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "projections_ms"}, indent=2))


if __name__ == "__main__":
    main()
