"""The FP8 format the engine core stores in (e4m3), its two constants, its row-wise quantisation and the two forms
an FP8 activation takes between kernels: what the FP8 projections (`fp8`), the FP8 KV pool (`kv_cache`) and their
Triton kernels (`triton_ops`) share."""

from __future__ import annotations

from typing import NamedTuple

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


class Fp8Rows(NamedTuple):
    """Rows quantised for a product: ``values [T, H]`` e4m3 with one float32 scale per row, ``scales [T, 1]``
    (``rows ~ values * scales``)."""

    values: torch.Tensor
    scales: torch.Tensor


class ScaledProduct(NamedTuple):
    """The product of `Fp8Rows` with FP8 weights, multiplied with unit scales: its value is
    ``product * row_scales * column_scales`` (``product [T, N]`` in the model's dtype, ``row_scales [T, 1]`` the
    activations' scales, ``column_scales [N]`` the weights' per output channel). The kernel that reads the product
    applies the scales as it loads it (`triton_ops`), so the GEMM can run with one scale per tensor, which is
    faster than with row-wise ones at decode batch sizes (docs/engines.md)."""

    product: torch.Tensor
    row_scales: torch.Tensor
    column_scales: torch.Tensor

    def split(self, widths: list[int]) -> list[ScaledProduct]:
        """The products of the stacked projections (``widths`` columns each), as views."""
        return [ScaledProduct(product, self.row_scales, columns) for product, columns in
                zip(self.product.split(widths, dim=-1), self.column_scales.split(widths))]

    def value(self) -> torch.Tensor:
        """The product with its scales applied, in float32 (what the kernels compute before rounding; the tests'
        and benchmarks' reference)."""
        return self.product.float() * self.row_scales * self.column_scales
