"""Attention over packed sequences for the Hugging Face models the trainer runs.

Registered with transformers as the attention implementation ``relax_packed``: a forward that
carries a `PackedAttention` (keyword ``relax_packed``, which the HF layers pass through to their
attention call, also when gradient checkpointing recomputes them) attends within each sequence of
the packed row; any other forward is plain SDPA with the model's mask. The sequences of a packed row
never see each other, and no score is computed across them:

- on CUDA in bf16/fp16, PyTorch's FlashAttention-2 varlen kernel (`torch.nn.attention.varlen`), which
  takes ``cu_seqlens`` directly and costs sum(L_i^2), not N^2;
- elsewhere (CPU, float32), batched causal SDPA over the sequences padded to a common length, in buckets of
  similar lengths (`length_buckets`) so padding never more than doubles the scores computed. One call per
  sequence (`_per_sequence_attend`, the path before and the tests' reference) spent its time in per-call
  overhead: on the CPU quickstart's micro-batches (128 sequences of 14-22 tokens) a layer's attention forward
  and backward took 10.8x as long (`benchmarks/packed_attention_cpu.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise
from typing import NamedTuple

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
    boundaries: tuple[int, ...]  # cu_seqlens on the host, for the padded fallback
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
    """``[N, H, D]`` inputs; SDPA sequence by sequence (``[H, L, D]`` each, causal): exact, one call per sequence.
    The reference `_padded_attend` is checked against, and its benchmark's baseline."""
    enable_gqa = k.shape[1] != q.shape[1]
    outputs = []
    for start, end in zip(packing.boundaries[:-1], packing.boundaries[1:]):
        outputs.append(F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1),
            is_causal=True, scale=scale, dropout_p=dropout, enable_gqa=enable_gqa,
        ).transpose(0, 1))
    return torch.cat(outputs)


# A bucket pads its sequences to its longest one: at most this many times the scores (sum of L^2) its sequences
# need. Similar lengths share one call; one long sequence among short ones gets a call of its own.
PADDING_WASTE = 2.0


def length_buckets(lengths: list[int] | tuple[int, ...]) -> list[list[int]]:
    """The sequences (indices into ``lengths``) grouped for padded attention, longest first: a sequence joins the
    current bucket while the bucket padded to its longest sequence computes at most `PADDING_WASTE` times the
    scores of its sequences."""
    buckets: list[list[int]] = []
    longest = needed = 0
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        if buckets and (len(buckets[-1]) + 1) * longest ** 2 <= PADDING_WASTE * (needed + length ** 2):
            buckets[-1].append(index)
            needed += length ** 2
        else:
            buckets.append([index])
            longest, needed = length, length ** 2
    return buckets


class _PaddedBucket(NamedTuple):
    sequences: int
    length: int
    slot_tokens: torch.Tensor  # [sequences * length]: the packed token each padded slot holds (a pad: any token)
    token_slots: torch.Tensor  # the slot of each of the bucket's tokens, in `packed_order`'s order
    mask: torch.Tensor | None  # [sequences, 1, length, length] bool: causal, and only the sequence's own keys;
    # None for a bucket of one sequence (SDPA's own causal masking: no length x length mask for a long sequence)


class _PaddedLayout(NamedTuple):
    buckets: tuple[_PaddedBucket, ...]
    packed_order: torch.Tensor  # where the buckets' outputs, concatenated, go back to in the packed row


@lru_cache(maxsize=2)  # a micro-batch's layers (and their recomputation) share one layout
def _padded_layout(boundaries: tuple[int, ...], device: torch.device) -> _PaddedLayout:
    starts, lengths = boundaries[:-1], [end - start for start, end in pairwise(boundaries)]
    buckets, taken = [], []
    for members in length_buckets(lengths):
        members = [index for index in members if lengths[index]]  # an empty sequence has no token to attend
        if not members:
            continue
        longest = lengths[members[0]]
        slot_tokens = torch.full((len(members), longest), starts[members[0]], dtype=torch.long)
        token_slots = []
        for row, index in enumerate(members):
            length = lengths[index]
            slot_tokens[row, :length] = torch.arange(starts[index], starts[index] + length)
            token_slots.append(torch.arange(row * longest, row * longest + length))
            taken.append(slot_tokens[row, :length])
        mask = None
        if len(members) > 1:
            positions = torch.arange(longest)
            own_keys = positions < torch.tensor([lengths[index] for index in members])[:, None]  # [S, L]
            mask = ((positions[None, :] <= positions[:, None])[None] & own_keys[:, None, :])[:, None].to(device)
        buckets.append(_PaddedBucket(len(members), longest, slot_tokens.flatten().to(device),
                                     torch.cat(token_slots).to(device), mask))
    packed_order = torch.argsort(torch.cat(taken)) if taken else torch.zeros(0, dtype=torch.long)
    return _PaddedLayout(tuple(buckets), packed_order.to(device))


def _padded_attend(q, k, v, packing: PackedAttention, scale: float, dropout: float) -> torch.Tensor:
    """``[N, H, D]`` inputs; causal SDPA per `length_buckets` bucket, its sequences padded to ``[S, H, L, D]`` and
    kept apart by the mask. A padded query's output is dropped; a padded key is masked out."""
    layout = _padded_layout(packing.boundaries, q.device)
    enable_gqa = k.shape[1] != q.shape[1]
    outputs = []
    for bucket in layout.buckets:
        def padded(t, bucket=bucket):
            return t.index_select(0, bucket.slot_tokens).view(bucket.sequences, bucket.length,
                                                              *t.shape[1:]).transpose(1, 2)

        out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=bucket.mask,
                                             is_causal=bucket.mask is None, scale=scale, dropout_p=dropout,
                                             enable_gqa=enable_gqa)  # [S, H, L, Dv]
        outputs.append(out.transpose(1, 2).flatten(0, 1).index_select(0, bucket.token_slots))
    if not outputs:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    together = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return together.index_select(0, layout.packed_order)


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
        return _padded_attend(q, k, v, packing, scale, dropout if module.training else 0.0)

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
