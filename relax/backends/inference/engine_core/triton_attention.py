"""Decode attention over the paged KV pool as a Triton kernel (CUDA).

One program per (sequence, KV head) walks the sequence's block table ``BLOCK_N`` token slots at a time, loads
those slots' keys and values (rows of the pool gathered through the table), and keeps an online softmax for the
query heads that share the KV head (grouped-query attention). The query group is padded to 16 rows so that both
products run on the tensor cores; the padding rows are never stored. Shapes are fixed by the batch and the
table width, and lengths are read from device memory, so the kernel runs inside CUDA graphs. The bytes it must
move are the sequences' K/V (and the queries): decode is bound by them, not by arithmetic. Measured on an H200
(`benchmarks/decode_kernels_gpu.py`, batch 256, 512 tokens of context, 8 KV heads of 128): 3.76 TB/s of K/V
with ``BLOCK_N`` 128 and 4 warps, the best of 32/64/128 x 4/8 warps (the card copies at about 4.3 TB/s).

The grid runs one sequence's KV heads side by side, so the programs in flight read the same pages together (a
page's slots hold all KV heads' vectors, one 128- or 256-byte row each). Measured on an H100 (batch 256, 768 tokens
of context, 32 query and 8 KV heads; `benchmarks/results/decode_kernels_layouts_h100_gpu.json`): 274.6 against
278.0 us per layer in bf16 and 195.9 against 204.4 us over an FP8 pool, against one KV head's sequences side by
side. Tried there and not kept: the pool stored head-major (the same gains, with a new pool layout to carry) and
the products transposed so that the tile's tokens are their rows (4% slower in bf16, 56% over FP8).

Over an FP8 pool the products still run in bf16, so each entry is widened first. The conversion instructions
(e4m3 pairs to fp16, then each fp16 to bf16) run on the XU pipe at a quarter of the integer pipe's rate, and bound
the kernel: Nsight Compute found that pipe 64% busy, the memory at 53% of its throughput. The kernel widens the
bytes by their bits instead (`_e4m3_bits_to_bf16`, six integer instructions per four entries) and folds the
resulting factor of 2**-120 into the scales: 198.1 -> 169.0 us per 4B layer at batch 256 and 768 tokens on an H100
(1.17x; 1.62x the bf16 kernel), 128 registers instead of 168, the same outputs bit for bit
(`benchmarks/results/decode_kernels_fp8_widen_h100_gpu.json`; ``widen_by_bits=False`` is the path before).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# An FP8 e4m3 byte's bits placed in a bf16 (sign to bit 15, exponent and mantissa to bits 10..4) read as that bf16
# are the byte's value times 2**-120, subnormals included; the kernel folds the factor into the scales
_E4M3_IN_BF16 = tl.constexpr(2.0 ** -120)
# the query and the probabilities are carried 2**64 up and the products 2**56 down, so that the products of a
# query with the 2**-120 keys (or of a probability with the values) stay well inside float32's normal range
_CARRY_UP = tl.constexpr(2.0 ** 64)


@triton.jit
def _e4m3_bits_to_bf16(x):
    """Four e4m3 bytes a register to four bf16s (times 2**-120) in six integer instructions, where the conversion
    instructions (e4m3 pairs to fp16, then each fp16 to bf16) run at a quarter of the integer pipe's rate: PRMT
    spreads the bytes into 16-bit lanes with their sign byte replicated above (selector nibble bit 3), a shift puts
    the exponent and mantissa at bits 10..4 (the sign byte's bits reach bit 15), and the mask keeps the sign, the
    exponent and the mantissa. The NaN codes (0x7F, 0xFF) come out as +-480 (times the factor): a pool holds them
    only for a head vector that held a NaN, and `quantize_rows` then gives that vector a NaN scale (its largest
    magnitude), which the kernel multiplies in, as the conversion path would."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 lo, hi;
        prmt.b32 lo, $2, 0, 0x9180;
        prmt.b32 hi, $2, 0, 0xB3A2;
        shl.b32 lo, lo, 4;
        shl.b32 hi, hi, 4;
        and.b32 $0, lo, 0x87F087F0;
        and.b32 $1, hi, 0x87F087F0;
        }""",
        constraints="=r,=r,r", args=[x], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, k_scale_ptr, v_scale_ptr, scale,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ob, stride_oh, stride_tb, stride_ss,
    stride_sh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, QUANTIZED: tl.constexpr, HEADS_FIRST: tl.constexpr, WIDEN_BY_BITS: tl.constexpr,
):
    if HEADS_FIRST:  # a sequence's KV heads launch side by side: they read the same pages at the same time
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    length = tl.load(lens_ptr + seq)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=row_ok[:, None], other=0.0)
    if QUANTIZED and WIDEN_BY_BITS:
        q = (q.to(tl.float32) * _CARRY_UP).to(q.dtype)
        scale = scale / (_CARRY_UP * _E4M3_IN_BF16)
    maximum = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    total = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for start in range(0, length, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        valid = positions < length
        blocks = tl.load(tables_ptr + seq * stride_tb + positions // PAGE, mask=valid, other=0)
        slots = blocks.to(tl.int64) * PAGE + positions % PAGE
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :], mask=valid[:, None],
                    other=0.0)
        if QUANTIZED:  # FP8 entries times their vector's scale: the scale multiplies the scores
            k_scales = tl.load(k_scale_ptr + slots * stride_ss + kv_head * stride_sh, mask=valid, other=0.0)
            if WIDEN_BY_BITS:
                k = _e4m3_bits_to_bf16(k.to(tl.uint8, bitcast=True))
            else:
                k = k.to(q.dtype)
            scores = tl.dot(q, tl.trans(k)) * (k_scales * scale)[None, :]
        else:
            scores = tl.dot(q, tl.trans(k)) * scale  # [GROUP_PAD, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(maximum, tl.max(scores, axis=1))
        correction = tl.exp(maximum - new_max)
        p = tl.exp(scores - new_max[:, None])
        total = total * correction + tl.sum(p, axis=1)
        v = tl.load(v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + dims[None, :], mask=valid[:, None],
                    other=0.0)
        if QUANTIZED:  # and the values' scale the probabilities
            v_scales = tl.load(v_scale_ptr + slots * stride_ss + kv_head * stride_sh, mask=valid, other=0.0)
            if WIDEN_BY_BITS:
                acc = acc * correction[:, None] + tl.dot((p * (v_scales * _CARRY_UP)[None, :]).to(q.dtype),
                                                         _e4m3_bits_to_bf16(v.to(tl.uint8, bitcast=True)))
            else:
                acc = acc * correction[:, None] + tl.dot((p * v_scales[None, :]).to(q.dtype), v.to(q.dtype))
        else:
            acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v)
        maximum = new_max
    if QUANTIZED and WIDEN_BY_BITS:
        acc = acc / (_CARRY_UP * _E4M3_IN_BF16)
    out = acc / total[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def paged_decode_attention(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, page: int,
                           block_n: int = 128, key_scales: torch.Tensor | None = None,
                           value_scales: torch.Tensor | None = None, num_warps: int = 4,
                           num_stages: int = 2, heads_first: bool = True, widen_by_bits: bool = True) -> torch.Tensor:
    """``query [B, Hq, D]`` over each sequence's first ``context_lens[b]`` slots (pool ``[slots, Hkv, D]`` of
    ``page``-slot blocks, any strides, ``block_tables [B, W]`` int32); ``[B, Hq, D]``. An FP8 pool comes with its
    ``key_scales``/``value_scales [slots, Hkv]`` (`kv_cache`). ``heads_first`` orders the grid so that one
    sequence's KV heads run together instead of one KV head's sequences; ``widen_by_bits=False`` widens an FP8
    pool's entries by the conversion instructions (the path before). (Capping the registers at 96 with ptxas'
    maxnreg, five programs a multiprocessor instead of four, measured 0.94x on an H100:
    `benchmarks/results/decode_kernels_fp8_register_cap_h100_gpu.json`.)"""
    quantized = key_scales is not None
    batch, heads, dim = query.shape
    kv_heads = key_pool.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(query)
    k_scales = key_scales if quantized else context_lens  # unread when not quantized
    v_scales = value_scales if quantized else context_lens
    _paged_decode_kernel[(kv_heads, batch) if heads_first else (batch, kv_heads)](
        query, key_pool, value_pool, out, block_tables, context_lens, k_scales, v_scales, scale,
        query.stride(0), query.stride(1), key_pool.stride(0), key_pool.stride(1), value_pool.stride(0),
        value_pool.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), k_scales.stride(0),
        k_scales.stride(-1) if quantized else 0,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim, PAGE=page,
        BLOCK_N=block_n, QUANTIZED=quantized, HEADS_FIRST=heads_first,
        WIDEN_BY_BITS=widen_by_bits, num_warps=num_warps, num_stages=num_stages,
    )
    return out
