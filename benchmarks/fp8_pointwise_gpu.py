"""The FP8 rollout's pointwise kernels on one decoder layer of the Qwen3-4B shape, swept over their launch settings.

A decode step of the FP8 engine at batch 256 spent 1.36 ms of its 7.2 ms of kernels on an H100 in four pointwise
kernels a layer (the residual add + RMSNorm that quantises, the q/k-norm + rotary + K/V store, SiLU-mul, the
row quantisation), each 6-8 us where its bytes take 1-3 (docs/engines.md). Each kernel is timed here at the
decode step's rows (``--decode-rows``) and a prefill chunk's (``--prefill-rows``) for each launch setting (warps
per program, heads per program, columns per program) and each way to quantise SiLU-mul's rows, on the inputs the engine hands it (`ScaledProduct`s with their scales, an FP8
KV pool), in CUDA graphs of ``--iterations`` launches (`fp8_gemm_gpu.time_ms`: the device's time, as the engine
replays its decode steps). The JSON gives each setting's time, the best, the engine's setting (``default``)
against its setting before the sweep (``previous``: 8 warps for the norm, one head a program for the q/k kernel,
SiLU-mul then one 8-warp program a row quantising), per kernel and per layer (``*_speedup_over_previous``). A prefill's K/V
gather from an FP8 pool is timed too: the Triton kernel (`triton_ops.gather_dequantized`) against the torch
operations it replaced (`LayerKV.gather`, ``gather_speedup``).

    python -m benchmarks.fp8_pointwise_gpu [--decode-rows 256 --prefill-rows 8192]
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from benchmarks.fp8_gemm_gpu import time_ms
from relax.backends.inference.engine_core.fp8_format import FP8_MAX, MIN_SCALE, ScaledProduct
from relax.backends.inference.engine_core.kv_cache import KVPool
from relax.backends.inference.engine_core.triton_ops import (
    add_rms_norm,
    gather_dequantized,
    qk_norm_rope_store,
    quantize_rows_fp8,
    silu_mul,
    silu_mul_quantized,
)

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, DIM = 2560, 9728, 32, 8, 128  # Qwen3-4B


def scaled_product(rows: int, columns: int) -> ScaledProduct:
    return ScaledProduct((torch.randn(rows, columns, device="cuda") * 3e3).bfloat16(),
                         torch.rand(rows, 1, device="cuda") * 1e-2, torch.rand(columns, device="cuda") * 1e-2)


# a layer's pointwise kernels, each with how many times a layer runs it
LAYER_KERNELS = {"add_rms_norm_quantize": 2, "qk_norm_rope_store": 1, "silu_mul_quantize": 1,
                 "quantize_attention_output": 1}


def kernels(rows: int, pool: KVPool) -> dict[str, dict[str, object]]:
    """Each kernel's settings by name, each a ``callable(i)`` running the kernel once: the engine's (``default``)
    first, the engine's before this benchmark's sweep (``previous``) where it differs."""
    residual = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    weight = torch.randn(HIDDEN, device="cuda").bfloat16()
    o_product = scaled_product(rows, HIDDEN)
    qkv = scaled_product(rows, (HEADS + 2 * KV_HEADS) * DIM).split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM])
    gate, up = scaled_product(rows, 2 * INTERMEDIATE).split([INTERMEDIATE, INTERMEDIATE])
    attended = torch.randn(rows, HEADS * DIM, device="cuda").bfloat16()
    cos, sin = (torch.randn(4096, DIM, device="cuda").bfloat16() for _ in range(2))
    positions = torch.randint(0, 4096, (rows,), device="cuda")
    slots = torch.randperm(pool.layers[0].keys.shape[0], device="cuda")[:rows]
    norm = torch.randn(DIM, device="cuda").bfloat16()
    layer = pool.layers[0]

    def norm_with(**setting):
        return lambda i: add_rms_norm(o_product, weight, 1e-6, residual=residual, quantize=True, **setting)

    def qk_with(**setting):
        return lambda i: qk_norm_rope_store(*qkv, norm, norm, 1e-6, cos, sin, positions, slots, layer, **setting)

    def silu_then_rows(**setting):  # SiLU-mul, then one program a row quantises
        return lambda i: quantize_rows_fp8(silu_mul(gate, up), FP8_MAX, MIN_SCALE, **setting)

    return {
        "add_rms_norm_quantize": {"default": norm_with(), "previous": norm_with(num_warps=8),
                                  "warps2": norm_with(num_warps=2), "warps4": norm_with(num_warps=4)},
        "qk_norm_rope_store": {
            "default": qk_with(), "previous": qk_with(most_heads_per_program=1, num_warps=1),
            **{f"heads{h}_warps{w}": qk_with(most_heads_per_program=h, num_warps=w)
               for h, w in ((8, 1), (8, 2), (8, 8), (4, 1), (4, 2), (2, 1))}},
        "silu_mul_quantize": {
            "default": lambda i: silu_mul_quantized(gate, up), "previous": silu_then_rows(num_warps=8),
            "rows_32_warps": silu_then_rows(num_warps=32),
            **{f"block{b}": functools.partial(lambda i, b: silu_mul_quantized(gate, up, block=b), b=b)
               for b in (512, 2048)}},
        "quantize_attention_output": {
            "default": lambda i: quantize_rows_fp8(attended, FP8_MAX, MIN_SCALE),
            **{f"warps{w}": functools.partial(lambda i, w: quantize_rows_fp8(attended, FP8_MAX, MIN_SCALE,
                                                                             num_warps=w), w=w)
               for w in (4, 16)}},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-rows", type=int, default=256)
    parser.add_argument("--prefill-rows", type=int, default=8192)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--out", type=Path, default=RESULTS / "fp8_pointwise_gpu.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    pool = KVPool(1, 2 * args.prefill_rows, KV_HEADS, DIM, torch.bfloat16, "fp8_e4m3", torch.device("cuda"))
    report: dict = {"benchmark": "fp8_pointwise_gpu", "device": torch.cuda.get_device_name(), "shape": "qwen3-4b",
                    "kernels": {}}
    for phase, rows in (("decode", args.decode_rows), ("prefill", args.prefill_rows)):
        for name, settings in kernels(rows, pool).items():
            times = {}
            for setting_name, run in settings.items():
                times[setting_name] = round(1000 * time_ms(run, args.iterations), 2)
                print(f"{phase:7s} {name:26s} {setting_name:18s} {times[setting_name]:8.2f} us", flush=True)
            best = min(times, key=times.get)
            report["kernels"][f"{phase}_{name}"] = {
                "rows": rows, "us": times, "best": best,
                "speedup_of_best_over_default": round(times["default"] / times[best], 3),
                "speedup_over_previous": round(times.get("previous", times["default"]) / times["default"], 3)}
        for setting in ("default", "previous"):
            report[f"{phase}_{setting}_us_per_layer"] = round(sum(
                report["kernels"][f"{phase}_{name}"]["us"].get(setting, report["kernels"][f"{phase}_{name}"]["us"][
                    "default"]) * count for name, count in LAYER_KERNELS.items()), 2)
        report[f"{phase}_speedup_over_previous"] = round(report[f"{phase}_previous_us_per_layer"]
                                                         / report[f"{phase}_default_us_per_layer"], 3)
    layer = pool.layers[0]
    slots = torch.randperm(layer.keys.shape[0], device="cuda")[:args.prefill_rows]
    layer.write(slots, torch.randn(args.prefill_rows, KV_HEADS, DIM, device="cuda").bfloat16(),
                torch.randn(args.prefill_rows, KV_HEADS, DIM, device="cuda").bfloat16())
    torch_us = 1000 * time_ms(lambda i: layer.gather(slots, torch.bfloat16), args.iterations)
    triton_us = 1000 * time_ms(lambda i: gather_dequantized(layer, slots, torch.bfloat16), args.iterations)
    expected, got = layer.gather(slots, torch.bfloat16), gather_dequantized(layer, slots, torch.bfloat16)
    report["gather"] = {"rows": args.prefill_rows, "torch_us": round(torch_us, 2), "triton_us": round(triton_us, 2),
                        "equal": all(torch.equal(a, b) for a, b in zip(expected, got))}
    report["gather_speedup"] = round(torch_us / triton_us, 2)
    print(f"prefill K/V gather of {args.prefill_rows} slots: torch {torch_us:.1f} us, Triton {triton_us:.1f} us")
    headline = {key: value for key, value in report.items() if not isinstance(value, dict)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**headline, **report}, indent=2) + "\n")
    print(json.dumps(headline, indent=2))


if __name__ == "__main__":
    main()
