"""The FP8 format the engine core stores in (e4m3) and its two constants: what the FP8 projections
(`fp8`), the FP8 KV pool (`kv_cache`) and their Triton kernels (`triton_ops`) share."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# A row of zeros would give a zero scale (0 / 0 when dividing); the floor (float32's smallest normal) keeps its
# quantised values 0 and leaves any other row its own scale, so no row's values fall among FP8's subnormals.
MIN_SCALE = torch.finfo(torch.float32).tiny
