"""Decode attention over the paged KV pool (FP8 or bf16) as a CUDA kernel, compiled at run time by NVRTC
(`engine_core.nvrtc`: no build step, no CUDA toolkit) and loaded by PyTorch.

Why not Triton, which runs the engine's decode attention (`triton_attention`): over an FP8 pool the Triton kernel
reads at 75% of the H100's copy rate where it reads a bf16 pool at 91%
(`benchmarks/results/decode_gemm_layouts_h100_gpu.json`), and the levers Triton leaves (tiles, warps, stages,
register caps, FP8 tensor-core products, several heads a program, layouts; docs/engines.md) were spent. Its
tensor-core operands go through shared memory, and FP8 has no transposing `ldmatrix` on Hopper, so the values'
tile was read back byte by byte.

This kernel keeps its tiles in registers, loaded straight from global memory in the layout of the `mma.sync`
m16n8k16 operands, with no shared memory. One warp attends one (sequence, KV head); a block holds `Launch.warps` KV
heads of one sequence, which read the same pages at the same time. The products are transposed, ``S^T = K Q^T``
and ``O^T = V^T P^T``, so that a tile's 16 tokens (and the head dimension) fill the operands' 16 rows and the query
group (up to 8 heads a KV head) their 8 columns:

- Keys: a sum over the head dimension may take the dimensions in any order as long as the query and the keys
  agree, so each thread's key fragments are the bytes it loaded as they lie (two 16-byte runs of a token, whole
  32-byte sectors across its quad) and its query fragments the matching dimensions.
- Probabilities: the scores' fragments (thread 4g + c: tokens g and g + 8, query heads 2c and 2c + 1) reach the
  second product's B fragments through one `movmatrix` transpose per 8 x 8 block.
- Values: each thread loads 16 contiguous bytes of the four tokens its A fragments take and builds them with one
  `prmt` per two entries; the output's dimensions come out in 16-wide runs per thread and are stored as such.
- FP8 entries become bf16 by their bits (``prmt``, a shift and a mask per two entries), which gives the value
  times 2**-120; as in the Triton kernel the query and the probabilities are carried 2**64 up so that the products
  stay well inside float32's normal range, and the factors are folded into the scales. The keys' scale multiplies
  the scores and the values' scale the probabilities.

Shapes are fixed by the batch and the table width and the lengths are read from device memory, so the kernel runs
inside CUDA graphs. What it takes: bf16 queries, a head dimension of 128, up to 8 query heads a KV head, pages of a
multiple of 16 slots, 16-byte aligned rows; `unfit` says why a call does not qualify, `supported` whether it does.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from relax.backends.inference.engine_core import nvrtc

logger = logging.getLogger(__name__)

HEAD_DIM = 128
MAX_GROUP = 8
# Whether the engine's decode steps take this kernel where it fits (`attention.attend`), else the Triton one. On an
# H100 (2026-12-06) it read the 4B shape's FP8 pool 1.135x and a bf16 pool 1.026x faster than the Triton kernel's
# best tile, and took FP8 rollout with an FP8 pool from 1.37x to 1.52x bf16 (docs/engines.md).
# `benchmarks.engine_gpu`'s ``*_triton_attention`` variants turn it off for their baselines.
ENGINE_TAKES_IT = True

_SOURCE = r"""
typedef unsigned int u32;

#define GROUP __GROUP__
#define PAGE __PAGE__
#define WARPS __WARPS__
#define MIN_BLOCKS __MIN_BLOCKS__
#define QUANTIZED __QUANTIZED__
#define TILES __TILES__
#define NEG_INF __int_as_float(0xFF800000)
#if QUANTIZED  // a thread's 16-byte loads of a token's key (two runs 64 bytes apart) and value
#define KEY_LOADS 2
#define KEY_HALF 64
#define VALUE_LOADS 1
#else
#define KEY_LOADS 4
#define KEY_HALF 128
#define VALUE_LOADS 2
#endif
#define CARRY 18446744073709551616.0f  // 2**64
#define UNCARRY 72057594037927936.0f   // 2**56: 2**120 (the widening) over 2**64 (the carry)

// D[16 x 8] += A[16 x 16] B[16 x 8], bf16 operands, float32 accumulators
__device__ __forceinline__ void mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// bytes of a and b (0-3 and 4-7) picked by a prmt selector: the low and high halves of two bf16 pairs, say
__device__ __forceinline__ u32 halves(u32 a, u32 b, u32 selector) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
    return d;
}

// Two e4m3 bytes picked by a prmt selector into a bf16x2, each the byte's value times 2**-120: the selector puts
// each byte in the low half of a 16-bit lane with its sign replicated above it, the shift moves the exponent and
// mantissa to bits 10..4 and the sign to bit 15, the mask keeps those.
__device__ __forceinline__ u32 widen(u32 a, u32 b, u32 selector) {
    return (halves(a, b, selector) << 4) & 0x87F087F0u;
}

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// an 8 x 8 matrix of bf16 held as fragments (thread 4r + q: row r, columns 2q, 2q + 1) transposed in place
__device__ __forceinline__ u32 transpose8x8(u32 x) {
    u32 d;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(x));
    return d;
}

__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint4 load16(const unsigned char *p) {
    return *reinterpret_cast<const uint4 *>(p);
}

__device__ __forceinline__ u32 word(const uint4 &v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ float max_over_rows(float x) {  // over the 8 lanes that share lane % 4
    x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, 4));
    x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, 8));
    return fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, 16));
}

__device__ __forceinline__ float sum_over_rows(float x) {
    x += __shfl_xor_sync(0xFFFFFFFFu, x, 4);
    x += __shfl_xor_sync(0xFFFFFFFFu, x, 8);
    return x + __shfl_xor_sync(0xFFFFFFFFu, x, 16);
}

// One warp per (sequence, KV head). Products transposed, so that the tile's tokens (and the head dimension) fill
// the 16 rows of the m16n8k16 operands and the query group the 8 columns: S^T = K Q^T, then O^T = V^T P^T.
// Thread 4g + c holds, of each 16-token tile, tokens g and g + 8 of the keys and scores, and the two query heads
// 2c, 2c + 1 as columns. A trip takes TILES tiles (their loads issued together). Strides are in bytes.
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
paged_decode(const unsigned char *__restrict__ query, const unsigned char *__restrict__ key_pool,
             const unsigned char *__restrict__ value_pool, unsigned char *__restrict__ out,
             const int *__restrict__ tables, const int *__restrict__ lens,
             const float *__restrict__ key_scales, const float *__restrict__ value_scales, double scale,
             int stride_qb, int stride_qh, int stride_ks, int stride_kh, int stride_vs, int stride_vh,
             int stride_ob, int stride_oh, int stride_tb, int stride_ss, int stride_sh, int kv_heads) {
    const int lane = threadIdx.x & 31;
    const int head = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int seq = blockIdx.y;
    if (head >= kv_heads) return;
    const int g = lane >> 2;
    const int c = lane & 3;
    const int length = lens[seq];

    // Q^T's B fragments: query head g of the group at the dimensions this thread's key words hold, pairs
    // m = 0..15 at 16c + 2m (m < 8) and 64 + 16c + 2(m - 8); k-step s takes pairs 2s and 2s + 1. Over an FP8 pool
    // 2**64 up (the keys come 2**-120 down).
    u32 q[16];
    if (g < GROUP) {
        const unsigned char *row = query + (long long)seq * stride_qb + (long long)(head * GROUP + g) * stride_qh;
        #pragma unroll
        for (int part = 0; part < 4; ++part) {
            const uint4 v = load16(row + 2 * (64 * (part >> 1) + 16 * c) + 16 * (part & 1));
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 w = word(v, i);
#if QUANTIZED
                q[4 * part + i] = pack_bf16(__uint_as_float(w << 16) * CARRY, __uint_as_float(w & 0xFFFF0000u) * CARRY);
#else
                q[4 * part + i] = w;
#endif
            }
        }
    } else {
        #pragma unroll
        for (int i = 0; i < 16; ++i) q[i] = 0u;
    }
#if QUANTIZED
    const float score_factor = (float)(scale * 1.4426950408889634) * UNCARRY;  // log2 units, carries folded in
    // a token's key bytes at 16c.. and 64 + 16c..: 16 each; its value bytes at 16g..: 16
    const unsigned char *keys = key_pool + (long long)head * stride_kh + 16 * c;
    const unsigned char *values = value_pool + (long long)head * stride_vh + 16 * g;
    const float *k_scales = key_scales + (long long)head * stride_sh;
    const float *v_scales = value_scales + (long long)head * stride_sh;
#else
    const float score_factor = (float)(scale * 1.4426950408889634);
    const unsigned char *keys = key_pool + (long long)head * stride_kh + 32 * c;  // 32 bytes at each
    const unsigned char *values = value_pool + (long long)head * stride_vh + 32 * g;
#endif
    const int *table = tables + (long long)seq * stride_tb;

    float maximum[2] = {NEG_INF, NEG_INF}, total[2] = {0.f, 0.f};  // query heads 2c, 2c + 1
    // O^T's accumulators: m-tile i holds dimensions 16g + 2i (rows g) and 16g + 2i + 1 (rows g + 8)
    float o[8][4];
    #pragma unroll
    for (int i = 0; i < 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

    for (int start = 0; start < length; start += 16 * TILES) {
        // the trip's 16-token tiles, each inside one page (pages are a multiple of 16 slots)
        long long slot[TILES];
        #pragma unroll
        for (int t = 0; t < TILES; ++t) {
            const int first = start + 16 * t;
            slot[t] = first < length ? (long long)table[first / PAGE] * PAGE + first % PAGE : 0;
        }
        // keys: tokens g and g + 8 of each tile (rows g and g + 8 of K), this thread's dimensions of each;
        // values: tokens 2c, 2c + 1, 2c + 8, 2c + 9 (V^T's k-columns), dimensions 16g..16g+15
        uint4 k[TILES][2][KEY_LOADS], v[TILES][4][VALUE_LOADS];
        #pragma unroll
        for (int t = 0; t < TILES; ++t) {
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                const bool valid = start + 16 * t + 8 * r + g < length;
                const unsigned char *p = keys + (slot[t] + 8 * r + g) * stride_ks;
                #pragma unroll
                for (int i = 0; i < KEY_LOADS; ++i)
                    k[t][r][i] = valid ? load16(p + KEY_HALF * (i / (KEY_LOADS / 2)) + 16 * (i % (KEY_LOADS / 2)))
                                       : make_uint4(0, 0, 0, 0);
            }
            #pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int offset = 2 * c + (u & 1) + 8 * (u >> 1);
                const bool valid = start + 16 * t + offset < length;
                #pragma unroll
                for (int i = 0; i < VALUE_LOADS; ++i)
                    v[t][u][i] = valid ? load16(values + (slot[t] + offset) * stride_vs + 16 * i)
                                       : make_uint4(0, 0, 0, 0);
            }
        }
#if QUANTIZED
        // the scales of tokens g and g + 8: the keys' multiply the scores, the values' the probabilities
        float ks[TILES][2], vs[TILES][2];
        #pragma unroll
        for (int t = 0; t < TILES; ++t) {
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                const bool valid = start + 16 * t + 8 * r + g < length;
                const long long at = (slot[t] + 8 * r + g) * stride_ss;
                ks[t][r] = valid ? k_scales[at] : 0.f;
                vs[t][r] = valid ? v_scales[at] : 0.f;
            }
        }
#endif
        // S^T = K Q^T
        float s[TILES][4];
        #pragma unroll
        for (int t = 0; t < TILES; ++t) {
            s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
            #pragma unroll
            for (int step = 0; step < 8; ++step) {
#if QUANTIZED  // key word s holds pairs 2s and 2s + 1 as four bytes
                const u32 lo = word(k[t][0][step >> 2], step & 3), hi = word(k[t][1][step >> 2], step & 3);
                mma(s[t], widen(lo, 0u, 0x9180u), widen(hi, 0u, 0x9180u), widen(lo, 0u, 0xB3A2u),
                    widen(hi, 0u, 0xB3A2u), q[2 * step], q[2 * step + 1]);
#else  // key words 2s and 2s + 1 are the pairs
                const int m = 2 * step;
                mma(s[t], word(k[t][0][m >> 2], m & 3), word(k[t][1][m >> 2], m & 3),
                    word(k[t][0][(m + 1) >> 2], (m + 1) & 3), word(k[t][1][(m + 1) >> 2], (m + 1) & 3),
                    q[m], q[m + 1]);
#endif
            }
        }
        // online softmax per query head (a column): scores of masked tokens are -inf
        float tile_max[2] = {NEG_INF, NEG_INF};
        #pragma unroll
        for (int t = 0; t < TILES; ++t) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                const bool valid = start + 16 * t + 8 * r + g < length;
#if QUANTIZED
                s[t][e] = valid ? s[t][e] * ks[t][r] * score_factor : NEG_INF;
#else
                s[t][e] = valid ? s[t][e] * score_factor : NEG_INF;
#endif
                tile_max[e & 1] = fmaxf(tile_max[e & 1], s[t][e]);
            }
        }
        float correction[2];
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float new_max = fmaxf(maximum[h], max_over_rows(tile_max[h]));
            correction[h] = exp2_approx(maximum[h] - new_max);
            maximum[h] = new_max;
            total[h] *= correction[h];
        }
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            o[i][0] *= correction[0]; o[i][2] *= correction[0];
            o[i][1] *= correction[1]; o[i][3] *= correction[1];
        }
        // P^T as B fragments: rows g (tokens 0-7) and g + 8 (8-15) of a tile are 8 x 8 blocks whose transposes
        // hold tokens 2c, 2c + 1 (and 2c + 8, 2c + 9) of query head g. Over an FP8 pool times the values' scales,
        // 2**64 up.
        u32 p[TILES][2];
        #pragma unroll
        for (int t = 0; t < TILES; ++t) {
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float p0 = exp2_approx(s[t][2 * r] - maximum[0]);
                const float p1 = exp2_approx(s[t][2 * r + 1] - maximum[1]);
                total[0] += p0;
                total[1] += p1;
#if QUANTIZED
                p[t][r] = transpose8x8(pack_bf16(p0 * vs[t][r] * CARRY, p1 * vs[t][r] * CARRY));
#else
                p[t][r] = transpose8x8(pack_bf16(p0, p1));
#endif
            }
        }
        // O^T += V^T P^T: m-tile i takes dimension 16g + 2i (rows g) and 16g + 2i + 1 (rows g + 8) of the four tokens
        #pragma unroll
        for (int t = 0; t < TILES; ++t) {
            #pragma unroll
            for (int i = 0; i < 8; ++i) {
#if QUANTIZED  // bytes 2i % 4 and 2i % 4 + 1 of word i / 2
                const u32 b = 2 * (i & 1);
                const u32 sel_g = b | ((b | 8u) << 4) | ((b + 4u) << 8) | (((b + 4u) | 8u) << 12);
                const u32 sel_g8 = sel_g + 0x1111u;
                const u32 w0 = word(v[t][0][0], i >> 1), w1 = word(v[t][1][0], i >> 1);
                const u32 w8 = word(v[t][2][0], i >> 1), w9 = word(v[t][3][0], i >> 1);
                mma(o[i], widen(w0, w1, sel_g), widen(w0, w1, sel_g8), widen(w8, w9, sel_g), widen(w8, w9, sel_g8),
                    p[t][0], p[t][1]);
#else  // the low and high halves of word i
                const u32 w0 = word(v[t][0][i >> 2], i & 3), w1 = word(v[t][1][i >> 2], i & 3);
                const u32 w8 = word(v[t][2][i >> 2], i & 3), w9 = word(v[t][3][i >> 2], i & 3);
                mma(o[i], halves(w0, w1, 0x5410u), halves(w0, w1, 0x7632u), halves(w8, w9, 0x5410u),
                    halves(w8, w9, 0x7632u), p[t][0], p[t][1]);
#endif
            }
        }
    }
    // heads 2c and 2c + 1 of the group: dimensions 16g..16g+15, pairs (2i, 2i + 1) from rows g and g + 8
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float sum = sum_over_rows(total[h]);
        if (2 * c + h >= GROUP) continue;
#if QUANTIZED
        const float factor = UNCARRY / sum;
#else
        const float factor = 1.f / sum;
#endif
        unsigned char *row = out + (long long)seq * stride_ob + (long long)(head * GROUP + 2 * c + h) * stride_oh
                             + 32 * g;
        u32 packed[8];
        #pragma unroll
        for (int i = 0; i < 8; ++i) packed[i] = pack_bf16(o[i][h] * factor, o[i][h + 2] * factor);
        *reinterpret_cast<uint4 *>(row) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        *reinterpret_cast<uint4 *>(row + 16) = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    }
}
"""


@dataclass(frozen=True)
class Launch:
    """The kernel's constants: ``tiles`` 16-token tiles a trip (their loads issued together), ``warps`` KV heads a
    block (one sequence's heads read the same pages together), ``min_blocks`` blocks a multiprocessor must hold
    (caps the registers)."""

    tiles: int
    warps: int = 4
    min_blocks: int = 4


# Over an FP8 pool two tiles a trip fit 128 registers (122 used, none spilled) and four blocks a multiprocessor;
# a bf16 pool's tile is twice the bytes, so one.
LAUNCH = {True: Launch(tiles=2), False: Launch(tiles=1)}


def kernel_source(quantized: bool, group: int, page: int, launch: Launch) -> str:
    constants = {"__QUANTIZED__": int(quantized), "__TILES__": launch.tiles, "__GROUP__": group, "__PAGE__": page,
                 "__WARPS__": launch.warps, "__MIN_BLOCKS__": launch.min_blocks}
    source = _SOURCE
    for name, value in constants.items():
        source = source.replace(name, str(value))
    return source


@functools.cache
def _compiled(quantized: bool, group: int, page: int, launch: Launch, device: int):
    """The kernel for these constants, built for and loaded on CUDA device ``device`` (a module belongs to the
    context it was loaded in), or None where it cannot be (the Triton kernel runs)."""
    from torch.cuda._utils import _cuda_load_module

    major, minor = torch.cuda.get_device_capability(device)
    try:
        cubin, _ = nvrtc.compile_cubin(kernel_source(quantized, group, page, launch), "paged_decode",
                                       f"sm_{major}{minor}")
        with torch.cuda.device(device):
            return _cuda_load_module(cubin, ["paged_decode"])["paged_decode"]
    except (nvrtc.NvrtcError, RuntimeError, OSError) as error:  # no library, or a device it cannot build for
        logger.warning("decode attention: the CUDA kernel could not be built (%s); the Triton kernel runs", error)
        return None


def unfit(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, page: int,
          key_scales: torch.Tensor | None, value_scales: torch.Tensor | None) -> str | None:
    """Why the kernel cannot take these operands (None if it can), on any device."""
    if (key_scales is None) != (value_scales is None):
        return "one of the keys' and values' scales is missing"
    if key_scales is not None:
        if key_pool.element_size() != 1 or value_pool.element_size() != 1:
            return "an FP8 pool's entries are not one byte"
        if key_scales.stride() != value_scales.stride():
            return "the keys' and values' scales are laid out differently"
    elif key_pool.dtype != torch.bfloat16 or value_pool.dtype != torch.bfloat16:
        return "the pool is neither FP8 nor bf16"
    if query.dtype != torch.bfloat16 or query.dim() != 3:
        return "the queries are not [batch, heads, dim] bf16"
    heads, dim = query.shape[1:]
    kv_heads = key_pool.shape[1]
    if dim != HEAD_DIM:
        return f"head dimension {dim}, not {HEAD_DIM}"
    if heads % kv_heads or heads // kv_heads > MAX_GROUP:
        return f"{heads} query heads over {kv_heads} KV heads: a group of at most {MAX_GROUP} is taken"
    if page % 16:
        return f"pages of {page} slots, not a multiple of 16"
    if query.stride(-1) != 1 or key_pool.stride(-1) != 1 or value_pool.stride(-1) != 1:
        return "a head vector is not contiguous"
    aligned = (query.stride(0) * 2, query.stride(1) * 2, key_pool.stride(0) * key_pool.element_size(),
               key_pool.stride(1) * key_pool.element_size(), value_pool.stride(0) * value_pool.element_size(),
               value_pool.stride(1) * value_pool.element_size(), query.data_ptr(), key_pool.data_ptr(),
               value_pool.data_ptr())
    if any(x % 16 for x in aligned):
        return "rows not 16-byte aligned"
    return None


def supported(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, page: int,
              key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None) -> bool:
    """Whether `paged_decode_attention` takes this call: CUDA tensors that the kernel fits (`unfit`) and a kernel
    NVRTC could build."""
    if not query.is_cuda or unfit(query, key_pool, value_pool, page, key_scales, value_scales) is not None:
        return False
    quantized = key_scales is not None
    return _compiled(quantized, query.shape[1] // key_pool.shape[1], page, LAUNCH[quantized],
                     query.device.index) is not None


def paged_decode_attention(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, page: int,
                           key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
                           launch: Launch | None = None) -> torch.Tensor:
    """``query [B, Hq, 128]`` bf16 over each sequence's first ``context_lens[b]`` (at least 1) slots of the pool
    (``[slots, Hkv, 128]`` of ``page``-slot blocks, bf16, or FP8 with its ``key_scales``/``value_scales [slots,
    Hkv]`` float32; ``block_tables [B, W]`` int32); ``[B, Hq, 128]``. The caller checks `supported`."""
    batch, heads, dim = query.shape
    kv_heads = key_pool.shape[1]
    out = torch.empty(batch, heads, dim, dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    quantized = key_scales is not None
    launch = launch or LAUNCH[quantized]
    kernel = _compiled(quantized, heads // kv_heads, page, launch, query.device.index)
    block_tables = block_tables.to(torch.int32).contiguous()  # no copy when they are (the engine's are)
    context_lens = context_lens.to(torch.int32).contiguous()
    if not quantized:  # unread
        key_scales = value_scales = context_lens
    scale_strides = (key_scales.stride(0), key_scales.stride(1)) if quantized else (0, 0)
    k_bytes, v_bytes = key_pool.element_size(), value_pool.element_size()
    kernel(grid=(-(-kv_heads // launch.warps), batch, 1), block=(32 * launch.warps, 1, 1),
           args=[query, key_pool, value_pool, out, block_tables, context_lens, key_scales, value_scales,
                 float(scale), 2 * query.stride(0), 2 * query.stride(1), k_bytes * key_pool.stride(0),
                 k_bytes * key_pool.stride(1), v_bytes * value_pool.stride(0), v_bytes * value_pool.stride(1),
                 2 * out.stride(0), 2 * out.stride(1), block_tables.stride(0), *scale_strides, kv_heads])
    return out
