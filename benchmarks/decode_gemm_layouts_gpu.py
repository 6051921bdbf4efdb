"""The engine's bf16 decode products by weight layout: each projection of a Qwen3 shape at a decode batch, its weight
stored as the model stores it (``[out, in]``, what `F.linear` reads) against stored transposed (``[in, out]``
contiguous, a plain ``x @ W``), and with cuBLAS' reduced-precision split-K reductions switched the other way.
``--more`` adds what else a decode step could call for the same product: cuBLASLt instead of cuBLAS
(`torch.backends.cuda.preferred_blas_library`), the product computed transposed (``W @ x^T``, the output
``[out, rows]``: what a consumer reading the output transposed would take), and a plain Triton ``tl.dot`` kernel
over a sweep of tiles (the best tile reported): whether any of them beats cuBLAS at decode batch sizes.
``--inductor`` adds the product as `torch.compile` with ``mode="max-autotune"`` picks it: cuBLAS or the best of
inductor's Triton GEMM templates (its persistent TMA template on Hopper included), each timed by inductor for this
shape (the autotuning's seconds reported): what a tuned Triton kernel, not a hand-picked tile, makes of it.

The projections are `fp8_gemm_gpu`'s, stacked as the engine runs them (`fp8_gemm_gpu.stacked`). Each variant runs
every layer's projection with the layer's own weight (36 layers of the 4B shape, 28 of the 0.6B: together past the
L2 cache, as in a decode step) inside one CUDA graph, whose replay is timed with CUDA events
(`fp8_gemm_gpu.time_ms`); the figure is microseconds a layer and the TFLOP/s that makes.

    python -m benchmarks.decode_gemm_layouts_gpu [--rows 256] [--more] [--inductor]
        [--out benchmarks/results/decode_gemm_layouts_gpu.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch
import torch.nn.functional as F

from benchmarks.fp8_gemm_gpu import SHAPES, stacked, time_ms

LAYERS = {"0.6b": 28, "4b": 36}  # decoder layers of each shape: one weight each, together past the L2 cache
TRITON_TILES = [(128, 128, 64, 4, 8), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 128, 4, 4),
                (128, 128, 128, 3, 8), (256, 128, 64, 3, 8), (64, 256, 64, 4, 8)]  # (rows, cols, depth, stages, warps)


@functools.cache
def triton_product():
    """``y = x @ W^T`` for ``W [out, in]`` as stored, one program a (rows x cols) tile of ``y``, grouped so that
    neighbouring programs share ``x``'s rows; the tile is the last argument."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x, w, y, rows, cols, depth, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
               GROUP: tl.constexpr):
        program = tl.program_id(0)
        row_tiles, col_tiles = tl.cdiv(rows, BLOCK_R), tl.cdiv(cols, BLOCK_C)
        per_group = GROUP * col_tiles
        first = (program // per_group) * GROUP
        size = min(row_tiles - first, GROUP)
        row_tile = first + (program % per_group) % size
        col_tile = (program % per_group) // size
        r = row_tile * BLOCK_R + tl.arange(0, BLOCK_R)
        c = col_tile * BLOCK_C + tl.arange(0, BLOCK_C)
        d = tl.arange(0, BLOCK_D)
        acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
        for start in range(0, depth, BLOCK_D):
            a = tl.load(x + r[:, None] * depth + (start + d)[None, :], mask=r[:, None] < rows, other=0.0)
            b = tl.load(w + c[:, None] * depth + (start + d)[None, :], mask=c[:, None] < cols, other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
        inside = (r[:, None] < rows) & (c[None, :] < cols)
        tl.store(y + r[:, None] * cols + c[None, :], acc.to(tl.bfloat16), mask=inside)

    def product(x: torch.Tensor, weight: torch.Tensor, tile) -> torch.Tensor:
        block_r, block_c, block_d, stages, warps = tile
        out = torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=x.dtype)
        grid = (triton.cdiv(x.shape[0], block_r) * triton.cdiv(weight.shape[0], block_c),)
        kernel[grid](x, weight, out, x.shape[0], weight.shape[0], x.shape[1], BLOCK_R=block_r, BLOCK_C=block_c,
                     BLOCK_D=block_d, GROUP=8, num_stages=stages, num_warps=warps)
        return out

    return product


def more_variants(x: torch.Tensor, weights: list[torch.Tensor]) -> dict:
    """cuBLASLt, the transposed product and the best Triton tile, microseconds a layer (`--more`)."""
    row = {}
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        row["cublaslt"] = layer_us(F.linear, x, weights)
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")
    row["transposed_product"] = layer_us(lambda x, w: torch.mm(w, x.t()), x, weights)
    product, reference = triton_product(), F.linear(x, weights[0]).float()
    tiles = {}
    for tile in TRITON_TILES:
        error = (product(x, weights[0], tile).float() - reference).abs().max().item()
        if error < 1e-2 * reference.abs().max().item():
            tiles["x".join(map(str, tile))] = layer_us(lambda x, w, tile=tile: product(x, w, tile), x, weights)
    if tiles:
        best = min(tiles, key=tiles.get)
        row["triton_best"], row["triton_best_tile"] = tiles[best], best
    return row


def inductor_variant(x: torch.Tensor, weights: list[torch.Tensor]) -> dict:
    """The product compiled by inductor in max-autotune (`--inductor`), microseconds a layer, and how long choosing
    its kernel took."""
    import torch._inductor.config as inductor

    settings = {"max_autotune": True, "max_autotune_gemm_backends": "ATEN,TRITON",
                "triton.enable_persistent_tma_matmul": True}
    with inductor.patch(settings):
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, w: F.linear(x, w), dynamic=False, fullgraph=True)
        started = time.perf_counter()
        reference = F.linear(x, weights[0]).float()
        error = (compiled(x, weights[0]).float() - reference).abs().max().item() / reference.abs().max().item()
        tuning_s = time.perf_counter() - started
        return {"inductor_max_autotune": layer_us(compiled, x, weights), "inductor_tuning_s": round(tuning_s, 1),
                "inductor_relative_error": f"{error:.1e}"}


def layer_us(product, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Microseconds a layer of ``product(x, weight)`` over every layer's weight in one CUDA graph."""
    return 1000 * time_ms(lambda i: product(x, weights[i]), len(weights))


def measure(rows: int, more: bool = False, inductor: bool = False) -> dict:
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
            if more:
                row.update(more_variants(x, weights))
            if inductor:
                row.update(inductor_variant(x, weights))
            flops = 2 * rows * width_in * width_out
            row = {key: round(value, 1) if isinstance(value, float) else value for key, value in row.items()}
            cublas = [value for key, value in row.items()
                      if isinstance(value, float) and not key.startswith(("triton", "inductor"))]
            row["tflops_as_stored"] = round(flops / row["as_stored"] / 1e6, 1)
            row["tflops_best"] = round(flops / min(cublas) / 1e6, 1)  # of the cuBLAS calls timed
            row["transposed_speedup"] = round(row["as_stored"] / row["transposed"], 3)
            if inductor:
                row["inductor_speedup_over_best_cublas"] = round(min(cublas) / row["inductor_max_autotune"], 3)
            report["us_per_layer"][f"{shape}_{name}"] = row
            print(shape, name, row, flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256, help="the decode batch")
    parser.add_argument("--more", action="store_true", help="also cuBLASLt, the transposed product and Triton tiles")
    parser.add_argument("--inductor", action="store_true", help="also torch.compile's max-autotune choice")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = measure(args.rows, args.more, args.inductor)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
