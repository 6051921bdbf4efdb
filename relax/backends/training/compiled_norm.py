"""The trainer's RMSNorms as kernels that `torch.compile` (Inductor) generates, forward and backward.

liger-kernel's RMSNorm backward runs one program per streaming multiprocessor, each walking its share of the rows
one row (or 16 short rows) at a time, and zero-fills the input gradient before it: on the H200 profile of the
Qwen3-0.6B shape's step (32k-token micro-batches; rows of 1,024 for the layer norms, of 128 for the per-head query
and key norms) its backward took 9.5% of the step's kernel time, several times what reading and writing those rows
costs (`benchmarks/train_kernels_gpu.py` measures both on the card). Inductor fuses the same math into a few
reductions that spread the rows over the whole card and split the weight gradient's sum over rows into blocks.

The math is liger's "llama" casting, which the trainer used before: the row normalised in float32, cast to the
input's dtype, times the weight, and the product stored in the input's dtype. Compiled once per process and row
width for any number of rows: packed micro-batches change their token count at every step.
"""

from __future__ import annotations

from functools import lru_cache

import torch


def rms_norm_reference(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` with the normalisation in float32 and the result in ``x``'s dtype."""
    normed = hidden.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return (normed.to(hidden.dtype) * weight).to(hidden.dtype)


@lru_cache(maxsize=1)
def _compiled():
    # Not fullgraph: past dynamo's recompile limit (8 row widths and dtypes in one process; a model has two or
    # three) a call runs the same function eagerly instead of failing.
    return torch.compile(rms_norm_reference)


def compiled_rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_reference` through Inductor on the rows of ``hidden`` (flattened: the layer norms' ``[1, N, D]``
    and the head norms' ``[1, N, H, D]`` alike). The number of rows is symbolic, so one graph per row width serves
    every micro-batch; the width stays a constant, for which Inductor emits a one-pass (persistent) reduction."""
    shape = hidden.shape
    rows = hidden.reshape(-1, shape[-1])
    if rows.shape[0] > 1:  # a dimension of one is specialised, never symbolic
        torch._dynamo.maybe_mark_dynamic(rows, 0)
    return _compiled()(rows, weight, eps).view(shape)


def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """An RMSNorm module's forward through `compiled_rms_norm` (`liger.apply_liger_kernels` puts it on the
    instances it patches)."""
    return compiled_rms_norm(hidden_states, self.weight, self.variance_epsilon)
