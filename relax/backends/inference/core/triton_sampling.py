"""Per-row sampling noise on CUDA in one kernel: Exp(1) draws keyed by each row's 63-bit key (`CounterNoise`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _exponential_noise_kernel(keys_ptr, out_ptr, vocab, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(keys_ptr + row)
    uniform = tl.rand(key, offsets)  # Philox keyed by the row, counter = vocabulary index: [0, 1)
    tl.store(out_ptr + row * stride + offsets, -tl.log(1.0 - uniform), mask=offsets < vocab)


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, vocab]`` float32 Exp(1) noise, row ``b`` a function of ``keys[b]`` only."""
    out = torch.empty((keys.shape[0], vocab), dtype=torch.float32, device=keys.device)
    grid = (keys.shape[0], triton.cdiv(vocab, BLOCK))
    _exponential_noise_kernel[grid](keys.contiguous(), out, vocab, out.stride(0), BLOCK=BLOCK)
    return out
