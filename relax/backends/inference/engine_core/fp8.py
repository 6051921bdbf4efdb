"""FP8 rollout (``--rollout-fp8``): the engine core's linear layers multiply in FP8 (e4m3).

Decoding is bound by reading the weights: at batch 256 a bf16 step of the Qwen3-4B shape reads 8 GB of weights
and little else. In FP8 each weight is one byte, so the GEMMs read half as much; the activations are quantised per
token on the fly (one scale per row, like the weights' one scale per output channel), and ``torch._scaled_mm``
multiplies the two FP8 operands with the scales applied in its epilogue, writing the model's dtype.

What stays in the model's dtype: embeddings, norms, rotary tables, attention (over a bf16 KV cache) and the LM head
(the sampled distribution is most sensitive to it, and it is one layer). The projections of every decoder layer
(q, k, v, o, gate, up, down) are quantised.

The projections that read the same input (q, k and v; gate and up) share its quantisation: a layer quantises four
activations, not seven. On CUDA each is one Triton kernel (`triton_ops.quantize_rows_fp8`, the same arithmetic as
`quantize_rows`): written with torch operations it was six small kernels per projection, which cost more GPU time
than the layer's GEMMs (docs/engines.md).

The engine keeps the model's bf16 weights as the target of weight syncs (names and shapes unchanged for every
transport) and requantises them into the same FP8 buffers after every sync (`Fp8Linears.requantize`, from
`EmbeddedEngine.update_weights`): CUDA graphs captured on those buffers stay valid. The cost is the FP8 copies
(half the bf16 weights) beside them. The trainer's forward stays bf16; the difference between the two is the
train/rollout mismatch that ``--use-tis`` corrects and reports (``train/tis_mismatch_kl``).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from relax.backends.inference.engine_core.fp8_format import FP8, FP8_MAX
from relax.backends.inference.engine_core.fp8_format import MIN_SCALE as _MIN_SCALE

PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
# The projections of a block that read the same input (the others read their own: o after attention, down after
# the gated product).
SHARED_INPUTS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


def quantize_rows(matrix: torch.Tensor, out: torch.Tensor | None = None,
                  scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``matrix [R, C]`` as FP8 with one float32 scale per row (``matrix ~ fp8 * scale``); into ``out`` and
    ``scales`` when given (in place, for buffers that CUDA graphs read)."""
    amax = matrix.detach().abs().amax(dim=1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp_min(_MIN_SCALE)
    quantized = (matrix.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if out is None:
        return quantized, scale
    out.copy_(quantized)
    scales.copy_(scale)
    return out, scales


def quantize_activations(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of ``rows [T, H]``, in one Triton kernel on CUDA."""
    if rows.is_cuda:
        from relax.backends.inference.engine_core.triton_ops import quantize_rows_fp8

        return quantize_rows_fp8(rows.contiguous(), FP8_MAX, _MIN_SCALE)
    return quantize_rows(rows)


class SharedInput:
    """The FP8 form of the input that a group of projections reads (q, k, v; gate, up): quantised by the first of
    them, reused by the others while the input is the same tensor, and let go by the group's last (the models call
    them in that order; another order quantises again, never reuses a stale input)."""

    def __init__(self, last: str) -> None:
        self.last = last  # the name of the group's last projection
        self.source: torch.Tensor | None = None  # held while reused: no other tensor can take its identity
        self.quantized: tuple[torch.Tensor, torch.Tensor] | None = None

    def of(self, x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        quantized = self.quantized if self.source is x else quantize_activations(x.reshape(-1, x.shape[-1]))
        if name == self.last:  # nothing else reads it: a prefill's activations are not kept past the layer
            self.source = self.quantized = None
        else:
            self.source, self.quantized = x, quantized
        return quantized


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               shared: tuple[SharedInput, str] | None = None) -> torch.Tensor:
    """``x @ W.T + b`` with ``W ~ weight [out, in] (FP8) * weight_scale [out, 1]`` and ``x`` quantised per token
    (through ``shared``, the group and this projection's name, when other projections read the same input)."""
    shape = x.shape
    x_fp8, x_scale = shared[0].of(x, shared[1]) if shared is not None else \
        quantize_activations(x.reshape(-1, shape[-1]))
    out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale.t(), out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], weight.shape[0])


class Fp8Linears:
    """The decoder layers' projections switched to `fp8_linear` over FP8 copies of their weights (module doc)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.linears: list[nn.Linear] = []
        self.shared: list[SharedInput] = []
        for layer in layers:
            for block_name, names in PROJECTIONS:
                block = getattr(layer, block_name)
                shared = SharedInput(last=SHARED_INPUTS[block_name][-1])
                self.shared.append(shared)
                for name in names:
                    linear = getattr(block, name)
                    if not isinstance(linear, nn.Linear):
                        raise ValueError(f"--rollout-fp8: {block_name}.{name} is a {type(linear).__name__}, not a "
                                         "linear layer")
                    self.linears.append(linear)
                    # plain attributes, not buffers: the model's state dict, weight-sync names and `.to()` stay
                    linear.fp8_weight, linear.fp8_scale = quantize_rows(linear.weight)
                    linear.fp8_shared = (shared, name) if name in SHARED_INPUTS[block_name] else None
                    linear.forward = types.MethodType(_fp8_forward, linear)

    def remove(self) -> None:
        """The linears back to their own forward, the FP8 copies dropped (the model serves another engine)."""
        for linear in self.linears:
            for name in ("forward", "fp8_weight", "fp8_scale", "fp8_shared"):
                linear.__dict__.pop(name, None)
        self.linears, self.shared = [], []

    @torch.no_grad()
    def requantize(self) -> None:
        """The FP8 copies from the current weights, in place (after a weight sync)."""
        for linear in self.linears:
            if linear.weight.numel():  # released weights (--offload-rollout) come back before the next sync
                quantize_rows(linear.weight, linear.fp8_weight, linear.fp8_scale)


def _fp8_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return fp8_linear(x, self.fp8_weight, self.fp8_scale, self.bias, self.fp8_shared)
