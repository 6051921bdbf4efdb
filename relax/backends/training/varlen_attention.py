"""Attention over packed sequences for the Hugging Face models the trainer runs.

Registered with transformers as the attention implementation ``relax_packed``: a forward that
carries a `PackedAttention` (keyword ``relax_packed``, which the HF layers pass through to their
attention call, also when gradient checkpointing recomputes them) attends within each sequence of
the packed row; any other forward is plain SDPA with the model's mask. The sequences of a packed row
never see each other, and no score is computed across them:

- on CUDA in bf16/fp16, PyTorch's FlashAttention-2 varlen kernel (`torch.nn.attention.varlen`), which
  takes ``cu_seqlens`` directly and costs sum(L_i^2), not N^2;
- elsewhere (CPU, float32), one causal SDPA call per sequence: exact, and cheap at the sizes a CPU
  trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from relax.backends.models import flash_varlen
from relax.backends.models.flash_varlen import causal_varlen_attention, repeat_kv_attention
from relax.backends.training.context_parallel import ContextSlice, ulysses_attention
from relax.backends.training.packing import to_device

IMPLEMENTATION = "relax_packed"
PACKING_KWARG = "relax_packed"


@dataclass(frozen=True)
class PackedAttention:
    """Where the sequences of a packed row start and end (``cu_seqlens`` int32 ``[S + 1]`` on the
    device) and the longest one."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    boundaries: tuple[int, ...]  # cu_seqlens on the host, for the per-sequence fallback
    context: ContextSlice | None = None  # context parallel: this rank holds a slice of the row's tokens
    repeat_kv: bool = False  # keys and values repeated to the query heads first (the path before; a benchmark's)

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, max_seqlen: int, device: torch.device,
           context: ContextSlice | None = None, repeat_kv: bool = False) -> PackedAttention:
        host = cu_seqlens.to(dtype=torch.int32)
        return cls(to_device(host, device), int(max_seqlen), tuple(host.tolist()), context, repeat_kv)


def _half_dtype(value: torch.Tensor) -> torch.dtype | None:
    if value.dtype in (torch.bfloat16, torch.float16):
        return value.dtype
    if value.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None


def _flash_attend(q, k, v, packing: PackedAttention, scale: float, dtype: torch.dtype) -> torch.Tensor:
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    # The flash kernels take one head size; multi-head latent attention (DeepSeek-V3, Kimi K2) has values narrower
    # than queries and keys. Zero columns change no dot product (the scale is explicit) and are cut off after.
    head, value_head = q.shape[-1], v.shape[-1]
    if value_head < head:
        v = F.pad(v, (0, head - value_head))
    elif value_head > head:
        q, k = F.pad(q, (0, value_head - head)), F.pad(k, (0, value_head - head))
    attention = repeat_kv_attention if packing.repeat_kv and k.shape[1] != q.shape[1] else causal_varlen_attention
    out = attention(q, k, v, packing.cu_seqlens, packing.cu_seqlens, packing.max_seqlen, packing.max_seqlen, scale)
    return out[..., :value_head]


def _per_sequence_attend(q, k, v, packing: PackedAttention, scale: float, dropout: float) -> torch.Tensor:
    """``[N, H, D]`` inputs; SDPA sequence by sequence (``[H, L, D]`` each, causal)."""
    enable_gqa = k.shape[1] != q.shape[1]
    outputs = []
    for start, end in zip(packing.boundaries[:-1], packing.boundaries[1:]):
        outputs.append(F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1),
            is_causal=True, scale=scale, dropout_p=dropout, enable_gqa=enable_gqa,
        ).transpose(0, 1))
    return torch.cat(outputs)


def packed_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             sliding_window=None, **kwargs):
    """The transformers attention-interface function: ``[1, H, N, D]`` in, ``([1, N, H, D], None)`` out."""
    packing: PackedAttention | None = kwargs.pop(PACKING_KWARG, None)
    if packing is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      sliding_window=sliding_window, **kwargs)
    if sliding_window is not None:
        raise NotImplementedError("sequence packing does not support sliding-window attention yet; "
                                  "train this model with --no-sequence-packing")
    if query.shape[0] != 1:
        raise ValueError(f"a packed forward has one row, got {query.shape[0]}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # squeeze, not t[0]: indexing's backward builds a zero tensor of the whole input and copies the gradient into
    # it, a strided copy of every query, key and value gradient per layer and micro-batch (and RoPE's backward
    # then copied the keys' and queries' back); squeeze's backward is a view. On an H200 the 0.6B GRPO step's
    # training phase went from 1.89 to 1.73 s (benchmarks/results/grpo_step_packed_views_gpu.json).
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))  # [N, H, D]
    dtype = _half_dtype(value)

    def attend(q, k, v):
        if q.is_cuda and dtype is not None and flash_varlen.available() and not dropout:
            return _flash_attend(q, k, v, packing, scale, dtype)
        return _per_sequence_attend(q, k, v, packing, scale, dropout if module.training else 0.0)

    out = attend(q, k, v) if packing.context is None else ulysses_attention(q, k, v, packing.context, attend)
    return out.unsqueeze(0), None


def packed_attention_mask(*args, attention_mask=None, **kwargs):
    """The mask-interface function: a packed forward passes no mask (the sequences are kept apart by
    ``cu_seqlens``); a padded one gets SDPA's mask."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


@lru_cache(maxsize=1)
def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, packed_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, packed_attention_mask)
    return IMPLEMENTATION


def use_packed_attention(decoder: torch.nn.Module) -> None:
    """Route the attention of ``decoder`` (the language model; a vision or audio tower keeps its own)
    through `packed_attention_forward`."""
    decoder.config._attn_implementation = register()
