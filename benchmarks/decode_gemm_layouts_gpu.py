"""The engine's bf16 decode products by weight layout: each projection of a Qwen3 shape at a decode batch, its weight
stored as the model stores it (``[out, in]``, what `F.linear` reads) against stored transposed (``[in, out]``
contiguous, a plain ``x @ W``), and with cuBLAS' reduced-precision split-K reductions switched the other way.

The projections are `fp8_gemm_gpu`'s, stacked as the engine runs them (`fp8_gemm_gpu.stacked`). Each variant runs
every layer's projection with the layer's own weight (36 layers of the 4B shape, 28 of the 0.6B: together past the
L2 cache, as in a decode step) inside one CUDA graph, whose replay is timed with CUDA events
(`fp8_gemm_gpu.time_ms`); the figure is microseconds a layer and the TFLOP/s that makes.

    python -m benchmarks.decode_gemm_layouts_gpu [--rows 256] [--out benchmarks/results/decode_gemm_layouts_gpu.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.fp8_gemm_gpu import SHAPES, stacked, time_ms

LAYERS = {"0.6b": 28, "4b": 36}  # decoder layers of each shape: one weight each, together past the L2 cache


def layer_us(product, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Microseconds a layer of ``product(x, weight)`` over every layer's weight in one CUDA graph."""
    return 1000 * time_ms(lambda i: product(x, weights[i]), len(weights))


def measure(rows: int) -> dict:
    matmul = torch.backends.cuda.matmul
    report = {"device": torch.cuda.get_device_name(), "rows": rows, "us_per_layer": {}}
    for shape, layers in LAYERS.items():
        for name, (width_in, width_out) in stacked(SHAPES[shape]).items():
            x = torch.randn(rows, width_in, device="cuda", dtype=torch.bfloat16)
            weights = [torch.randn(width_out, width_in, device="cuda", dtype=torch.bfloat16) * 0.02
                       for _ in range(layers)]
            transposed = [w.t().contiguous() for w in weights]
            row = {"as_stored": layer_us(F.linear, x, weights), "transposed": layer_us(torch.mm, x, transposed)}
            reduced = matmul.allow_bf16_reduced_precision_reduction
            matmul.allow_bf16_reduced_precision_reduction = not reduced
            try:
                row["split_k_reduction_switched"] = layer_us(F.linear, x, weights)
            finally:
                matmul.allow_bf16_reduced_precision_reduction = reduced
            flops = 2 * rows * width_in * width_out
            row = {key: round(value, 1) for key, value in row.items()}
            row["tflops_as_stored"] = round(flops / row["as_stored"] / 1e6, 1)
            row["tflops_best"] = round(flops / min(row["as_stored"], row["transposed"],
                                                   row["split_k_reduction_switched"]) / 1e6, 1)
            row["transposed_speedup"] = round(row["as_stored"] / row["transposed"], 3)
            report["us_per_layer"][f"{shape}_{name}"] = row
            print(shape, name, row, flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256, help="the decode batch")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = measure(args.rows)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
