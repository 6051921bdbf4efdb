"""Qwen3's per-head query/key RMSNorms and the rotary embedding after them in one pass each way.

Stock, a Qwen3 attention layer normalises each head of the queries and of the keys (one kernel each), then rotates
both (liger-kernel's RoPE, one more): the queries and keys go through memory three times each way. On CUDA one
Triton kernel (`triton_qk_rope`) reads the projections' outputs and writes the rotated, normalised heads, and one
backward kernel reads them and the incoming gradients and writes the projections' and the weights' gradients. The
math is the separate kernels' (`qk_norm_rope_reference`): the row normalised in float32 and rounded to the input's
dtype times the weight (liger's "llama" casting, as `compiled_norm`), then rotated in float32 and rounded once.

`torch.compile` of `qk_norm_rope_reference` was measured first (H100, 0.6B shape): its backward ran at 480 us a
layer and micro-batch, about a third of the bandwidth, and the step was no faster than with the separate kernels
(0.999x, `benchmarks/results/train_fused_qk_h100_gpu.json`).

Installed on the trainer's attention modules of the Qwen3 families (`fuse_qk_norm_rope`), beside the other
fused kernels (`liger.apply_liger_kernels`); a forward that is not the packed trainer's (a cache, a padded batch
with a mask) runs the module's own code, and off CUDA the fused forward computes the reference in torch.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from relax.backends.training.compiled_norm import rms_norm_reference
from relax.backends.training.master_weights import shared_input_linears
from relax.backends.training.varlen_attention import PACKING_KWARG, packed_attention_forward

# attention classes whose q_norm/k_norm normalise each head (Olmo2's normalise all heads together: not these)
QK_NORM_ATTENTION_CLASSES = ("Qwen3Attention", "Qwen3MoeAttention")


def qk_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, T, Hq, D]`` and ``k [B, T, Hk, D]`` (the projections' outputs, heads split), ``cos``/``sin``
    ``[B, T, D]``: each head RMS-normalised, then rotated (rotate-half), in the inputs' dtype."""
    cos, sin = cos.unsqueeze(2).float(), sin.unsqueeze(2).float()

    def normalise_and_rotate(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        normed = rms_norm_reference(x, weight, eps).float()
        half = normed.shape[-1] // 2
        rotated = torch.cat((-normed[..., half:], normed[..., :half]), dim=-1)
        return (normed * cos + rotated * sin).to(x.dtype)

    return normalise_and_rotate(q, q_weight), normalise_and_rotate(k, k_weight)


def fused_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`qk_norm_rope_reference`, by the Triton kernels on CUDA (one packed row; a head width of twice a power of
    two, as the kernels' tiles are)."""
    half = q.shape[-1] // 2
    if q.is_cuda and q.shape[0] == 1 and q.shape[-1] == k.shape[-1] == 2 * half and half & (half - 1) == 0:
        from relax.backends.training.triton_qk_rope import QKNormRope

        return QKNormRope.apply(q, k, q_weight, k_weight, cos, sin, eps)
    return qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps)


def _attention_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
    """The packed trainer's forward of a Qwen3 attention layer: Hugging Face's, with the norms and RoPE fused."""
    cached = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
    if kwargs.get(PACKING_KWARG) is None or cached or position_embeddings is None:
        return self.relax_unfused_forward(hidden_states, position_embeddings=position_embeddings,
                                          attention_mask=attention_mask, **kwargs)
    heads = (*hidden_states.shape[:-1], -1, self.head_dim)
    q, k, v = (projection.view(heads) for projection in
               shared_input_linears(hidden_states, (self.q_proj, self.k_proj, self.v_proj)))
    cos, sin = position_embeddings
    q, k = fused_qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.variance_epsilon)
    out, weights = packed_attention_forward(
        self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attention_mask, scaling=self.scaling,
        dropout=self.attention_dropout if self.training else 0.0, sliding_window=self.sliding_window, **kwargs)
    return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


def _fusable(module: nn.Module) -> bool:
    if type(module).__name__ not in QK_NORM_ATTENTION_CLASSES:
        return False
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    head_dim = getattr(module, "head_dim", None)
    return all(getattr(norm, "weight", None) is not None and norm.weight.shape == (head_dim,)
               and getattr(norm, "variance_epsilon", None) == q_norm.variance_epsilon for norm in (q_norm, k_norm))


def fuse_qk_norm_rope(language_model: nn.Module) -> int:
    """Put the fused forward on this model's Qwen3 attention layers; how many."""
    count = 0
    for module in language_model.modules():
        if _fusable(module) and not hasattr(module, "relax_unfused_forward"):
            module.relax_unfused_forward = module.forward
            module.forward = types.MethodType(_attention_forward, module)
            count += 1
    return count
