"""Context parallelism, Ulysses style (DeepSpeed-Ulysses): the ranks of a context group each hold a contiguous
slice of a packed row's tokens, and attention alone sees the whole row.

- `split_packed`: rank r of ``cp`` takes tokens ``[r * N / cp, (r + 1) * N / cp)`` of the packed row (padded with a
  sequence of its own to a multiple of ``cp``), their positions, and the response positions that fall in its slice;
- `ulysses_attention`: before attention an all-to-all trades the slice of tokens x all heads for all tokens x a
  slice of heads, the packed (varlen) attention runs over the whole row with the row's ``cu_seqlens``, and an
  all-to-all trades back; every other layer (norms, MLPs, experts, the LM head) works on the rank's tokens;
- `gather_response_outputs`: the per-token outputs of the LM head (log-probs, entropy) from all slices, in the row's
  order, so the loss sees the micro-batch whole; its backward sums each slice's gradient over the ranks.

Sequences may straddle slices: positions and ``cu_seqlens`` are the row's, so attention is exact. Ulysses needs no
special kernels (ring attention has no CPU kernels); each rank's heads (after tensor parallelism) must divide by
``cp``; key-value heads that do not are repeated to the query heads first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from relax.backends.training.packing import PackedSequences, pad_packed

# the differentiable all-gather (its backward sums the gradients to their slice): renamed in torch 2.13
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


@dataclass(frozen=True)
class ContextSlice:
    """This rank's slice of a packed row: ``response_counts[r]`` response positions fall in rank r's slice."""

    group: dist.ProcessGroup
    rank: int
    size: int
    response_counts: tuple[int, ...]

    @property
    def rows(self) -> slice:
        """This slice's response positions among the row's (they are contiguous: the slices are)."""
        first = sum(self.response_counts[:self.rank])
        return slice(first, first + self.response_counts[self.rank])


def split_packed(packed: PackedSequences, group: dist.ProcessGroup) -> tuple[PackedSequences, ContextSlice]:
    """This rank's slice of ``packed`` (host tensors): its tokens and positions, the whole row's ``cu_seqlens``
    (with the padding as a last sequence), and its response positions relative to the slice."""
    size, rank = group.size(), group.rank()
    total = packed.num_tokens
    padded = -(-total // size) * size
    row = pad_packed(packed, padded)
    input_ids, position_ids, cu_seqlens = row.input_ids, row.position_ids, row.cu_seqlens
    width = padded // size
    start, end = rank * width, (rank + 1) * width
    owner = torch.div(packed.predict_index, width, rounding_mode="floor")
    counts = tuple(int(c) for c in torch.bincount(owner, minlength=size).tolist())
    mine = owner == rank
    local = PackedSequences(
        input_ids=input_ids[:, start:end], position_ids=position_ids[:, start:end], cu_seqlens=cu_seqlens,
        max_seqlen=row.max_seqlen, predict_index=packed.predict_index[mine] - start,
        targets=packed.targets[mine], response_lengths=packed.response_lengths)
    return local, ContextSlice(group, rank, size, counts)


def _heads_to_tokens(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """``[N / cp, H, D]`` (a slice of tokens, all heads) -> ``[N, H / cp, D]`` (all tokens, a slice of heads)."""
    local_tokens, heads, dim = x.shape
    send = x.reshape(local_tokens, size, heads // size, dim).transpose(0, 1).contiguous()
    received = wait_tensor(all_to_all_single_autograd(send.flatten(0, 1), None, None, group))
    return received.reshape(size * local_tokens, heads // size, dim)


def _tokens_to_heads(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """The inverse: ``[N, H / cp, D]`` -> ``[N / cp, H, D]``."""
    tokens, heads, dim = x.shape
    received = wait_tensor(all_to_all_single_autograd(x.contiguous(), None, None, group))
    return received.reshape(size, tokens // size, heads, dim).transpose(0, 1).reshape(tokens // size, size * heads,
                                                                                       dim)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: ContextSlice, attend):
    """``attend(q, k, v)`` over the whole row for this rank's heads; ``[N / cp, H, D]`` in and out."""
    size = context.size
    if q.shape[1] % size:
        raise ValueError(f"--context-parallel-size {size} does not divide the {q.shape[1]} attention heads of a "
                         "rank (after tensor parallelism)")
    if k.shape[1] % size:  # grouped-query attention with fewer key-value heads than ranks: one per query head
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    q, k, v = (_heads_to_tokens(t, context.group, size) for t in (q, k, v))
    return _tokens_to_heads(attend(q, k, v), context.group, size)


def gather_response_outputs(values: torch.Tensor, context: ContextSlice) -> torch.Tensor:
    """``values`` ``[M_r, ...]`` (this slice's response positions) -> ``[M, ...]`` for the whole row, in order."""
    longest = max(context.response_counts)
    # (the collective takes equal shapes: each slice's rows padded to the longest)
    padded = torch.cat([values, values.new_zeros((longest - values.shape[0], *values.shape[1:]))])
    gathered = wait_tensor(_all_gather(padded, 0, context.group))
    keep = torch.cat([torch.arange(count, device=values.device) + rank * longest
                      for rank, count in enumerate(context.response_counts)])
    return gathered.index_select(0, keep)
