"""One pass over a chunk's logits for the log-prob head, forward and backward (Triton, CUDA).

`log_probs._ChunkedLogProbs` computes ``[C, V]`` logits per chunk of tokens. In plain torch the float32 work on
them (cast, log-sum-exp, softmax, the entropy's product and sum; in backward exp, products, the scatter and the
cast back) reads and writes the 152k-wide rows six to eight times each way: on the Qwen3-0.6B shape that was a
tenth of a training step. These kernels read the bf16 logits once and keep everything else in registers:

- `logsumexp_entropy`: per row, with an online max, ``lse = log sum exp(x)`` and the entropy
  ``lse - sum(p * x)``, where ``x = logit / temperature`` in float32 (as the torch path computes it);
- `grad_logits`: ``dL/dlogit_v = (g_ent * -p_v * (log p_v + H) - p_v * sum_k g_k + sum_k g_k [v = id_k]) / T``,
  written in the logits' dtype for the head's backward matmuls.

Suppressed ids are set to `log_probs.SUPPRESSED_LOGIT` in the logits before either kernel (their p is 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _lse_entropy_kernel(logits_ptr, lse_ptr, entropy_ptr, stride, vocab, inverse_temperature,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    offsets = tl.arange(0, BLOCK)
    running_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK,), tl.float32)
    weighted = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        mask = start + offsets < vocab
        x = tl.load(base + start + offsets, mask=mask, other=float("-inf")).to(tl.float32) * inverse_temperature
        new_max = tl.maximum(running_max, x)
        # lanes that saw only -inf keep a scale of 1 and add 0
        scale = tl.where(new_max == float("-inf"), 1.0, tl.exp(running_max - new_max))
        e = tl.where(mask, tl.exp(x - new_max), 0.0)
        total = total * scale + e
        weighted = weighted * scale + tl.where(mask, e * x, 0.0)
        running_max = new_max
    row_max = tl.max(running_max, axis=0)
    lane_scale = tl.where(running_max == float("-inf"), 0.0, tl.exp(running_max - row_max))
    total_sum = tl.sum(total * lane_scale, axis=0)
    weighted_sum = tl.sum(weighted * lane_scale, axis=0)
    lse = row_max + tl.log(total_sum)
    tl.store(lse_ptr + row, lse)
    tl.store(entropy_ptr + row, lse - weighted_sum / total_sum)


@triton.jit
def _grad_logits_kernel(logits_ptr, grad_ptr, lse_ptr, entropy_ptr, grad_log_probs_ptr, grad_entropy_ptr, ids_ptr,
                        stride, vocab, inverse_temperature, NUM_IDS: tl.constexpr, ENTROPY: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < vocab
    x = tl.load(logits_ptr + row * stride + offsets, mask=mask, other=0.0).to(tl.float32) * inverse_temperature
    log_p = x - tl.load(lse_ptr + row)
    p = tl.exp(log_p)
    grad_sum = 0.0
    onehot = tl.zeros((BLOCK,), tl.float32)
    for k in tl.static_range(NUM_IDS):
        g = tl.load(grad_log_probs_ptr + row * NUM_IDS + k)
        grad_sum += g
        target = tl.load(ids_ptr + row * NUM_IDS + k)
        onehot += tl.where(offsets == target, g, 0.0)
    grad = onehot - p * grad_sum
    if ENTROPY:
        grad -= tl.load(grad_entropy_ptr + row) * p * (log_p + tl.load(entropy_ptr + row))
    tl.store(grad_ptr + row * stride + offsets, (grad * inverse_temperature).to(grad_ptr.dtype.element_ty), mask=mask)


def logsumexp_entropy(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [C, V]`` (contiguous rows) -> float32 ``lse [C]`` and ``entropy [C]`` of ``logits / temperature``."""
    rows, vocab = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(lse)
    if rows:
        _lse_entropy_kernel[(rows,)](logits, lse, entropy, logits.stride(0), vocab, 1.0 / temperature, BLOCK=BLOCK,
                                     num_warps=8)
    return lse, entropy


def grad_logits(logits: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None, grad_log_probs: torch.Tensor,
                grad_entropy: torch.Tensor | None, ids: torch.Tensor, temperature: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient of ``sum(grad_log_probs * log_softmax(x)[ids]) + sum(grad_entropy * H(x))`` with respect to
    the logits (``x = logits / temperature``), in the logits' dtype; ``out`` may be ``logits`` (each entry is read
    before the same program writes it)."""
    rows, vocab = logits.shape
    out = torch.empty_like(logits) if out is None else out
    with_entropy = grad_entropy is not None and entropy is not None
    if rows:
        _grad_logits_kernel[(rows, triton.cdiv(vocab, BLOCK))](
            logits, out, lse, entropy if with_entropy else lse, grad_log_probs.float().contiguous(),
            grad_entropy.float().contiguous() if with_entropy else lse, ids.contiguous(), logits.stride(0), vocab,
            1.0 / temperature, NUM_IDS=ids.shape[1], ENTROPY=with_entropy, BLOCK=BLOCK, num_warps=8)
    return out
