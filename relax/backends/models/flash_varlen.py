"""PyTorch's FlashAttention-2 varlen kernel (`torch.nn.attention.varlen`), as the trainer's packed attention and
the engine's prefill call it: packed ``[T, H, D]`` queries and keys of several sequences told apart by
cumulative lengths, causal, no padding and no mask tensor. CUDA, bf16/fp16 only."""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch


@lru_cache(maxsize=1)
def _varlen_kernel():
    """``(varlen_attn, causal keyword arguments, takes enable_gqa)`` of this PyTorch, or None where it has none.
    The signature changed between releases: 2.10 took ``is_causal``, later ones ``window_size``."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in parameters


def available() -> bool:
    return _varlen_kernel() is not None


def causal_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            cu_seqlens_k: torch.Tensor, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """``q [Tq, Hq, D]``, ``k``/``v [Tk, Hkv, D]`` -> ``[Tq, Hq, D]``. Sequence ``i`` has queries
    ``cu_seqlens_q[i]..`` and keys ``cu_seqlens_k[i]..``; when it has more keys than queries (a cached prefix),
    its queries are the last positions (the causal mask is aligned bottom-right, as FlashAttention-2 does)."""
    varlen_attn, causal, takes_gqa = _varlen_kernel()
    extra = dict(causal)
    if takes_gqa:
        extra["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:
        return _flash_gqa(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale)
    return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale=scale, **extra)


def _flash_gqa(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """Grouped-query attention where `varlen_attn` takes no ``enable_gqa`` (PyTorch 2.11): the FlashAttention-2
    kernel underneath reads each KV head for its group of query heads by itself (and sums their key and value
    gradients in its backward), so the keys and values are passed as they are. Repeating them to the query heads
    first, as before, cost two copies in the forward and two reductions in the backward per layer (the 0.6B
    trainer's H200 profile; `benchmarks/train_kernels_gpu.py` times both)."""
    out, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, 0.0, True,
                                                       False, scale=scale)
    return out


def repeat_kv_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """The path before `_flash_gqa`: the keys and values repeated to the query heads (the benchmark's baseline)."""
    varlen_attn, causal, _ = _varlen_kernel()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale=scale, **causal)
