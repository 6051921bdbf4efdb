"""Per-token log-probs and entropy from hidden states, without the full logits.

The LM head of a Qwen model maps each response position to 152k logits; in float32 that is 600 KB per token,
so a micro-batch of 16k response tokens would hold 10 GB of logits, more for their softmax, and again for
their gradients. `token_log_probs` computes the head, the log-softmax, the log-probs at the asked ids and the
entropy ``chunk_size`` tokens at a time, keeping only ``[M]``-sized results; its backward recomputes each
chunk's logits from the saved hidden states (one more head matmul, a few % of a step) and turns the
incoming gradients into the head's and the hidden states' gradients chunk by chunk. With ``keep_logits`` the
forward keeps each chunk's logits for the backward instead, which (on CUDA) writes the logit gradient over them:
one head matmul a chunk less, for the logits' bytes (2 x the vocabulary a response token on CUDA, in the compute
dtype; 4 x on the torch path, in float32) held from the head's forward to its backward (the head is the last layer,
so its backward comes first).

Numerics match the unchunked path: the head runs in the compute dtype (bf16 on GPU, as under autocast), the
softmax and everything after it in float32. On CUDA the float32 work on each chunk's logits is one pass of a
Triton kernel each way (`triton_head`: log-sum-exp and entropy forward, the logit gradient backward) instead of
several torch passes over the 152k-wide rows; top-k requests keep the torch path. ``chunk_size=0`` keeps that unchunked path (full logits, plain
autograd) for comparison.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from relax.backends.training.master_weights import MasterWeightCasts, accumulate_grad

# Logit of tokens the engine never samples (media placeholders): finite, so that 0·logit stays 0 in the entropy.
SUPPRESSED_LOGIT = -1e9


class TokenLogProbs(NamedTuple):
    log_probs: torch.Tensor  # [M, K]: log-probs at ids[:, j]
    entropy: torch.Tensor | None  # [M]
    top_log_probs: torch.Tensor | None = None  # [M, top_k]
    top_ids: torch.Tensor | None = None  # [M, top_k]


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float,
            suppressed_ids: torch.Tensor | None) -> torch.Tensor:
    logits = hidden @ weight.T
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    if suppressed_ids is not None:  # the engine never samples media placeholders: same distribution here
        logits = logits.index_fill(-1, suppressed_ids, SUPPRESSED_LOGIT)
    return logits


def _entropy(logits: torch.Tensor, log_norm: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    return log_norm - (probs * logits).sum(dim=-1)


def _full_logit_path(hidden, weight, ids, temperature, suppressed_ids, entropy, entropy_grad, top_k) -> TokenLogProbs:
    logits = _logits(hidden, weight, temperature, suppressed_ids)
    log_norm = logits.logsumexp(dim=-1)
    log_probs = logits.gather(-1, ids) - log_norm.unsqueeze(-1)
    ent = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = _entropy(logits, log_norm)
    top_log_probs = top_ids = None
    if top_k:
        top_logits, top_ids = logits.detach().topk(top_k, dim=-1)
        top_log_probs = top_logits - log_norm.detach().unsqueeze(-1)
    return TokenLogProbs(log_probs, ent, top_log_probs, top_ids)


def _fused_head_available(hidden: torch.Tensor) -> bool:
    """Whether `triton_head`'s one-pass kernels can serve this head (CUDA with Triton)."""
    if not hidden.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _raw_logits(hidden: torch.Tensor, weight: torch.Tensor, suppressed_ids: torch.Tensor | None) -> torch.Tensor:
    """The head's logits in the compute dtype, suppressed ids masked (the fused kernels scale and upcast)."""
    logits = hidden @ weight.T
    if suppressed_ids is not None:
        logits.index_fill_(-1, suppressed_ids, SUPPRESSED_LOGIT)
    return logits


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature, suppressed_ids, chunk_size, entropy, entropy_grad, top_k,
                master, keep_logits):
        num_tokens = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        log_probs = hidden.new_empty((num_tokens, ids.shape[1]), dtype=dtype)
        log_norm = hidden.new_empty(num_tokens, dtype=dtype)
        ent = hidden.new_empty(num_tokens, dtype=dtype) if entropy else None
        top_log_probs = hidden.new_empty((num_tokens, top_k), dtype=dtype)
        top_ids = torch.empty((num_tokens, top_k), dtype=torch.long, device=hidden.device)
        fused = not top_k and _fused_head_available(hidden)
        ctx.fused = fused
        # the chunks' logits for the backward (only where one will run: a forward for log-probs alone keeps none)
        kept = [] if keep_logits and any(ctx.needs_input_grad) else None
        if fused:
            from relax.backends.training.triton_head import logsumexp_entropy
        for start in range(0, num_tokens, chunk_size):
            rows = slice(start, start + chunk_size)
            if fused:
                logits = _raw_logits(hidden[rows], weight, suppressed_ids)
                log_norm[rows], chunk_entropy = logsumexp_entropy(logits, temperature)
                log_probs[rows] = logits.gather(-1, ids[rows]).to(dtype) / temperature - log_norm[rows].unsqueeze(-1)
                if entropy:
                    ent[rows] = chunk_entropy
            else:
                logits = _logits(hidden[rows], weight, temperature, suppressed_ids)
                log_norm[rows] = logits.logsumexp(dim=-1)
                log_probs[rows] = logits.gather(-1, ids[rows]) - log_norm[rows].unsqueeze(-1)
                if entropy:
                    ent[rows] = _entropy(logits, log_norm[rows])
                if top_k:
                    top_logits, top_ids[rows] = logits.topk(top_k, dim=-1)
                    top_log_probs[rows] = top_logits - log_norm[rows].unsqueeze(-1)
            if kept is not None:
                kept.append(logits)
        ctx.save_for_backward(hidden, weight, ids, log_norm, ent if entropy_grad else None, suppressed_ids,
                              *(kept or ()))
        ctx.settings = (temperature, chunk_size, entropy_grad)
        ctx.master = master  # a float32 parameter whose .grad takes the head's gradient directly, or None
        ctx.mark_non_differentiable(top_log_probs, top_ids)
        if entropy and not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return log_probs, ent, top_log_probs, top_ids

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, _grad_top, _grad_top_ids):
        hidden, weight, ids, log_norm, ent, suppressed_ids, *kept = ctx.saved_tensors
        if getattr(ctx, "kept_overwritten", False):  # a second backward (retain_graph): the first wrote over them
            kept = []
        temperature, chunk_size, entropy_grad = ctx.settings
        master = ctx.master if ctx.master is not None and ctx.needs_input_grad[9] else None
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                                  device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for chunk, start in enumerate(range(0, hidden.shape[0], chunk_size)):
            rows = slice(start, start + chunk_size)
            with_entropy = entropy_grad and grad_entropy is not None
            inputs = (hidden[rows], weight, ids[rows], log_norm[rows], grad_log_probs[rows],
                      ent[rows] if with_entropy else None, grad_entropy[rows] if with_entropy else None, temperature,
                      suppressed_ids)
            grad_logits = (_fused_grad_logits if ctx.fused else _grad_logits)(*inputs,
                                                                              kept=kept[chunk] if kept else None)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += grad_logits.T @ hidden[rows]
            if master is not None:
                accumulate_grad(master, grad_logits.T, hidden[rows])
        ctx.kept_overwritten = bool(kept) and ctx.fused
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None, None


def _fused_grad_logits(hidden, weight, ids, log_norm, grad_log_probs, ent, grad_entropy, temperature, suppressed_ids,
                       kept=None):
    """The chunk's logit gradient from `triton_head`'s one-pass kernel, in the compute dtype: written over the
    forward's ``kept`` logits of the chunk where it kept them, else over the logits recomputed here."""
    from relax.backends.training.triton_head import grad_logits

    logits = kept if kept is not None else _raw_logits(hidden, weight, suppressed_ids)
    result = grad_logits(logits, log_norm, ent, grad_log_probs, grad_entropy, ids, temperature, out=logits)
    if suppressed_ids is not None:
        result.index_fill_(-1, suppressed_ids, 0.0)
    return result


def _grad_logits(hidden, weight, ids, log_norm, grad_log_probs, ent, grad_entropy, temperature, suppressed_ids,
                 owned=None, kept=None):
    """The torch path of the chunk's logit gradient (CPU, and top-k requests), in the hidden states' dtype.
    ``owned`` ``[c, K]``: which asked ids are among ``weight``'s rows (a slice of the vocabulary, `vocab_parallel`;
    ``ids`` then index the slice), None: all. ``kept``: the chunk's logits from the forward (`_logits`), else
    recomputed here."""
    logits = kept if kept is not None else _logits(hidden, weight, temperature, suppressed_ids)
    probs = torch.exp(logits - log_norm.unsqueeze(-1))
    # d log p(c) / d logit_v = 1[v = c] - p_v, for each asked id c
    grad = probs * -grad_log_probs.sum(dim=-1, keepdim=True)
    grad.scatter_add_(-1, ids, grad_log_probs if owned is None else grad_log_probs * owned)
    if grad_entropy is not None:
        # d H / d logit_v = -p_v (log p_v + H)
        grad -= grad_entropy.unsqueeze(-1) * probs * (logits - log_norm.unsqueeze(-1) + ent.unsqueeze(-1))
    if suppressed_ids is not None:
        grad.index_fill_(-1, suppressed_ids, 0.0)
    if temperature != 1.0:
        grad /= temperature
    return grad.to(hidden.dtype)


def token_log_probs(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, *, temperature: float = 1.0,
                    suppressed_ids: torch.Tensor | None = None, chunk_size: int = 1024, entropy: bool = True,
                    entropy_grad: bool = False, top_k: int = 0, compute_dtype: torch.dtype | None = None,
                    weight_casts: MasterWeightCasts | None = None, keep_logits: bool = False) -> TokenLogProbs:
    """Log-probs of the LM head ``weight`` ``[V, H]`` applied to ``hidden`` ``[M, H]`` at ``ids``
    ``[M, K]`` (the next token, and any extra ids such as a teacher's top-k), with the entropy ``[M]``
    (differentiable only with ``entropy_grad``) and optionally the ``top_k`` most likely tokens.

    The head runs in ``compute_dtype`` (default: the hidden states' dtype). With ``weight_casts`` (the chunked
    path), a float32 master ``weight`` is cast through them and its gradient is summed into ``weight.grad`` in
    float32 chunk by chunk (`master_weights.accumulate_grad`) instead of flowing back through a cast.
    ``keep_logits``: the chunks' logits are kept from the forward for the backward (module docstring)."""
    dtype = compute_dtype or hidden.dtype
    master = None
    if weight_casts is not None and chunk_size > 0 and weight.dtype != dtype:
        master, weight = weight, weight_casts.cast(weight)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    with torch.autocast(hidden.device.type, enabled=False):
        if chunk_size <= 0:
            return _full_logit_path(hidden, weight, ids, temperature, suppressed_ids, entropy, entropy_grad, top_k)
        log_probs, ent, top_log_probs, top_ids = _ChunkedLogProbs.apply(
            hidden, weight, ids, temperature, suppressed_ids, chunk_size, entropy, entropy_grad, top_k, master,
            keep_logits)
    return TokenLogProbs(log_probs, ent, top_log_probs if top_k else None, top_ids if top_k else None)
