"""The engine core's decode kernels on one layer of the Qwen3-0.6B shape, timed on their own (CUDA events, the
median of many runs) against the bytes they must move, and checked against the Hugging Face modules in bf16:

- paged decode attention for a few tile sizes (``BLOCK_N``), warp counts and pipeline stages, over a bf16 pool and
  an FP8 one (``--kv-cache-dtype fp8_e4m3``, its scales in two layouts), each pool also stored head-major, and with
  the grid ordered by sequence (the kernel's default) or by KV head (the baseline), in GB/s of K/V (and scales) read;
  the FP8 pool's entries widened to bf16 by their bits (the kernel's default) or by the conversion instructions
  (the baseline: ``fp8_widen_by_bits_speedup``); and both pools in the CUDA kernel (`cuda_attention`) for a few
  launches, against the Triton kernel's best tile (``fp8_cuda_over_triton_speedup``, ``bf16_cuda_over_triton_speedup``);
- the fused sampler over a [batch, 151936] logits tensor;
- the fused RMSNorm, q/k-norm + rotary + K/V store and SiLU-mul against the modules they replace.

    python -m benchmarks.decode_kernels_gpu [--batch 256 --context 512]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, rotate_half

from relax.backends.inference import triton_sampling
from relax.backends.inference.engine_core import cuda_attention, triton_ops
from relax.backends.inference.engine_core.kv_cache import LayerKV, quantize_heads
from relax.backends.inference.engine_core.triton_attention import paged_decode_attention



def median_ms(fn, warmup: int = 10, repeat: int = 50) -> float:
    return triton.testing.do_bench(fn, warmup=warmup, rep=repeat, return_mode="median")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def write_report(report: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as handle:
            json.dump(report, handle, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--heads", type=int, default=16, help="query heads (Qwen3-0.6B 16, 4B 32)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--out", default=None)
    parser.add_argument("--variants", nargs="*", default=None,
                        help="time only the attention variants whose names hold one of these (default: all)")
    parser.add_argument("--attention-only", action="store_true", help="skip the sampler and pointwise kernels")
    args = parser.parse_args()
    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    batch, context, page, dim = args.batch, args.context, 16, 128
    heads, kv_heads = args.heads, args.kv_heads
    blocks_per_seq = -(-context // page)
    keys = torch.randn(batch * blocks_per_seq * page + page, kv_heads, dim, device=device, dtype=dtype)
    values = torch.randn_like(keys)
    tables = (torch.randperm(batch * blocks_per_seq, device=device) + 1).to(torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, heads, dim, device=device, dtype=dtype)
    report: dict = {"batch": batch, "context": context, "heads": heads, "kv_heads": kv_heads, "attention": {}}
    (fp8_keys, key_scales), (fp8_values, value_scales) = quantize_heads(keys), quantize_heads(values)
    reference = paged_decode_attention(query, keys, values, tables, lens, dim ** -0.5, page, heads_first=False)
    # the pools: bf16; FP8 with its scales slot-major ([slots, Hkv], the pool's layout) or head-major (a
    # transposed view of [Hkv, slots]: one head's scales of consecutive slots are adjacent); and both pools stored
    # head-major ([Hkv, slots, D] seen as [slots, Hkv, D]: a page's 16 vectors of one head are one contiguous run,
    # 2 KB in FP8, where slot-major rows are 128 bytes a KV head's stride apart)
    def head_major(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).contiguous().transpose(0, 1)

    fp8_scales = {"key_scales": key_scales, "value_scales": value_scales}
    head_major_scales = {"key_scales": head_major(key_scales), "value_scales": head_major(value_scales)}
    pools = {"bf16": (keys, values, {}),
             "fp8_scales_slot_major": (fp8_keys, fp8_values, fp8_scales),
             "fp8_scales_head_major": (fp8_keys, fp8_values, head_major_scales),
             "bf16_pool_head_major": (head_major(keys), head_major(values), {}),
             "fp8_pool_head_major": (head_major(fp8_keys), head_major(fp8_values), head_major_scales)}
    # (pool, options, tiles): the grid by sequence (one sequence's KV heads side by side: the kernel's default)
    # against by KV head (one head's sequences side by side: the baseline); an FP8 pool widened to bf16 for the
    # products by the conversion instructions (the baseline) or by integer instructions on the bytes' bits
    # (``widen_by_bits``, the kernel's default)
    full = [(n, w, s) for n in (64, 128, 256) for w in (4, 8) for s in (2, 3)]
    short = [(64, 4, 2), (128, 4, 2), (128, 4, 3), (256, 4, 2), (128, 8, 2)]
    by_kv_head, by_sequence = {"heads_first": False}, {"heads_first": True}
    by_bits, by_conversion = {"widen_by_bits": True}, {"widen_by_bits": False}
    variants = [("bf16", by_kv_head, short), ("fp8_scales_slot_major", by_kv_head | by_conversion, short),
                ("fp8_scales_head_major", by_kv_head | by_conversion, short), ("bf16", by_sequence, full),
                ("fp8_scales_slot_major", by_sequence | by_conversion, full),
                ("fp8_scales_slot_major", by_sequence | by_bits, full),
                ("bf16_pool_head_major", by_sequence, short),
                ("fp8_pool_head_major", by_sequence | by_conversion, short)]

    def variant_name(pool_name: str, options: dict) -> str:
        name = pool_name + ("_heads_first" if options["heads_first"] else "")
        return name + ("_widen_by_bits" if options.get("widen_by_bits") else "")

    for pool_name, options, tiles in variants:
        k_pool, v_pool, scales = pools[pool_name]
        name = variant_name(pool_name, options)
        if args.variants and not any(part in name for part in args.variants):
            continue
        scale_bytes = 2 * batch * context * kv_heads * 4 if scales else 0
        kv_bytes = 2 * batch * context * kv_heads * dim * k_pool.element_size() + scale_bytes
        for block_n, warps, stages in tiles:
            def run():
                return paged_decode_attention(query, k_pool, v_pool, tables, lens, dim ** -0.5, page, block_n=block_n,
                                              num_warps=warps, num_stages=stages, **options, **scales)
            try:
                ms = median_ms(run)
            except Exception as error:  # a tile that does not fit shared memory
                print(f"{name} BLOCK_N {block_n} warps {warps} stages {stages}: {type(error).__name__}")
                continue
            error = relative_error(run(), reference)
            report["attention"][f"{name}_block{block_n}_warps{warps}_stages{stages}"] = {
                "us": round(ms * 1000, 1), "gb_per_s": round(kv_bytes / ms / 1e6), "error": round(error, 4)}
            print(f"{name:40s} BLOCK_N {block_n:3d} warps {warps} stages {stages}: {ms * 1000:7.1f} us, "
                  f"{kv_bytes / ms / 1e6:7.0f} GB/s, error {error:.4f}", flush=True)
    # the CUDA kernel (`cuda_attention`) over both pools: (16-token tiles a trip, warps a block, blocks an SM)
    launches = {"fp8_scales_slot_major_cuda": [(2, 4, 4), (2, 4, 1), (2, 8, 2), (1, 4, 4), (4, 4, 1), (2, 2, 8)],
                "bf16_cuda": [(1, 4, 4), (1, 4, 1), (1, 8, 2), (2, 4, 1), (1, 2, 8)]}
    for name, configurations in launches.items():
        if args.variants and not any(part in name for part in args.variants):
            continue
        k_pool, v_pool, scales = pools[name.removesuffix("_cuda")]
        kv_bytes = 2 * batch * context * kv_heads * (dim * k_pool.element_size() + (4 if scales else 0))
        for tiles, warps, min_blocks in configurations:
            launch = cuda_attention.Launch(tiles, warps, min_blocks)

            def run():
                return cuda_attention.paged_decode_attention(query, k_pool, v_pool, tables, lens, dim ** -0.5, page,
                                                             launch=launch, **scales)
            ms = median_ms(run)
            error = relative_error(run(), reference)
            report["attention"][f"{name}_block{16 * tiles}_warps{warps}_blocks{min_blocks}"] = {
                "us": round(ms * 1000, 1), "gb_per_s": round(kv_bytes / ms / 1e6), "error": round(error, 4)}
            print(f"{name:40s} tiles {tiles} warps {warps} min blocks {min_blocks}: {ms * 1000:7.1f} us, "
                  f"{kv_bytes / ms / 1e6:7.0f} GB/s, error {error:.4f}", flush=True)
    best = {}
    for key, value in report["attention"].items():
        name = key[:key.index("_block")]
        best[name] = min(best.get(name, (float("inf"), "")), (value["us"], key))
    report["best_attention_us"] = best

    def speedup(baseline: str, candidate: str) -> float | None:
        return round(best[baseline][0] / best[candidate][0], 3) if baseline in best and candidate in best else None

    for pool_name in ("bf16", "fp8_scales_slot_major"):  # the headline: the grid by sequence against by KV head
        report[f"{pool_name}_heads_first_speedup"] = speedup(pool_name, pool_name + "_heads_first")
    converted, widened = "fp8_scales_slot_major_heads_first", "fp8_scales_slot_major_heads_first_widen_by_bits"
    report["fp8_over_bf16_speedup"] = speedup("bf16_heads_first", widened)  # the engine's FP8 kernel
    report["fp8_widen_by_bits_speedup"] = speedup(converted, widened)
    report["fp8_convert_over_bf16_speedup"] = speedup("bf16_heads_first", converted)
    report["fp8_cuda_over_triton_speedup"] = speedup(widened, "fp8_scales_slot_major_cuda")
    report["fp8_cuda_over_bf16_speedup"] = speedup("bf16_heads_first", "fp8_scales_slot_major_cuda")
    report["bf16_cuda_over_triton_speedup"] = speedup("bf16_heads_first", "bf16_cuda")
    print("best:", best)
    print({k: v for k, v in report.items() if k.endswith("_speedup")})
    if args.attention_only:
        write_report(report, args.out)
        return
    heads, kv_heads = 16, 8  # the 0.6B layer below
    vocab = 151936
    logits = torch.randn(batch, vocab, device=device) * 3
    temperature = torch.ones(batch, device=device)
    seeds = torch.arange(batch, device=device)
    counters = torch.full((batch,), 300, device=device)
    tokens = torch.empty(batch, dtype=torch.int64, device=device)
    log_probs = torch.empty(batch, device=device)
    ms = median_ms(lambda: triton_sampling.sample_tokens(logits, temperature, seeds, counters, tokens, log_probs))
    report["sampler"] = {"ms": ms, "gb_per_s": logits.numel() * 4 / ms / 1e6}
    print(f"sampler: {ms * 1000:.1f} us ({logits.numel() * 4 / ms / 1e6:.0f} GB/s of logits)")
    config = Qwen3Config(hidden_size=1024, head_dim=dim)
    hidden = torch.randn(batch, 1024, device=device, dtype=dtype)
    residual = torch.randn_like(hidden)
    norm = Qwen3RMSNorm(1024, eps=config.rms_norm_eps).to(device, dtype)
    norm.weight.data.normal_(1, 0.1)
    fused = triton_ops.add_rms_norm(hidden, norm.weight, config.rms_norm_eps, residual=residual.clone())
    report["rms_norm_error"] = relative_error(fused, norm(hidden + residual))
    report["rms_norm_us"] = {"fused": 1000 * median_ms(lambda: triton_ops.add_rms_norm(hidden, norm.weight, 1e-6,
                                                                                          residual=residual)),
                             "modules": 1000 * median_ms(lambda: norm(hidden + residual))}
    q = torch.randn(batch, heads * dim, device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads * dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q_norm = Qwen3RMSNorm(dim, eps=1e-6).to(device, dtype)
    k_norm = Qwen3RMSNorm(dim, eps=1e-6).to(device, dtype)
    positions = torch.randint(0, 4096, (batch,), device=device)
    inv = 1.0 / (1e6 ** (torch.arange(0, dim, 2, device=device).float() / dim))
    angles = torch.arange(4096, device=device)[:, None].float() * inv
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    slots = torch.randperm(keys.shape[0] - 1, device=device)[:batch] + 1
    out_q = triton_ops.qk_norm_rope_store(q, k, v, q_norm.weight, k_norm.weight, 1e-6, cos, sin, positions, slots,
                                          LayerKV(keys, values))

    def modules():
        qq, kk = q_norm(q.view(batch, heads, dim)), k_norm(k.view(batch, kv_heads, dim))
        c, s = cos[positions][:, None], sin[positions][:, None]
        qq, kk = qq * c + rotate_half(qq) * s, kk * c + rotate_half(kk) * s
        keys.index_copy_(0, slots, kk)
        values.index_copy_(0, slots, v.view(batch, kv_heads, dim))
        return qq, kk

    ref_q, ref_k = modules()
    report["qk_rope_error"] = relative_error(out_q, ref_q)
    report["qk_rope_us"] = {"fused": 1000 * median_ms(lambda: triton_ops.qk_norm_rope_store(
        q, k, v, q_norm.weight, k_norm.weight, 1e-6, cos, sin, positions, slots, LayerKV(keys, values))),
        "modules": 1000 * median_ms(modules)}
    gate, up = torch.randn(batch, 3072, device=device, dtype=dtype), torch.randn(batch, 3072, device=device, dtype=dtype)
    report["silu_mul_error"] = relative_error(triton_ops.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)
    print(json.dumps({k: v for k, v in report.items() if k != "attention"}, indent=1))
    write_report(report, args.out)


if __name__ == "__main__":
    main()
