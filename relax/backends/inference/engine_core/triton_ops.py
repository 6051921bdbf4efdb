"""Fused pointwise work of a decoder layer on CUDA (Triton), with the Hugging Face forward's rounding.

A decode step of a small model is a few dozen tiny kernels per layer when written as the Hugging Face modules do
(an RMSNorm alone is six: cast, square, mean, rsqrt, multiply, weight), each costing a few microseconds
whatever its size: at batch 256 that was most of a step. These kernels do each stage in one pass:

- `add_rms_norm`: ``residual += x`` (optional) then RMSNorm with the weight, rows of ``[T, H]``;
- `qk_norm_rope_store`: per head RMSNorm of q and k (Qwen3), rotary positions, and the store of k and v into
  the KV pool at the tokens' slots, for all heads of all tokens (FP8 with a scale per head vector under
  ``--kv-cache-dtype fp8_e4m3``, `kv_cache`);
- `silu_mul`: ``silu(gate) * up``;
- `quantize_rows_fp8`: each row of ``[T, H]`` as FP8 e4m3 with one float32 scale (``--rollout-fp8``'s activations;
  the same arithmetic as `engine_core.fp8.quantize_rows`, which it equals exactly).

Under ``--rollout-fp8`` they also take the FP8 products' outputs as `ScaledProduct`s, applying the activations' and
the weights' scales as they load them; `add_rms_norm` (``quantize=True``) writes its rows quantised for the next
products (`Fp8Rows`, the arithmetic of `quantize_rows_fp8`), and `silu_mul_quantized` quantises SiLU-mul's rows in
a second, fully parallel kernel from the block maxima SiLU-mul writes: a layer's FP8 products then need one
row-wise quantisation kernel of their own (the attention's output), not four, and multiply with one scale per
tensor (`engine_core.fp8`).

Each rounds to the model's dtype where the Hugging Face code does (the normalised value before the weight, each
rotary product and the sum, the SiLU before the product), so the engine's log-probs stay those of the training
forward up to the order of fp32 sums.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from relax.backends.inference.engine_core.fp8_format import FP8, FP8_MAX, Fp8Rows, ScaledProduct
from relax.backends.inference.engine_core.fp8_format import MIN_SCALE as _MIN_SCALE

if TYPE_CHECKING:
    from relax.backends.inference.engine_core.kv_cache import LayerKV


@triton.jit
def _quantize_with(value, largest, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """Float32 entries of a row whose largest magnitude is ``largest`` as e4m3 values (still float32), and the
    row's scale, with `fp8_format.quantize_rows`' arithmetic. torch's, for its results bit for bit: a division by a
    number is a product with its float32 reciprocal, one by a tensor an IEEE-rounded division (Triton's `/` on
    float32 is an approximate one)."""
    scale = tl.maximum(largest * INV_FP8_MAX, MIN_SCALE)
    return tl.minimum(tl.maximum(tl.math.div_rn(value, scale), -FP8_MAX), FP8_MAX), scale


@triton.jit
def _quantize_row(value, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """A whole float32 row as e4m3 values (still float32) and its scale (`_quantize_with`)."""
    return _quantize_with(value, tl.max(tl.abs(value), axis=0), FP8_MAX, INV_FP8_MAX, MIN_SCALE)


@triton.jit
def _scaled(x, row_scale, column_scale_ptr, columns, mask):
    """``x``, a `ScaledProduct`'s entries at ``columns`` of rows whose scale is ``row_scale``, with its scales
    applied, rounded to its dtype as a linear's output is."""
    column_scale = tl.load(column_scale_ptr + columns, mask=mask, other=0.0)
    return (x.to(tl.float32) * row_scale * column_scale).to(x.dtype)


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, row_scale_ptr, column_scale_ptr, out_scale_ptr,
                         eps, stride, out_stride, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr,
                         SCALED: tl.constexpr, QUANTIZE: tl.constexpr, FP8_MAX: tl.constexpr,
                         INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < HIDDEN
    x = tl.load(x_ptr + row * stride + offsets, mask=mask, other=0.0)
    if SCALED:
        x = _scaled(x, tl.load(row_scale_ptr + row), column_scale_ptr, offsets, mask)
    if ADD:
        residual = tl.load(residual_ptr + row * stride + offsets, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride + offsets, x, mask=mask)
    value = x.to(tl.float32)
    variance = tl.sum(value * value, axis=0) / HIDDEN
    normed = (value * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + offsets, mask=mask, other=0.0)
    out = (normed.to(tl.float32) * weight.to(tl.float32)).to(x_ptr.dtype.element_ty)
    if QUANTIZE:
        quantized, scale = _quantize_row(out.to(tl.float32), FP8_MAX, INV_FP8_MAX, MIN_SCALE)
        tl.store(out_ptr + row * out_stride + offsets, quantized.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * out_stride + offsets, out, mask=mask)


def add_rms_norm(x: torch.Tensor | ScaledProduct, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, quantize: bool = False,
                 num_warps: int | None = None) -> torch.Tensor | Fp8Rows:
    """RMSNorm of ``x [T, H]`` (after ``residual += x`` in place when ``residual`` is given: then the norm is of
    the sum); returns the normalised rows, as `Fp8Rows` with ``quantize``. ``x`` may be an FP8 product's
    `ScaledProduct` (rows contiguous). ``num_warps``: a program's (one row's) warps; by default 16 on rows wider than
    2,048, 1.3x faster than 8 at 256 rows of the 4B shape on an H100 and as fast at 8,192
    (`benchmarks.fp8_pointwise_gpu`)."""
    scaled = isinstance(x, ScaledProduct)
    product = x.product if scaled else x
    tokens, hidden = product.shape
    if quantize:
        out = Fp8Rows(torch.empty(product.shape, dtype=FP8, device=product.device),
                      torch.empty((tokens, 1), dtype=torch.float32, device=product.device))
        values, out_scales = out
    else:
        out = values = torch.empty_like(product)
        out_scales = values  # unread
    row_scales, column_scales = (x.row_scales, x.column_scales) if scaled else (product, product)  # unread if not
    if tokens:
        _add_rms_norm_kernel[(tokens,)](
            product, residual if residual is not None else product, weight, values, row_scales, column_scales,
            out_scales, eps, product.stride(0), values.stride(0), HIDDEN=hidden,
            BLOCK=triton.next_power_of_2(hidden), ADD=residual is not None, SCALED=scaled, QUANTIZE=quantize,
            FP8_MAX=FP8_MAX, INV_FP8_MAX=1.0 / FP8_MAX, MIN_SCALE=_MIN_SCALE,
            num_warps=num_warps or (4 if hidden <= 2048 else 16))
    return out


@triton.jit
def _rope_half(x, partner, cos, sin, dtype, FIRST_HALF: tl.constexpr):
    """One half of ``x * cos + rotate_half(x) * sin`` with the Hugging Face rounding (each product, then the sum)."""
    rotated = -partner if FIRST_HALF else partner
    left = (x.to(tl.float32) * cos.to(tl.float32)).to(dtype)
    right = (rotated.to(tl.float32) * sin.to(tl.float32)).to(dtype)
    return (left.to(tl.float32) + right.to(tl.float32)).to(dtype)


@triton.jit
def _head_norm(x1, x2, weight1, weight2, eps, HALF: tl.constexpr, NORM: tl.constexpr):
    """RMSNorm of each head vector (a row of the ``[heads, HALF]`` halves ``x1``, ``x2``) with its weight."""
    if NORM:
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        scale = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)[:, None]
        x1 = ((a * scale).to(x1.dtype).to(tl.float32) * weight1[None, :].to(tl.float32)).to(x1.dtype)
        x2 = ((b * scale).to(x2.dtype).to(tl.float32) * weight2[None, :].to(tl.float32)).to(x2.dtype)
    return x1, x2


@triton.jit
def _store_heads(target, scale_ptr, heads, stride_scale_head, x1, x2, HALF: tl.constexpr, QUANTIZED: tl.constexpr,
                 FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """Head vectors (rows of the halves ``x1``, ``x2``; ``heads`` their indices) into one slot of the pool; FP8
    with a scale of each vector's own (`kv_cache.quantize_heads`)."""
    columns = heads[:, None] * 2 * HALF + tl.arange(0, HALF)[None, :]
    if QUANTIZED:
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(a1), axis=1), tl.max(tl.abs(a2), axis=1))
        scale = tl.maximum(amax / FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + heads * stride_scale_head, scale)
        kind = target.dtype.element_ty
        tl.store(target + columns, tl.clamp(a1 / scale[:, None], -FP8_MAX, FP8_MAX).to(kind))
        tl.store(target + HALF + columns, tl.clamp(a2 / scale[:, None], -FP8_MAX, FP8_MAX).to(kind))
    else:
        tl.store(target + columns, x1)
        tl.store(target + HALF + columns, x2)


@triton.jit
def _load_heads(row_ptr, row_scale_ptr, token, column_scale_ptr, heads, HALF: tl.constexpr, SCALED: tl.constexpr):
    """The two halves ``[heads, HALF]`` of a token's head vectors ``heads`` (a `ScaledProduct`'s, scales applied, if
    ``SCALED``)."""
    first = heads[:, None] * 2 * HALF + tl.arange(0, HALF)[None, :]
    second = first + HALF
    x1, x2 = tl.load(row_ptr + first), tl.load(row_ptr + second)
    if SCALED:
        row_scale = tl.load(row_scale_ptr + token)
        everywhere = first >= 0
        x1 = _scaled(x1, row_scale, column_scale_ptr, first, everywhere)
        x2 = _scaled(x2, row_scale, column_scale_ptr, second, everywhere)
    return x1, x2


@triton.jit
def _qk_norm_rope_store_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr,
                               positions_ptr, slots_ptr, key_pool_ptr, value_pool_ptr, key_scale_ptr,
                               value_scale_ptr, row_scale_ptr, q_column_scale_ptr, k_column_scale_ptr,
                               v_column_scale_ptr, eps, stride_qt, stride_kt, stride_vt, stride_ot, stride_pool,
                               stride_scale, stride_scale_head, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                               HALF: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, NORM: tl.constexpr,
                               QUANTIZED: tl.constexpr, SCALED: tl.constexpr, FP8_MAX: tl.constexpr,
                               MIN_SCALE: tl.constexpr):
    # program (token, group): a group is HEADS_PER_PROGRAM query heads, or as many KV heads (their keys and values)
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    half = tl.arange(0, HALF)
    position = tl.load(positions_ptr + token)
    cos1 = tl.load(cos_ptr + position * 2 * HALF + half)[None, :]
    cos2 = tl.load(cos_ptr + position * 2 * HALF + HALF + half)[None, :]
    sin1 = tl.load(sin_ptr + position * 2 * HALF + half)[None, :]
    sin2 = tl.load(sin_ptr + position * 2 * HALF + HALF + half)[None, :]
    if group < HEADS // HEADS_PER_PROGRAM:
        heads = group * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
        x1, x2 = _load_heads(q_ptr + token * stride_qt, row_scale_ptr, token, q_column_scale_ptr, heads, HALF,
                             SCALED)
        if NORM:
            x1, x2 = _head_norm(x1, x2, tl.load(q_weight_ptr + half), tl.load(q_weight_ptr + HALF + half), eps, HALF,
                                NORM)
        out = q_out_ptr + token * stride_ot + heads[:, None] * 2 * HALF + half[None, :]
        tl.store(out, _rope_half(x1, x2, cos1, sin1, x1.dtype, True))
        tl.store(out + HALF, _rope_half(x2, x1, cos2, sin2, x1.dtype, False))
    else:
        kv_heads = (group - HEADS // HEADS_PER_PROGRAM) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
        x1, x2 = _load_heads(k_ptr + token * stride_kt, row_scale_ptr, token, k_column_scale_ptr, kv_heads, HALF,
                             SCALED)
        if NORM:
            x1, x2 = _head_norm(x1, x2, tl.load(k_weight_ptr + half), tl.load(k_weight_ptr + HALF + half), eps, HALF,
                                NORM)
        slot = tl.load(slots_ptr + token)
        _store_heads(key_pool_ptr + slot * stride_pool, key_scale_ptr + slot * stride_scale, kv_heads,
                     stride_scale_head, _rope_half(x1, x2, cos1, sin1, x1.dtype, True),
                     _rope_half(x2, x1, cos2, sin2, x1.dtype, False), HALF, QUANTIZED, FP8_MAX, MIN_SCALE)
        v1, v2 = _load_heads(v_ptr + token * stride_vt, row_scale_ptr, token, v_column_scale_ptr, kv_heads, HALF,
                             SCALED)
        _store_heads(value_pool_ptr + slot * stride_pool, value_scale_ptr + slot * stride_scale, kv_heads,
                     stride_scale_head, v1, v2, HALF, QUANTIZED, FP8_MAX, MIN_SCALE)


def heads_per_program(heads: int, kv_heads: int, most: int = 8) -> int:
    """The largest power of two up to ``most`` that divides both head counts: `qk_norm_rope_store`'s programs each
    take that many query heads, or KV heads."""
    count = 1
    while count * 2 <= most and heads % (count * 2) == 0 and kv_heads % (count * 2) == 0:
        count *= 2
    return count


def qk_norm_rope_store(query: torch.Tensor | ScaledProduct, key: torch.Tensor | ScaledProduct,
                       value: torch.Tensor | ScaledProduct, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       positions: torch.Tensor, slots: torch.Tensor, cache: LayerKV, most_heads_per_program: int = 8,
                       num_warps: int | None = None) -> torch.Tensor:
    """``query [T, Hq*D]``, ``key``/``value [T, Hkv*D]`` (the projections' outputs, or all three FP8 products'
    `ScaledProduct`s with one row scale): the rotated queries ``[T, Hq, D]``; the rotated keys and the values go
    to the layer's pool ``cache`` (``[slots, Hkv, D]``, FP8 with a scale per head vector if the pool is) at
    ``slots [T]``. ``cos``/``sin`` are the ``[positions, D]`` tables; per-head RMSNorm with
    ``q_weight``/``k_weight`` if given.

    Each program takes several heads of one token (`heads_per_program`, at most ``most_heads_per_program``): one
    head a program (``most_heads_per_program=1``, the kernel before) made 10,240 one-warp programs for a 4B
    decode step, latency-bound (`benchmarks.fp8_pointwise_gpu`)."""
    scaled = isinstance(query, ScaledProduct)
    if scaled:
        row_scales, column_scales = query.row_scales, (query.column_scales, key.column_scales, value.column_scales)
        query, key, value = query.product, key.product, value.product
    else:
        row_scales, column_scales = query, (query, query, query)  # unread
    key_pool, value_pool = cache.keys, cache.values
    tokens = query.shape[0]
    kv_heads, dim = key_pool.shape[1], key_pool.shape[2]
    heads = query.shape[1] // dim
    group = heads_per_program(heads, kv_heads, most_heads_per_program)
    q_out = torch.empty((tokens, heads, dim), dtype=query.dtype, device=query.device)
    norm = q_weight is not None
    key_scales = cache.key_scales if cache.quantized else key_pool  # unread when not quantized
    value_scales = cache.value_scales if cache.quantized else value_pool
    if tokens:
        _qk_norm_rope_store_kernel[(tokens, (heads + kv_heads) // group)](
            query, key, value, q_out, q_weight if norm else query, k_weight if norm else query, cos, sin, positions,
            slots, key_pool, value_pool, key_scales, value_scales, row_scales, *column_scales, eps, query.stride(0),
            key.stride(0), value.stride(0), q_out.stride(0), key_pool.stride(0), key_scales.stride(0),
            key_scales.stride(1) if cache.quantized else 0, HEADS=heads, KV_HEADS=kv_heads, HALF=dim // 2,
            HEADS_PER_PROGRAM=group, NORM=norm, QUANTIZED=cache.quantized, SCALED=scaled, FP8_MAX=FP8_MAX,
            MIN_SCALE=_MIN_SCALE, num_warps=num_warps or max(1, min(4, group // 2)))
    return q_out


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, row_scale_ptr, gate_column_scale_ptr, up_column_scale_ptr,
                     partial_max_ptr, width, gate_stride, up_stride, BLOCK: tl.constexpr, SCALED: tl.constexpr,
                     PARTIAL_MAX: tl.constexpr):
    # program (row, chunk): BLOCK columns of one row; with PARTIAL_MAX also the chunk's largest magnitude
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    columns = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = columns < width
    gate = tl.load(gate_ptr + row * gate_stride + columns, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * up_stride + columns, mask=mask, other=0.0)
    if SCALED:
        row_scale = tl.load(row_scale_ptr + row)
        gate = _scaled(gate, row_scale, gate_column_scale_ptr, columns, mask)
        up = _scaled(up, row_scale, up_column_scale_ptr, columns, mask)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * width + columns, out, mask=mask)
    if PARTIAL_MAX:
        tl.store(partial_max_ptr + row * tl.num_programs(1) + chunk, tl.max(tl.abs(out.to(tl.float32)), axis=0))


def _silu_mul(gate: torch.Tensor | ScaledProduct, up: torch.Tensor | ScaledProduct, block: int, num_warps: int,
              partial_maxima: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    scaled = isinstance(gate, ScaledProduct)
    if scaled:
        row_scales, column_scales = gate.row_scales, (gate.column_scales, up.column_scales)
        gate, up = gate.product, up.product
    gate, up = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
    if not scaled:
        row_scales, column_scales = gate, (gate, gate)  # unread
    rows, width = gate.shape
    out = torch.empty((rows, width), dtype=gate.dtype, device=gate.device)
    chunks = triton.cdiv(width, block)
    maxima = torch.empty((rows, chunks), dtype=torch.float32, device=gate.device) if partial_maxima else None
    if rows:
        _silu_mul_kernel[(rows, chunks)](gate, up, out, row_scales, *column_scales,
                                         maxima if partial_maxima else out, width, gate.stride(0), up.stride(0),
                                         BLOCK=block, SCALED=scaled, PARTIAL_MAX=partial_maxima, num_warps=num_warps)
    return out, maxima


def silu_mul(gate: torch.Tensor | ScaledProduct, up: torch.Tensor | ScaledProduct, block: int = 1024,
             num_warps: int = 4) -> torch.Tensor:
    """``silu(gate) * up`` for ``[T, I]`` operands whose rows may be strided (the two halves of one merged
    gate/up product, `merged_projections`, or of one FP8 product as `ScaledProduct`s, their scales applied as
    they are read); a contiguous ``[T, I]`` result, in programs of ``block`` columns of a row."""
    return _silu_mul(gate, up, block, num_warps, partial_maxima=False)[0]


@triton.jit
def _quantize_chunks_fp8_kernel(x_ptr, partial_max_ptr, out_ptr, scale_ptr, width, CHUNKS: tl.constexpr,
                                CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
                                INV_FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    # program (row, chunk): the row's scale from its chunks' largest magnitudes, then BLOCK of its columns
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    chunks = tl.arange(0, CHUNKS_PAD)
    largest = tl.max(tl.load(partial_max_ptr + row * CHUNKS + chunks, mask=chunks < CHUNKS, other=0.0), axis=0)
    columns = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = columns < width
    value = tl.load(x_ptr + row * width + columns, mask=mask, other=0.0).to(tl.float32)
    quantized, scale = _quantize_with(value, largest, FP8_MAX, INV_FP8_MAX, MIN_SCALE)
    tl.store(out_ptr + row * width + columns, quantized.to(out_ptr.dtype.element_ty), mask=mask)
    if chunk == 0:
        tl.store(scale_ptr + row, scale)


def silu_mul_quantized(gate: ScaledProduct, up: ScaledProduct, block: int = 1024) -> Fp8Rows:
    """`silu_mul` of the FP8 gate/up product's halves, quantised per row for the down projection: `quantize_rows`'
    result bit for bit, in two kernels whose programs each take ``block`` columns of a row. The SiLU-mul kernel
    writes each block's largest magnitude beside the product; the quantisation kernel takes the row's scale from
    those. One program a row instead (`quantize_rows_fp8`) is latency-bound on wide rows: the 4B shape's 9,728
    columns took 7.3 us at 256 rows and 180 us at 8,192 on an H100, and fusing it into SiLU-mul averaged 72 us a
    call over a generate call (`benchmarks.fp8_pointwise_gpu`)."""
    activated, maxima = _silu_mul(gate, up, block, 4, partial_maxima=True)
    rows, width = activated.shape
    out = Fp8Rows(torch.empty((rows, width), dtype=FP8, device=activated.device),
                  torch.empty((rows, 1), dtype=torch.float32, device=activated.device))
    if rows:
        chunks = maxima.shape[1]
        _quantize_chunks_fp8_kernel[(rows, chunks)](activated, maxima, out.values, out.scales, width, CHUNKS=chunks,
                                                    CHUNKS_PAD=triton.next_power_of_2(chunks), BLOCK=block,
                                                    FP8_MAX=FP8_MAX, INV_FP8_MAX=1.0 / FP8_MAX,
                                                    MIN_SCALE=_MIN_SCALE, num_warps=4)
    return out


@triton.jit
def _quantize_rows_fp8_kernel(x_ptr, out_ptr, scale_ptr, stride, out_stride, COLUMNS: tl.constexpr,
                              BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr,
                              MIN_SCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < COLUMNS
    value = tl.load(x_ptr + row * stride + offsets, mask=mask, other=0.0).to(tl.float32)
    quantized, scale = _quantize_row(value, FP8_MAX, INV_FP8_MAX, MIN_SCALE)
    tl.store(out_ptr + row * out_stride + offsets, quantized.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows_fp8(x: torch.Tensor, fp8_max: float, min_scale: float,
                      num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H]`` (rows contiguous) as e4m3 ``[T, H]`` and float32 scales ``[T, 1]``, one kernel. Rows of more
    than 8,192 entries get 32 warps a program (the 4B shape's 9,728: 1.2x faster than 8 at 256 rows on an H100, as
    fast at 8,192; `benchmarks.fp8_pointwise_gpu`)."""
    rows, columns = x.shape
    out = torch.empty((rows, columns), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(columns)
        _quantize_rows_fp8_kernel[(rows,)](x, out, scales, x.stride(0), out.stride(0), COLUMNS=columns, BLOCK=block,
                                           FP8_MAX=fp8_max, INV_FP8_MAX=1.0 / fp8_max, MIN_SCALE=min_scale,
                                           num_warps=num_warps or (4 if block < 4096 else 8 if block <= 8192 else 32))
    return out, scales


@triton.jit
def _dequantize_rows(pool_ptr, scale_ptr, out_ptr, source, target, scale_offsets, mask, head_mask):
    scale = tl.load(scale_ptr + scale_offsets, mask=head_mask, other=0.0)
    value = tl.load(pool_ptr + source, mask=mask, other=0.0).to(tl.float32) * scale[:, None]
    tl.store(out_ptr + target, value.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_dequantized_kernel(key_pool_ptr, value_pool_ptr, key_scale_ptr, value_scale_ptr, slots_ptr, key_out_ptr,
                               value_out_ptr, stride_pool, stride_head, stride_scale, stride_scale_head,
                               KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, DIM: tl.constexpr,
                               DIM_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    heads, dims = tl.arange(0, HEADS_PAD), tl.arange(0, DIM_PAD)
    head_mask = heads < KV_HEADS
    mask = head_mask[:, None] & (dims[None, :] < DIM)
    source = slot * stride_pool + heads[:, None] * stride_head + dims[None, :]
    target = row * KV_HEADS * DIM + heads[:, None] * DIM + dims[None, :]
    scale_offsets = slot * stride_scale + heads * stride_scale_head
    _dequantize_rows(key_pool_ptr, key_scale_ptr, key_out_ptr, source, target, scale_offsets, mask, head_mask)
    _dequantize_rows(value_pool_ptr, value_scale_ptr, value_out_ptr, source, target, scale_offsets, mask, head_mask)


def gather_dequantized(cache: LayerKV, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`LayerKV.gather` of an FP8 pool in one kernel: the K/V at ``slots`` (any shape ``S``) as ``[*S, Hkv, D]``
    in ``dtype``, each vector times its scale (torch's arithmetic: the float32 product, rounded once). Torch
    operations took ten kernels (gathers, widenings, products, narrowings) for a prefill's keys and values."""
    keys, values = cache.keys, cache.values
    kv_heads, dim = keys.shape[1], keys.shape[2]
    flat = slots.reshape(-1)
    key_out = torch.empty((flat.shape[0], kv_heads, dim), dtype=dtype, device=keys.device)
    value_out = torch.empty_like(key_out)
    if flat.shape[0]:
        _gather_dequantized_kernel[(flat.shape[0],)](
            keys, values, cache.key_scales, cache.value_scales, flat, key_out, value_out, keys.stride(0),
            keys.stride(1), cache.key_scales.stride(0), cache.key_scales.stride(1), KV_HEADS=kv_heads,
            HEADS_PAD=triton.next_power_of_2(kv_heads), DIM=dim, DIM_PAD=triton.next_power_of_2(dim), num_warps=4)
    shape = (*slots.shape, kv_heads, dim)
    return key_out.view(shape), value_out.view(shape)
