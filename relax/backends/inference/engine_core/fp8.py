"""FP8 rollout (``--rollout-fp8``): the engine core's linear layers multiply in FP8 (e4m3).

Decoding is bound by reading the weights: at batch 256 a bf16 step of the Qwen3-4B shape reads 8 GB of weights
and little else. In FP8 each weight is one byte, so the GEMMs read half as much; the activations are quantised per
token on the fly (one scale per row, like the weights' one scale per output channel), and ``torch._scaled_mm``
multiplies the two FP8 operands with the scales applied in its epilogue, writing the model's dtype.

What stays in the model's dtype: embeddings, norms, rotary tables, attention (over the KV pool, FP8 only with
``--kv-cache-dtype fp8_e4m3``) and the LM head
(the sampled distribution is most sensitive to it, and it is one layer). The projections of every decoder layer
(q, k, v, o, gate, up, down) are quantised.

The projections that read the same input (q, k and v; gate and up) are one product over their stacked FP8 weights
(`SharedProduct`): a layer quantises four activations, not seven, and runs four GEMMs. On CUDA each quantisation is
one Triton kernel (`triton_ops.quantize_rows_fp8`, the same arithmetic as
`quantize_rows`): written with torch operations it was six small kernels per projection, which cost more GPU time
than the layer's GEMMs (docs/engines.md).

On the fused decoder (CUDA) a layer runs its FP8 products through `Fp8LayerProducts` instead: each GEMM multiplies
with unit scales (one per tensor), which cuBLAS runs faster than with row-wise ones at decode batch sizes (a 4B
layer's four products at 256 rows: 59 against 80 us on the H200, `benchmarks.fp8_gemm_gpu`), and returns a
`ScaledProduct`; the kernels that read the products (q/k-norm + rotary + store, SiLU-mul, the residual add +
RMSNorm) apply each token's and each output channel's scale as they load it, in float32, so the quantisation is
the same (per token, per channel) and only the order of one rounding changes. The RMSNorm kernel quantises its
rows for the next products and SiLU-mul's are quantised from the block maxima it writes, so a layer launches one
row-wise quantisation kernel (the attention's output), not four (docs/engines.md).

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

from relax.backends.inference.engine_core.fp8_format import FP8_MAX, Fp8Rows, ScaledProduct, quantize_rows
from relax.backends.inference.engine_core.fp8_format import MIN_SCALE as _MIN_SCALE

PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
# The projections of a block that read the same input (the others read their own: o after attention, down after
# the gated product).
SHARED_INPUTS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


def quantize_activations(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of ``rows [T, H]``, in one Triton kernel on CUDA."""
    if rows.is_cuda:
        from relax.backends.inference.engine_core.triton_ops import quantize_rows_fp8

        return quantize_rows_fp8(rows.contiguous(), FP8_MAX, _MIN_SCALE)
    return quantize_rows(rows)


class SharedProduct:
    """The FP8 product of a group of projections that read the same input (q, k, v; gate, up), over their stacked
    weights: computed by the first of them called (one quantisation of the input, one GEMM), each taking its own
    columns as a view, and let go by the group's last (the models call them in that order; another order computes
    it again, never reuses a stale input). One GEMM instead of three: at 256 rows on an H200 the 4B shape's q, k and
    v took 10.4 us stacked against 30.3 us one by one, gate and up 29.4 against 37.1 (docs/engines.md)."""

    def __init__(self, linears: dict[str, nn.Linear]) -> None:
        self.names = list(linears)
        self.last = self.names[-1]
        self.widths = [linear.out_features for linear in linears.values()]
        # the stacked FP8 weights and scales are the only copies: each linear's are views of its rows, so
        # `Fp8Linears.requantize` writes into them in place
        self.weight, self.scale = quantize_rows(torch.cat([linear.weight.detach() for linear in linears.values()]))
        offset = 0
        for linear, width in zip(linears.values(), self.widths):
            linear.fp8_weight, linear.fp8_scale = self.weight[offset:offset + width], self.scale[offset:offset + width]
            offset += width
        self.linears = list(linears.values())
        self.source: torch.Tensor | None = None  # held while reused: no other tensor can take its identity
        self.outputs: dict[str, torch.Tensor] = {}

    def of(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if self.source is not x:
            out = fp8_linear(x, self.weight, self.scale, None)
            # each projection adds its own bias (Qwen2's q, k and v have one), the parameter a weight sync writes
            self.outputs = {name: part if linear.bias is None else part + linear.bias
                            for name, linear, part in zip(self.names, self.linears, out.split(self.widths, dim=-1))}
        result = self.outputs[name]
        if name == self.last:  # nothing else reads it: a prefill's activations are not kept past the layer
            self.source, self.outputs = None, {}
        else:
            self.source = x
        return result


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` with ``W ~ weight [out, in] (FP8) * weight_scale [out, 1]`` and ``x`` quantised per token."""
    shape = x.shape
    x_fp8, x_scale = quantize_activations(x.reshape(-1, shape[-1]))
    out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale.t(), out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], weight.shape[0])


def unscaled_product(rows: Fp8Rows, weight: torch.Tensor, column_scales: torch.Tensor, one: torch.Tensor,
                     dtype: torch.dtype) -> ScaledProduct:
    """``rows`` times the FP8 ``weight [out, in]`` with unit scales (``one``, a float32 scalar on the device), the
    scales left to the reader."""
    product = torch._scaled_mm(rows.values, weight.t(), scale_a=one, scale_b=one, out_dtype=dtype)
    return ScaledProduct(product, rows.scales, column_scales)


class Fp8LayerProducts:
    """One decoder layer's FP8 products for the fused forward (module doc), the interface of `decoder.LayerProducts`:
    `qkv` and `mlp` take the rows the RMSNorm kernel quantised (`mlp`: gate/up, SiLU-mul, the quantisation of its
    rows, down), `o` the attention's output; each returns `ScaledProduct`s over the FP8 weights `Fp8Linears` keeps
    (and requantises in place)."""

    quantized = True

    def __init__(self, layer: nn.Module, qkv: SharedProduct, gate_up: SharedProduct, one: torch.Tensor) -> None:
        self.qkv_weight, self.qkv_scales, self.qkv_widths = qkv.weight, qkv.scale.view(-1), qkv.widths
        self.gate_up_weight, self.gate_up_scales = gate_up.weight, gate_up.scale.view(-1)
        o_proj, down_proj = layer.self_attn.o_proj, layer.mlp.down_proj
        self.o_weight, self.o_scales = o_proj.fp8_weight, o_proj.fp8_scale.view(-1)
        self.down_weight, self.down_scales = down_proj.fp8_weight, down_proj.fp8_scale.view(-1)
        self.dtype, self.one = o_proj.weight.dtype, one

    def qkv(self, hidden: Fp8Rows) -> list[ScaledProduct]:
        return unscaled_product(hidden, self.qkv_weight, self.qkv_scales, self.one, self.dtype).split(self.qkv_widths)

    def o(self, attended: torch.Tensor) -> ScaledProduct:
        rows = Fp8Rows(*quantize_activations(attended.reshape(attended.shape[0], -1)))
        return unscaled_product(rows, self.o_weight, self.o_scales, self.one, self.dtype)

    def mlp(self, hidden: Fp8Rows) -> ScaledProduct:
        from relax.backends.inference.engine_core.triton_ops import silu_mul_quantized

        gate_up = unscaled_product(hidden, self.gate_up_weight, self.gate_up_scales, self.one, self.dtype)
        width = gate_up.product.shape[1] // 2
        rows = silu_mul_quantized(*gate_up.split([width, width]))
        return unscaled_product(rows, self.down_weight, self.down_scales, self.one, self.dtype)


class Fp8Linears:
    """The decoder layers' projections switched to `fp8_linear` over FP8 copies of their weights, those that read
    one input as one `SharedProduct` (module doc)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = list(layers)
        self.linears: list[nn.Linear] = []
        self.products: list[SharedProduct] = []
        for layer in layers:
            for block_name, names in PROJECTIONS:
                block = getattr(layer, block_name)
                for name in names:
                    linear = getattr(block, name)
                    if not isinstance(linear, nn.Linear):
                        raise ValueError(f"--rollout-fp8: {block_name}.{name} is a {type(linear).__name__}, not a "
                                         "linear layer")
                    self.linears.append(linear)
                    # plain attributes, not buffers: the model's state dict, weight-sync names and `.to()` stay
                    if name not in SHARED_INPUTS[block_name]:
                        linear.fp8_weight, linear.fp8_scale = quantize_rows(linear.weight)
                        linear.fp8_shared = None
                    linear.forward = types.MethodType(_fp8_forward, linear)
                group = {name: getattr(block, name) for name in SHARED_INPUTS[block_name]}
                product = SharedProduct(group)
                self.products.append(product)
                for name, linear in group.items():
                    linear.fp8_shared = (product, name)

    def layer_products(self) -> list[Fp8LayerProducts] | None:
        """Each layer's `Fp8LayerProducts` for the fused forward; None where a projection has a bias (Qwen2's q, k
        and v), which the kernels that apply the scales do not add: such models keep the linears' own forwards."""
        if any(linear.bias is not None for linear in self.linears) or len(self.products) != 2 * len(self.layers):
            return None
        parameter = self.linears[0].weight
        one = torch.ones((), dtype=torch.float32, device=parameter.device)
        return [Fp8LayerProducts(layer, qkv, gate_up, one)
                for layer, qkv, gate_up in zip(self.layers, self.products[0::2], self.products[1::2])]

    def remove(self) -> None:
        """The linears back to their own forward, the FP8 copies dropped (the model serves another engine)."""
        for linear in self.linears:
            for name in ("forward", "fp8_weight", "fp8_scale", "fp8_shared"):
                linear.__dict__.pop(name, None)
        self.layers, self.linears, self.products = [], [], []

    @torch.no_grad()
    def requantize(self) -> None:
        """The FP8 copies from the current weights, in place (after a weight sync; a stacked group's rows through
        its linears' views)."""
        for linear in self.linears:
            if linear.weight.numel():  # released weights (--offload-rollout) come back before the next sync
                quantize_rows(linear.weight, linear.fp8_weight, linear.fp8_scale)


def _fp8_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if self.fp8_shared is not None:
        product, name = self.fp8_shared
        return product.of(x, name)
    return fp8_linear(x, self.fp8_weight, self.fp8_scale, self.bias)
