"""The trainer's packer: micro-batches as flat token streams, and which sequences go into which.

A packed micro-batch concatenates whole sequences into one row ``[1, N]`` with per-sequence
positions and ``cu_seqlens`` (the varlen attention keeps them apart, `varlen_attention`), so no
compute goes to padding. RL responses vary in length from tens to thousands of tokens; a
right-padded micro-batch spends most of its FLOPs on pad tokens when one long response shares it
with short ones.

Token-budget planning (``--use-dynamic-batch-size``) fills micro-batches up to
``--max-tokens-per-gpu`` tokens instead of a fixed number of samples; the loss functions divide by
global denominators, so how samples are split into micro-batches never changes the gradient.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PackedSequences:
    """Whole sequences concatenated into one row.

    ``predict_index`` ``[M]`` holds the stream positions whose next token is a response token (sample
    by sample, in order), ``targets`` ``[M]`` those next tokens; ``response_lengths`` splits ``M``
    back into samples."""

    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N], restarting at 0 for every sequence
    cu_seqlens: torch.Tensor  # [S + 1] int32, sequence boundaries in the stream
    max_seqlen: int
    predict_index: torch.Tensor  # [M]
    targets: torch.Tensor  # [M]
    response_lengths: list[int]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device: torch.device) -> PackedSequences:
        return PackedSequences(
            self.input_ids.to(device, non_blocking=True), self.position_ids.to(device, non_blocking=True),
            self.cu_seqlens.to(device, non_blocking=True), self.max_seqlen,
            self.predict_index.to(device, non_blocking=True), self.targets.to(device, non_blocking=True),
            self.response_lengths,
        )


def pack_sequences(tokens: Sequence[Sequence[int]], response_lengths: Sequence[int]) -> PackedSequences:
    """Pack ``tokens[i]`` (prompt + response) with the last ``response_lengths[i]`` tokens of each as
    the response; built on the CPU (pin and move it with `PackedSequences.to`)."""
    lengths = [len(t) for t in tokens]
    if any(length == 0 for length in lengths):
        raise ValueError("cannot pack an empty sequence")
    for length, resp_len in zip(lengths, response_lengths):
        if not 0 <= resp_len < length:
            raise ValueError(f"a sequence of {length} tokens cannot hold a response of {resp_len} tokens "
                             "(the prompt needs at least one token)")
    stream = torch.tensor([token for sequence in tokens for token in sequence], dtype=torch.long)
    length_tensor = torch.tensor(lengths, dtype=torch.long)
    starts = torch.cumsum(length_tensor, 0) - length_tensor
    position_ids = torch.arange(len(stream)) - torch.repeat_interleave(starts, length_tensor)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(length_tensor, 0)
    resp = torch.tensor(list(response_lengths), dtype=torch.long)
    # Sample i's response tokens sit at starts[i] + length[i] - resp[i] ... end - 1; each is predicted
    # by the position before it.
    first_predict = starts + length_tensor - resp - 1
    offsets = torch.arange(int(resp.sum())) - torch.repeat_interleave(torch.cumsum(resp, 0) - resp, resp)
    predict_index = torch.repeat_interleave(first_predict, resp) + offsets
    return PackedSequences(
        input_ids=stream.unsqueeze(0), position_ids=position_ids.unsqueeze(0), cu_seqlens=cu_seqlens,
        max_seqlen=max(lengths), predict_index=predict_index, targets=stream[predict_index + 1],
        response_lengths=list(response_lengths),
    )


def pad_packed(packed: PackedSequences, length: int) -> PackedSequences:
    """``packed`` grown to ``length`` tokens by a last sequence of padding (token 0, positions from 0), which attends
    only to itself and predicts nothing: the row's real tokens compute exactly as before."""
    total = packed.num_tokens
    if length < total:
        raise ValueError(f"cannot pad a packed row of {total} tokens to {length}")
    if length == total:
        return packed
    extra = length - total
    return PackedSequences(
        input_ids=torch.cat([packed.input_ids, packed.input_ids.new_zeros(1, extra)], dim=1),
        position_ids=torch.cat([packed.position_ids,
                                torch.arange(extra, dtype=packed.position_ids.dtype).unsqueeze(0)], dim=1),
        cu_seqlens=torch.cat([packed.cu_seqlens, packed.cu_seqlens.new_tensor([length])]),
        max_seqlen=max(packed.max_seqlen, extra), predict_index=packed.predict_index, targets=packed.targets,
        response_lengths=packed.response_lengths)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device: on CUDA through pinned memory, so the copy
    is queued behind the kernels in flight instead of draining them (a copy from pageable memory synchronizes
    the stream: a micro-batch's dozens of small inputs would each leave the GPU idle while the host caught up)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _response_width(response_lengths: Sequence[int], at_least: int | None = None) -> int:
    return max(at_least or 0, max(response_lengths, default=0), 1)


def pad_responses(flat: torch.Tensor, response_lengths: Sequence[int], max_len: int | None = None) -> torch.Tensor:
    """Per-response-token values ``[M, ...]`` (samples in order) as ``[B, R, ...]``, zero-padded on the right:
    the layout the loss functions take. The indices are built on the host (no device synchronization)."""
    lengths = torch.tensor(list(response_lengths), dtype=torch.long)
    width = _response_width(response_lengths, max_len)
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    cols = torch.arange(int(lengths.sum())) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    flat_index = to_device(rows * width + cols, flat.device)
    out = flat.new_zeros((len(lengths) * width, *flat.shape[1:]))
    return out.index_copy(0, flat_index, flat).view(len(lengths), width, *flat.shape[1:])


def response_mask(response_lengths: Sequence[int], device: torch.device, width: int | None = None) -> torch.Tensor:
    """``[B, R]`` float mask, 1 on real response tokens."""
    lengths = torch.tensor(list(response_lengths), dtype=torch.long)
    width = _response_width(response_lengths, width)
    return to_device((torch.arange(width) < lengths.unsqueeze(1)).float(), device)


def padded_rows(rows: Sequence[Sequence[float]] | Sequence[torch.Tensor], width: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Host rows (lists or ``[T_i, ...]`` tensors) as one right-zero-padded ``[B, width, ...]`` host tensor."""
    values = [torch.as_tensor(row, dtype=dtype) for row in rows]
    trailing = values[0].shape[1:] if values else ()
    out = torch.zeros((len(values), width, *trailing), dtype=dtype)
    for index, value in enumerate(values):
        out[index, : value.shape[0]] = value
    return out


# ---- planning ------------------------------------------------------------------------------

def balanced_partition(costs: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``costs`` split into exactly ``parts`` groups of near-equal total cost (longest
    first onto the lightest group; ties by index, so every rank computes the same split). Groups keep
    their indices in ascending order; a group is empty only when there are fewer items than parts."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    heap = [(0, part) for part in range(parts)]
    groups: list[list[int]] = [[] for _ in range(parts)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, part = heapq.heappop(heap)
        groups[part].append(index)
        heapq.heappush(heap, (load + costs[index], part))
    return [sorted(group) for group in groups]


def plan_token_budget(lengths: Sequence[int], max_tokens: int, min_micro_batches: int = 1) -> list[list[int]]:
    """Micro-batches (lists of indices into ``lengths``) of at most ``max_tokens`` tokens each, as few as
    the budget allows (at least ``min_micro_batches``) and balanced among themselves, so no micro-batch
    is a small remainder. A sequence longer than the budget gets a micro-batch of its own."""
    if max_tokens < 1:
        raise ValueError(f"the token budget must be positive, got {max_tokens}")
    if not lengths:
        return [[] for _ in range(min_micro_batches)]
    oversized = [i for i, length in enumerate(lengths) if length > max_tokens]
    fitting = [i for i, length in enumerate(lengths) if length <= max_tokens]
    fitting_cost = sum(lengths[i] for i in fitting)
    count = max(min_micro_batches - len(oversized), -(-fitting_cost // max_tokens), 1 if fitting else 0)
    while count:
        groups = [[fitting[j] for j in group] for group in balanced_partition([lengths[i] for i in fitting], count)]
        if all(sum(lengths[i] for i in group) <= max_tokens for group in groups):
            break
        count += 1  # longest-first balancing can overflow a tight budget; one more group always helps
    else:
        groups = []
    return [[i] for i in oversized] + groups


def pad_sequences(tokens: Sequence[Sequence[int]], response_lengths: Sequence[int],
                  pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The right-padded layout of the same sequences: ``input_ids`` and ``attention_mask`` ``[B, T]``, and, as
    for `pack_sequences`, flat ``predict_index`` (into ``B * T``) and ``targets`` ``[M]``."""
    width = max(len(t) for t in tokens)
    input_ids = torch.full((len(tokens), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(tokens), width), dtype=torch.long)
    predict = []
    for row, (sequence, resp_len) in enumerate(zip(tokens, response_lengths)):
        input_ids[row, : len(sequence)] = torch.tensor(list(sequence))
        attention_mask[row, : len(sequence)] = 1
        predict.append(row * width + torch.arange(len(sequence) - resp_len - 1, len(sequence) - 1))
    predict_index = torch.cat(predict) if predict else torch.zeros(0, dtype=torch.long)
    return input_ids, attention_mask, predict_index, input_ids.flatten()[predict_index + 1]
