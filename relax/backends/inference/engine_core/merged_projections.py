"""The projections of a decoder layer that read the same input (q, k and v; gate and up) as one matrix product.

At decode batch sizes each projection is a small GEMM whose launch and tail cost more than its bytes: on an H200
a Qwen3-0.6B layer's q, k and v products took 3 x 5 us in the decode graph, where reading their weights takes 2 us.
One product over the stacked weights reads the same bytes in one kernel.

The stacked matrix is the only copy: each linear's own weight (and bias) becomes a view of its rows. A weight
update through the model's parameters (`EmbeddedEngine.update_weights`, an in-place copy) lands in the stacked
matrix, so the CUDA graphs captured on it stay valid, and no weight is held twice. When the engine lets its weights
go (`release_memory_occupation`) the parameters get storage of their own again; `merge` stacks them anew before
the next graphs are captured. A linear whose forward was replaced (FP8 rollout, a LoRA wrapper) keeps its own
product: the group is then computed one projection at a time.

A group also owns the layout its weights are stored in (`lay_out`): as the model stores them (``[out, in]``, row
after row) or column-major (the same shape, each input's column contiguous: what a plain ``x @ W`` reads). cuBLAS
picks a different kernel for each, and at decode batch sizes one can be faster by a fifth for a given shape and card
(`weight_layouts` measures which). The parameters stay views of the group's storage in either layout, so a weight
update's in-place copy reaches it and the captured graphs. A group of one linear (o, down) only lays it out.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional


class MergedLinears:
    """``linears`` as one product; calling it returns their outputs. Linears of different input widths, some with
    a bias and some without, or not plain `nn.Linear`s are called one by one."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.linears = linears
        self.column_major = False  # the model's own layout until `lay_out`
        self.widths = [getattr(linear, "out_features", 0) for linear in linears]
        # Only plain linears are stacked: a subclass or wrapper (a LoRA layer) computes more than its weight's product
        self.mergeable = (all(type(linear) is nn.Linear for linear in linears)
                          and len({linear.in_features for linear in linears}) == 1
                          and len({linear.bias is None for linear in linears}) == 1)
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.merge()

    def lay_out(self, column_major: bool) -> None:
        """Store the weights row-major (as the model does) or column-major from now on (and after every `merge`)."""
        if column_major == self.column_major:
            return
        self.column_major = column_major
        if self.weight is not None:  # re-stacked in the new layout; the old storage goes with its last reference
            self.weight = None
            self.merge()

    @property
    def merged(self) -> bool:
        """Whether the next call multiplies once (stacked, and no linear's forward replaced)."""
        return self.weight is not None and not any("forward" in linear.__dict__ for linear in self.linears)

    def merge(self) -> None:
        """Stack the linears' current weights (and biases) and point each at its rows, unless stacked already
        (`release` forgets the stack). Outside inference mode: the parameters are updated in place later, which
        inference tensors refuse."""
        if not self.mergeable or self.weight is not None:
            return
        with torch.inference_mode(False), torch.no_grad():
            self.weight = self._stack("weight")
            self.bias = self._stack("bias") if self.linears[0].bias is not None else None

    def release(self) -> None:
        """Let go of the stacked tensors (the parameters' views keep them until the parameters are replaced)."""
        self.weight = self.bias = None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if not self.merged:
            return [linear(x) for linear in self.linears]
        return list(functional.linear(x, self.weight, self.bias).split(self.widths, dim=-1))

    def _stack(self, name: str) -> torch.Tensor:
        parts = [getattr(linear, name) for linear in self.linears]
        column_major = self.column_major and name == "weight"
        if len(parts) == 1 and not column_major and parts[0].is_contiguous():
            return parts[0].detach()  # nothing to stack or lay out: the parameter's own storage
        # [out, in] as the model stores it, or with strides (1, out): each linear's rows are a view either way
        shape = (sum(part.shape[0] for part in parts), *parts[0].shape[1:])
        stacked = torch.empty(shape[::-1], dtype=parts[0].dtype, device=parts[0].device).t() if column_major \
            else torch.empty(shape, dtype=parts[0].dtype, device=parts[0].device)
        offset = 0
        for part in parts:
            width = part.shape[0]
            stacked[offset:offset + width].copy_(part.detach())
            part.data = stacked[offset:offset + width]  # the old storage goes with its last reference
            offset += width
        return stacked


class LayerGroups(NamedTuple):
    """A decoder layer's products by the input they read: q/k/v (the normed hidden states), o (the attention's
    output), gate/up (the normed hidden states) and down (the gated product). None where the MLP has no such
    projections."""

    qkv: MergedLinears
    o: MergedLinears
    gate_up: MergedLinears | None
    down: MergedLinears | None


def layer_groups(layer: nn.Module) -> LayerGroups:
    attention, mlp = layer.self_attn, layer.mlp
    gated = all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj"))
    return LayerGroups(MergedLinears([attention.q_proj, attention.k_proj, attention.v_proj]),
                       MergedLinears([attention.o_proj]),
                       MergedLinears([mlp.gate_proj, mlp.up_proj]) if gated else None,
                       MergedLinears([mlp.down_proj]) if gated else None)
