"""The LM head split by vocabulary over a tensor-parallel group: log-probs, entropy and top-k without any rank
holding the full-vocabulary logits, and without gathering them (Megatron's vocabulary-parallel cross entropy, for
the RL head of `log_probs`).

Rank r of the group holds rows ``[start_r, start_r + V_r)`` of the head's weight (a DTensor ``Shard(0)`` on the tensor
axis: `parallelize.apply_tensor_parallel`) and the whole hidden states. Chunk by chunk, as `log_probs` does, it
computes its slice of the logits; one all-reduce (max) and one (sum) over the group give each token's log-normaliser,
its asked ids' logits (from the rank that owns each id) and the entropy's ``sum p * logit``; the top-k is each rank's
top-k gathered and ranked again. The backward recomputes each chunk's slice of logits, forms its slice of the logit
gradient (`log_probs._grad_logits`, with the asked ids that fall in the slice), and sums the hidden states' gradient
over the group once. The head's weight gradient stays on its rank's slice.

The numbers are the unsplit head's: float32 from the logits on, the same formulas, sums taken in another order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from relax.backends.training.log_probs import TokenLogProbs, _grad_logits, _logits


def vocabulary_slice(vocab: int, group: dist.ProcessGroup) -> tuple[int, int]:
    """``(start, size)`` of this rank's rows of a ``vocab``-row weight split as DTensor's ``Shard(0)`` does
    (``torch.chunk``: ``ceil(V / n)`` rows a rank, the last ones fewer, possibly none)."""
    per_rank = -(-vocab // group.size())
    start = min(group.rank() * per_rank, vocab)
    return start, min(per_rank, vocab - start)


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature, suppressed_ids, chunk_size, entropy_grad, top_k, group,
                start, keep_logits):
        num_tokens, size = hidden.shape[0], weight.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        local_ids = ids - start
        owned = (local_ids >= 0) & (local_ids < size)  # [M, K]: the asked ids in this rank's slice
        local_ids = local_ids.clamp(0, max(size - 1, 0))
        local_suppressed = None
        if suppressed_ids is not None:
            mine = suppressed_ids[(suppressed_ids >= start) & (suppressed_ids < start + size)]
            local_suppressed = mine - start if mine.numel() else None
        log_probs = hidden.new_empty((num_tokens, ids.shape[1]), dtype=dtype)
        log_norm = hidden.new_empty(num_tokens, dtype=dtype)
        ent = hidden.new_empty(num_tokens, dtype=dtype)
        top_log_probs = hidden.new_empty((num_tokens, top_k), dtype=dtype)
        top_ids = torch.empty((num_tokens, top_k), dtype=torch.long, device=hidden.device)
        kept = [] if keep_logits and any(ctx.needs_input_grad) else None  # (as `log_probs._ChunkedLogProbs`)
        for begin in range(0, num_tokens, chunk_size):
            rows = slice(begin, begin + chunk_size)
            logits = _logits(hidden[rows], weight, temperature, local_suppressed)  # [c, V_r] float32
            if kept is not None:
                kept.append(logits)
            peak = logits.max(dim=-1).values if size else logits.new_full((logits.shape[0],), -torch.inf)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            shifted = torch.exp(logits - peak.unsqueeze(-1))
            asked = torch.where(owned[rows], logits.gather(-1, local_ids[rows]), 0.0)
            # one sum over the group: [sum exp, sum exp * logit, the asked ids' logits]
            sums = torch.cat([shifted.sum(dim=-1, keepdim=True), (shifted * logits).sum(dim=-1, keepdim=True), asked],
                             dim=-1)
            dist.all_reduce(sums, group=group)
            log_norm[rows] = peak + sums[:, 0].log()
            log_probs[rows] = sums[:, 2:] - log_norm[rows].unsqueeze(-1)
            ent[rows] = log_norm[rows] - sums[:, 1] / sums[:, 0]
            if top_k:
                values, positions = logits.topk(min(top_k, size), dim=-1)
                # (slices may hold fewer than top_k ids: gathered shapes must agree, so pad with -inf)
                padded = torch.full((values.shape[0], top_k), -torch.inf, dtype=values.dtype, device=values.device)
                padded[:, :values.shape[1]] = values
                padded_ids = torch.zeros((values.shape[0], top_k), dtype=torch.long, device=values.device)
                padded_ids[:, :values.shape[1]] = positions + start
                candidates = [torch.empty_like(padded) for _ in range(group.size())]
                candidate_ids = [torch.empty_like(padded_ids) for _ in range(group.size())]
                dist.all_gather(candidates, padded, group=group)
                dist.all_gather(candidate_ids, padded_ids, group=group)
                best, order = torch.cat(candidates, dim=-1).topk(top_k, dim=-1)
                top_ids[rows] = torch.cat(candidate_ids, dim=-1).gather(-1, order)
                top_log_probs[rows] = best - log_norm[rows].unsqueeze(-1)
        ctx.save_for_backward(hidden, weight, local_ids, owned, log_norm, ent if entropy_grad else None,
                              local_suppressed, *(kept or ()))
        ctx.settings = (temperature, chunk_size, entropy_grad, group)
        ctx.mark_non_differentiable(top_log_probs, top_ids)
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return log_probs, ent, top_log_probs, top_ids

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, _grad_top, _grad_top_ids):
        hidden, weight, local_ids, owned, log_norm, ent, local_suppressed, *kept = ctx.saved_tensors
        temperature, chunk_size, entropy_grad, group = ctx.settings
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                                  device=weight.device) if ctx.needs_input_grad[1] else None
        if grad_log_probs is None:
            grad_log_probs = log_norm.new_zeros(local_ids.shape)
        with_entropy = entropy_grad and grad_entropy is not None
        for chunk, begin in enumerate(range(0, hidden.shape[0] if weight.shape[0] else 0, chunk_size)):
            rows = slice(begin, begin + chunk_size)  # (an empty slice adds 0)
            grad_logits = _grad_logits(hidden[rows], weight, local_ids[rows], log_norm[rows], grad_log_probs[rows],
                                       ent[rows] if with_entropy else None,
                                       grad_entropy[rows] if with_entropy else None, temperature, local_suppressed,
                                       owned[rows], kept=kept[chunk] if kept else None)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += grad_logits.T @ hidden[rows]
        if grad_hidden is not None:  # every slice of the vocabulary moved the hidden states
            dist.all_reduce(grad_hidden, group=group)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None, None


def vocab_parallel_token_log_probs(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, vocab: int,
                                   group: dist.ProcessGroup, *, temperature: float = 1.0,
                                   suppressed_ids: torch.Tensor | None = None, chunk_size: int = 1024,
                                   entropy_grad: bool = False, top_k: int = 0,
                                   compute_dtype: torch.dtype | None = None, keep_logits: bool = False) -> TokenLogProbs:
    """`log_probs.token_log_probs` with the head ``weight`` this rank's rows of the ``vocab`` ids (``[V_r, H]``,
    split over ``group`` as `vocabulary_slice` says) and ``hidden`` ``[M, H]`` the same on every rank of it; ``ids``
    are vocabulary ids. The entropy is always computed (one more column of the one sum). Every rank returns the
    whole result. ``chunk_size`` 0: one chunk. ``keep_logits``: each chunk's float32 logits of the slice kept for
    the backward instead of recomputed."""
    dtype = compute_dtype or hidden.dtype
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    start, size = vocabulary_slice(vocab, group)
    if weight.shape[0] != size:
        raise ValueError(f"the head's slice has {weight.shape[0]} rows, expected {size} of {vocab} (a Shard(0) split "
                         f"over {group.size()} ranks)")
    chunk = chunk_size if chunk_size > 0 else max(hidden.shape[0], 1)
    with torch.autocast(hidden.device.type, enabled=False):
        log_probs, ent, top_log_probs, top_ids = _VocabParallelLogProbs.apply(
            hidden, weight, ids, temperature, suppressed_ids, chunk, entropy_grad, top_k, group, start, keep_logits)
    return TokenLogProbs(log_probs, ent, top_log_probs if top_k else None, top_ids if top_k else None)
