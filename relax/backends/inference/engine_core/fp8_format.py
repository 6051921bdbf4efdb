"""The FP8 format the engine core stores in (e4m3), its two constants and its row-wise quantisation: what the FP8
projections (`fp8`), the FP8 KV pool (`kv_cache`) and their Triton kernels (`triton_ops`) share."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# A row of zeros would give a zero scale (0 / 0 when dividing); the floor (float32's smallest normal) keeps its
# quantised values 0 and leaves any other row its own scale, so no row's values fall among FP8's subnormals.
MIN_SCALE = torch.finfo(torch.float32).tiny


def quantize_rows(matrix: torch.Tensor, out: torch.Tensor | None = None,
                  scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``matrix [R, C]`` as FP8 with one float32 scale per row (``matrix ~ fp8 * scale``); into ``out`` and
    ``scales`` when given (in place, for buffers that CUDA graphs read)."""
    amax = matrix.detach().abs().amax(dim=1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp_min(MIN_SCALE)
    quantized = (matrix.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if out is None:
        return quantized, scale
    out.copy_(quantized)
    scales.copy_(scale)
    return out, scales
