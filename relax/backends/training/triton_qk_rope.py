"""Qwen3's per-head query/key RMSNorm and the rotary embedding after it in one pass each way (Triton, CUDA).

Rows are heads of tokens (``[T, H, D]`` flattened to ``T * H`` rows of ``D``); a program walks blocks of rows.

- `_forward_kernel`: ``n = round(round(x * rstd) * w)`` (the separate norm's float32 math and its two roundings
  to the input's dtype, `compiled_norm.rms_norm_reference`), then ``out = n * cos + rotate_half(n) * sin`` in float32,
  rounded once; the rows' ``rstd`` kept for the backward.
- `_backward_kernel`: the rotation's transpose applied to the incoming gradient (``dn``), the norm's input gradient
  ``rstd * (dn * w - xhat * mean(dn * w * xhat))``, and each program's share of the weight gradient
  ``sum(dn * round(xhat))`` over its rows, which the host sums over programs (a few hundred rows of ``D``).
  The roundings pass the gradient through, as autograd treats the separate kernels' casts.

`benchmarks/train_gpu.py`'s ``fused_qk_speedup`` measures it against the separate kernels in the trainer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 32


@triton.jit
def _forward_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, rstd_ptr, rows, heads, eps,
                    HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    columns = tl.arange(0, HALF)
    w1 = tl.load(w_ptr + columns).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + columns).to(tl.float32)
    for block in tl.range(tl.program_id(0), tl.cdiv(rows, BLOCK_ROWS), tl.num_programs(0)):
        row = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        in_rows = row < rows
        mask = in_rows[:, None]
        at = row.to(tl.int64)[:, None] * (2 * HALF) + columns[None, :]
        x1 = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + at + HALF, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        n1 = ((x1 * rstd[:, None]).to(dtype).to(tl.float32) * w1[None, :]).to(dtype).to(tl.float32)
        n2 = ((x2 * rstd[:, None]).to(dtype).to(tl.float32) * w2[None, :]).to(dtype).to(tl.float32)
        angle = (row // heads).to(tl.int64)[:, None] * (2 * HALF) + columns[None, :]
        cos1 = tl.load(cos_ptr + angle, mask=mask, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + angle + HALF, mask=mask, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + angle, mask=mask, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + angle + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, (n1 * cos1 - n2 * sin1).to(dtype), mask=mask)
        tl.store(out_ptr + at + HALF, (n2 * cos2 + n1 * sin2).to(dtype), mask=mask)
        tl.store(rstd_ptr + row, rstd, mask=in_rows)


@triton.jit
def _backward_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, rstd_ptr, grad_out_ptr, grad_x_ptr, grad_w_ptr, rows, heads,
                     HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    dtype = x_ptr.dtype.element_ty
    columns = tl.arange(0, HALF)
    w1 = tl.load(w_ptr + columns).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + columns).to(tl.float32)
    grad_w1 = tl.zeros((HALF,), tl.float32)
    grad_w2 = tl.zeros((HALF,), tl.float32)
    for block in tl.range(tl.program_id(0), tl.cdiv(rows, BLOCK_ROWS), tl.num_programs(0)):
        row = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        in_rows = row < rows
        mask = in_rows[:, None]
        at = row.to(tl.int64)[:, None] * (2 * HALF) + columns[None, :]
        angle = (row // heads).to(tl.int64)[:, None] * (2 * HALF) + columns[None, :]
        g1 = tl.load(grad_out_ptr + at, mask=mask, other=0.0).to(tl.float32)
        g2 = tl.load(grad_out_ptr + at + HALF, mask=mask, other=0.0).to(tl.float32)
        cos1 = tl.load(cos_ptr + angle, mask=mask, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + angle + HALF, mask=mask, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + angle, mask=mask, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + angle + HALF, mask=mask, other=0.0).to(tl.float32)
        # out1 = n1 cos1 - n2 sin1, out2 = n2 cos2 + n1 sin2
        dn1 = g1 * cos1 + g2 * sin2
        dn2 = g2 * cos2 - g1 * sin1
        rstd = tl.load(rstd_ptr + row, mask=in_rows, other=0.0)
        xhat1 = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
        xhat2 = tl.load(x_ptr + at + HALF, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
        grad_w1 += tl.sum(dn1 * xhat1.to(dtype).to(tl.float32), axis=0)
        grad_w2 += tl.sum(dn2 * xhat2.to(dtype).to(tl.float32), axis=0)
        dxhat1, dxhat2 = dn1 * w1[None, :], dn2 * w2[None, :]
        mean = (tl.sum(dxhat1 * xhat1, axis=1) + tl.sum(dxhat2 * xhat2, axis=1)) / (2 * HALF)
        tl.store(grad_x_ptr + at, (rstd[:, None] * (dxhat1 - xhat1 * mean[:, None])).to(dtype), mask=mask)
        tl.store(grad_x_ptr + at + HALF, (rstd[:, None] * (dxhat2 - xhat2 * mean[:, None])).to(dtype), mask=mask)
    partial = grad_w_ptr + tl.program_id(0) * (2 * HALF)
    tl.store(partial + columns, grad_w1)
    tl.store(partial + HALF + columns, grad_w2)


def _programs(rows: int, device: torch.device) -> int:
    # a few programs per multiprocessor, each walking its share of the blocks (the weight gradient's partial sums
    # stay one row a program)
    # (off CUDA: Triton's interpreter, where the kernels are checked on CPU tensors)
    processors = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return max(1, min(triton.cdiv(rows, BLOCK_ROWS), 4 * processors))


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    return x.contiguous(), x.numel() // x.shape[-1], x.shape[-2]


def forward(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [1, T, H, D]``, ``cos``/``sin`` ``[1, T, D]`` (contiguous): the normalised, rotated heads and each row's
    ``rstd`` (float32)."""
    x, rows, heads = _rows(x)
    out = torch.empty_like(x)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    _forward_kernel[(_programs(rows, x.device),)](x, weight, cos, sin, out, rstd, rows, heads, eps,
                                                  HALF=x.shape[-1] // 2, BLOCK_ROWS=BLOCK_ROWS)
    return out, rstd


def backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `forward`'s output with respect to ``x`` and the weight (the weight's dtype)."""
    x, rows, heads = _rows(x)
    grad_x = torch.empty_like(x)
    programs = _programs(rows, x.device)
    partial = torch.empty(programs, x.shape[-1], device=x.device, dtype=torch.float32)
    _backward_kernel[(programs,)](x, weight, cos, sin, rstd, grad_out.contiguous(), grad_x, partial, rows, heads,
                                  HALF=x.shape[-1] // 2, BLOCK_ROWS=BLOCK_ROWS)
    return grad_x, partial.sum(0).to(weight.dtype)


class QKNormRope(torch.autograd.Function):
    """Queries and keys through `forward`, both saved as they came in (as the separate norm saves them)."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, cos, sin, eps: float):
        cos, sin = cos.contiguous(), sin.contiguous()
        q_out, q_rstd = forward(q, q_weight, cos, sin, eps)
        k_out, k_rstd = forward(k, k_weight, cos, sin, eps)
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin, q_rstd, k_rstd)
        return q_out, k_out

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        q, k, q_weight, k_weight, cos, sin, q_rstd, k_rstd = ctx.saved_tensors
        dq, dq_weight = backward(grad_q, q, q_weight, cos, sin, q_rstd)
        dk, dk_weight = backward(grad_k, k, k_weight, cos, sin, k_rstd)
        return dq, dk, dq_weight, dk_weight, None, None, None
