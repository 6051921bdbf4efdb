"""Attention over the paged KV pool.

The pool of one layer is a key tensor and a value tensor of ``[num_slots, num_kv_heads, head_dim]`` (`kv_cache.
LayerKV`); a sequence's tokens live at the slots its block table gives (`block_manager`). Every step first writes
the new tokens' K/V into their slots (`LayerKV.write`), then attends:

- decode (one query per sequence): `decode_attention` reads each sequence's valid blocks only. On CUDA it is a
  kernel that walks the block table, so it has fixed shapes and runs inside CUDA graphs: `cuda_attention` (CUDA C
  built by NVRTC) where the shapes fit it (head dimension 128, up to 8 query heads a KV head, pages of 16k slots),
  else `triton_attention`; elsewhere the sequences' K/V are gathered and padded for SDPA.
- prefill (packed prompts, no padding in the projections and MLP) attends each prompt's new tokens to every
  earlier token of the sequence, the ones already in the pool (a shared prompt prefix) included. On CUDA in
  bf16/fp16 the K/V of each sequence are gathered from the pool, packed, into FlashAttention-2's varlen kernel
  (`relax.backends.models.flash_varlen`: no padding, no mask tensor, sum of L_i^2 work); elsewhere the queries and K/V
  are gathered into a padded batch for SDPA with a causal, per-sequence mask.

`StepMetadata` carries what every layer of a step needs, computed once per step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from relax.backends.inference.engine_core.kv_cache import LayerKV

NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class StepMetadata:
    """Per-step attention inputs (device tensors). ``slot_mapping [T]``: where each input token's K/V goes.

    Decode: ``block_tables [B, max_blocks]`` int32 and ``context_lens [B]`` int32 (the tokens of each sequence,
    the new one included). Prefill, padded views for SDPA: ``query_rows [B, Lq]`` (index of each padded query
    row in the packed tokens; ``T`` marks padding), ``key_slots [B, Lk]`` (pool slot of each key position) and
    ``mask [B, 1, Lq, Lk]`` (True: may attend), ``packed_rows [T]`` (flat index of each packed token in the
    padded ``[B * Lq]`` rows). For decode without Triton the same ``key_slots`` and ``mask`` are used.
    Prefill on the varlen kernel instead: ``key_slots [sum of lengths]`` (every sequence's slots 0..end, packed),
    ``cu_seqlens_q``/``cu_seqlens_k`` int32 and the longest query and key lengths.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    query_rows: torch.Tensor | None = None
    key_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    packed_rows: torch.Tensor | None = None
    use_triton: bool = False
    block_size: int = 0
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_query: int = 0
    max_key: int = 0


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to ``device`` without waiting for the device: on CUDA through pinned memory, so the copy
    queues behind the work already launched. A plain ``.to`` from pageable memory synchronises the stream, which
    held a prefill's host work until the step in flight had finished."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _sequence_slots(block_table: list[int], length: int, block_size: int) -> torch.Tensor:
    """The pool slots of a sequence's tokens ``0..length`` (host, int64)."""
    positions = torch.arange(length)
    return torch.tensor(block_table, dtype=torch.long)[positions // block_size] * block_size + positions % block_size


def prefill_metadata(block_size: int, block_tables: list[list[int]], starts: list[int], ends: list[int],
                     device: torch.device, varlen: bool = False) -> StepMetadata:
    """A prefill step over sequences whose tokens ``starts[i]..ends[i]`` are computed (``0..starts[i]`` are in
    the pool already); ``varlen``: for the FlashAttention varlen kernel, else padded for SDPA."""
    if varlen:
        return _varlen_prefill_metadata(block_size, block_tables, starts, ends, device)
    query_lens = [end - start for start, end in zip(starts, ends)]
    total = sum(query_lens)
    longest_query, longest_key = max(query_lens), max(ends)
    query_rows = torch.full((len(ends), longest_query), total, dtype=torch.long)
    key_slots = torch.zeros((len(ends), longest_key), dtype=torch.long)
    query_positions = torch.full((len(ends), longest_query), -1, dtype=torch.long)
    slot_mapping, packed_rows = [], []
    offset = 0
    for row, (table, start, end) in enumerate(zip(block_tables, starts, ends)):
        slots = _sequence_slots(table, end, block_size)
        key_slots[row, :end] = slots
        slot_mapping.append(slots[start:end])
        length = end - start
        query_rows[row, :length] = torch.arange(offset, offset + length)
        query_positions[row, :length] = torch.arange(start, end)
        packed_rows.append(torch.arange(length) + row * longest_query)
        offset += length
    key_positions = torch.arange(longest_key)
    ends_tensor = torch.tensor(ends)
    # A query at position p attends to keys 0..p of its own sequence; padding rows attend to key 0 (never NaN).
    mask = (key_positions[None, None, :] <= query_positions[:, :, None]) & (key_positions < ends_tensor[:, None])[:, None]
    mask[:, :, 0] |= query_positions < 0
    return StepMetadata(
        is_prefill=True, slot_mapping=upload(torch.cat(slot_mapping), device), query_rows=upload(query_rows, device),
        key_slots=upload(key_slots, device), mask=upload(mask[:, None], device),
        packed_rows=upload(torch.cat(packed_rows), device),
    )


def _varlen_prefill_metadata(block_size: int, block_tables: list[list[int]], starts: list[int], ends: list[int],
                             device: torch.device) -> StepMetadata:
    key_slots = [_sequence_slots(table, end, block_size) for table, end in zip(block_tables, ends)]
    slot_mapping = [slots[start:] for slots, start in zip(key_slots, starts)]
    query_lens = torch.tensor(ends) - torch.tensor(starts)
    zero = torch.zeros(1, dtype=torch.int32)
    cu_q = torch.cat([zero, query_lens.cumsum(0).to(torch.int32)])
    cu_k = torch.cat([zero, torch.tensor(ends).cumsum(0).to(torch.int32)])
    return StepMetadata(
        is_prefill=True, slot_mapping=upload(torch.cat(slot_mapping), device),
        key_slots=upload(torch.cat(key_slots), device), cu_seqlens_q=upload(cu_q, device),
        cu_seqlens_k=upload(cu_k, device), max_query=int(query_lens.max()), max_key=max(ends),
    )


def decode_metadata(block_size: int, block_tables: list[list[int]], context_lens: list[int], device: torch.device,
                    use_triton: bool, max_blocks: int | None = None) -> StepMetadata:
    """A decode step: sequence ``i`` holds ``context_lens[i]`` tokens, its newest at slot ``context_lens[i] - 1``."""
    width = max_blocks or max(len(t) for t in block_tables)
    tables = torch.zeros((len(block_tables), width), dtype=torch.int32)
    for row, table in enumerate(block_tables):
        tables[row, :len(table)] = torch.tensor(table, dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    last = (lens - 1).long()
    slot_mapping = tables.long().gather(1, (last // block_size)[:, None]).squeeze(1) * block_size + last % block_size
    metadata = StepMetadata(is_prefill=False, slot_mapping=upload(slot_mapping, device),
                            block_tables=upload(tables, device), context_lens=upload(lens, device),
                            use_triton=use_triton, block_size=block_size)
    if not use_triton:
        longest = int(lens.max())
        positions = torch.arange(longest)
        metadata.key_slots = upload(tables.long()[:, positions // block_size] * block_size + positions % block_size,
                                    device)
        metadata.mask = upload((positions[None, :] < lens[:, None])[:, None, None], device)
    return metadata


def attend(query: torch.Tensor, cache: LayerKV, metadata: StepMetadata, scale: float) -> torch.Tensor:
    """Attention of ``query [T, Hq, D]`` (the step's packed tokens) over the layer's pool; ``[T, Hq * D]``."""
    if metadata.is_prefill:
        if metadata.cu_seqlens_q is not None:
            from relax.backends.models.flash_varlen import causal_varlen_attention

            keys, values = _gathered(cache, metadata.key_slots, query.dtype)
            return causal_varlen_attention(query, keys, values, metadata.cu_seqlens_q, metadata.cu_seqlens_k,
                                           metadata.max_query, metadata.max_key, scale).flatten(1)
        return _padded_attention(query, cache, metadata, scale)
    if metadata.use_triton:
        from relax.backends.inference.engine_core import cuda_attention, triton_attention

        arguments = (query, cache.keys, cache.values, metadata.block_tables, metadata.context_lens, scale,
                     metadata.block_size)
        if cuda_attention.ENGINE_TAKES_IT and cuda_attention.supported(
                query, cache.keys, cache.values, metadata.block_size, cache.key_scales, cache.value_scales):
            return cuda_attention.paged_decode_attention(*arguments, cache.key_scales, cache.value_scales).flatten(1)
        return triton_attention.paged_decode_attention(*arguments, key_scales=cache.key_scales,
                                                       value_scales=cache.value_scales).flatten(1)
    return _padded_attention(query, cache, metadata, scale)


def _gathered(cache: LayerKV, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V at ``slots`` in ``dtype``: an FP8 pool on CUDA in one Triton kernel (`LayerKV.gather`'s torch
    operations were ten kernels, 8.7x its time for a prefill chunk on an H100)."""
    if cache.quantized and cache.keys.is_cuda:
        from relax.backends.inference.engine_core.triton_ops import gather_dequantized

        return gather_dequantized(cache, slots, dtype)
    return cache.gather(slots, dtype)


def _padded_attention(query: torch.Tensor, cache: LayerKV, metadata: StepMetadata, scale: float) -> torch.Tensor:
    _, heads, dim = query.shape
    if metadata.is_prefill:
        padded = torch.cat([query, query.new_zeros(1, heads, dim)])[metadata.query_rows]  # [B, Lq, Hq, D]
    else:
        padded = query[:, None]  # [B, 1, Hq, D]
    keys, values = _gathered(cache, metadata.key_slots, query.dtype)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, Lk, D]
    if query.is_cuda and keys.shape[1] != heads:  # SDPA's memory-efficient kernel takes a mask but no GQA
        keys = keys.repeat_interleave(heads // keys.shape[1], dim=1)
        values = values.repeat_interleave(heads // values.shape[1], dim=1)
    # cuDNN attention builds an execution plan per shape (milliseconds each on an H200), and prefill shapes vary.
    backends = sdpa_kernel(NO_CUDNN) if query.is_cuda else contextlib.nullcontext()
    with backends:
        out = F.scaled_dot_product_attention(padded.transpose(1, 2), keys, values, attn_mask=metadata.mask,
                                             scale=scale, enable_gqa=heads != keys.shape[1])  # [B, Hq, Lq, D]
    out = out.transpose(1, 2).reshape(-1, heads * dim)
    return out[metadata.packed_rows] if metadata.is_prefill else out
