"""Low-precision compute from float32 master weights: one cast per step, weight gradients summed in float32 by
the GEMM itself (gradient-accumulation fusion, as Megatron-LM's ``--gradient-accumulation-fusion``).

The trainer keeps float32 parameters (AdamW's master weights) and computes in bf16. Under plain autocast every
``nn.Linear`` casts its weight in every forward, i.e. once per micro-batch, and its backward makes a bf16 weight
gradient that autograd casts to float32 and adds to ``.grad``: four passes over every parameter per micro-batch
besides the GEMMs. On the H200 profile of the Qwen3-4B shape (26 micro-batches of 8k tokens) those casts and adds
were 20% of the step's kernel time (``benchmarks/train_gpu.py --profile``). Here:

- `MasterWeightCasts` casts each weight once per scope (a train step, a no-grad pass: the weights do not change
  inside either) and hands the same bf16 copy to every micro-batch;
- `accumulate_grad` adds ``a @ b`` into the float32 ``.grad`` in one cuBLAS call (bf16 inputs, float32 output
  and accumulation, beta = 1), so no bf16 gradient is ever rounded: the sum is more exact than autocast's;
- `use_master_weight_linears` puts that forward and backward on a model's ``nn.Linear`` instances; the chunked
  LM head (`log_probs.token_log_probs`) takes the same casts and gradient path for the (often tied) head weight.

CUDA only (cuBLAS's mixed-dtype GEMM); elsewhere `accumulate_grad` computes the same sum in float32 by hand, which
is what the CPU tests compare against autocast's path.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn


class MasterWeightCasts:
    """Low-precision copies of float32 parameters: cached inside `scope`, made per call outside it."""

    def __init__(self, dtype: torch.dtype, share_input_gradients: bool = True):
        self.dtype = dtype
        # `shared_input_linears` sums the input gradient of linears of one input inside the GEMMs (False: autograd
        # adds them, the path before; `benchmarks/train_gpu.py`'s baseline)
        self.share_input_gradients = share_input_gradients
        self._cache: dict[int, torch.Tensor] | None = None  # by id: the parameters outlive any scope

    @contextlib.contextmanager
    def scope(self):
        """Cast each weight once until the scope ends; the weights must not change inside it."""
        if self._cache is not None:  # nested: the outer scope owns the cache
            yield
            return
        self._cache = {}
        try:
            yield
        finally:
            self._cache = None

    def cast(self, weight: torch.Tensor) -> torch.Tensor:
        if weight.dtype == self.dtype:
            return weight.detach()
        if self._cache is None:
            return weight.detach().to(self.dtype)
        low = self._cache.get(id(weight))
        if low is None:
            low = self._cache[id(weight)] = weight.detach().to(self.dtype)
        return low


def accumulate_grad(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``param.grad += a @ b``, in float32, with ``a`` and ``b`` in the compute dtype."""
    if not param.requires_grad:
        return
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        if param.grad is None:
            param.grad = torch.mm(a, b, out_dtype=param.dtype)
        else:
            torch.addmm(param.grad, a, b, out_dtype=param.dtype, out=param.grad)
        return
    product = a.to(param.dtype) @ b.to(param.dtype)
    if param.grad is None:
        param.grad = product
    else:
        param.grad.add_(product)


class _MasterWeightLinears(torch.autograd.Function):
    """``x @ low_weight.T`` for one or more linears of the input ``x``; the backward writes each weight gradient into
    its float32 ``weight.grad`` itself. With several (a layer's q/k/v projections, its gate and up projections) the
    input gradient is summed inside the GEMMs (``addmm`` with beta 1 into the first product) instead of by autograd,
    which adds the linears' input gradients one by one: on the 0.6B shape's H100 profile, three of the five bf16 adds
    of hidden-state gradients a layer made in the backward (55 us each a micro-batch)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        count = len(weights) // 2
        masters, lows = weights[:count], weights[count:]
        ctx.save_for_backward(x, *lows)
        ctx.masters = masters  # leaf parameters: kept for their .grad, not saved as activations
        return tuple(F.linear(x, low) for low in lows)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x, *lows = ctx.saved_tensors
        flat = [grad.reshape(-1, grad.shape[-1]) for grad in grads]
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(flat[0], lows[0])
            for grad, low in zip(flat[1:], lows[1:]):
                grad_x.addmm_(grad, low)
            grad_x = grad_x.view(x.shape)
        rows = x.reshape(-1, x.shape[-1])
        for master, grad in zip(ctx.masters, flat):
            accumulate_grad(master, grad.T, rows)
        return grad_x, *([None] * (2 * len(lows)))


def _master_weight_linears(x: torch.Tensor, linears: tuple[nn.Linear, ...],
                           casts: MasterWeightCasts) -> tuple[torch.Tensor, ...]:
    x = x.to(casts.dtype)
    lows = [casts.cast(linear.weight) for linear in linears]
    if torch.is_grad_enabled() and all(linear.weight.requires_grad for linear in linears):
        outs = _MasterWeightLinears.apply(x, *(linear.weight for linear in linears), *lows)
    else:
        outs = tuple(F.linear(x, low) for low in lows)
    # (autograd's cast of the bias: the bias learns)
    return tuple(out if linear.bias is None else out + linear.bias.to(casts.dtype)
                 for out, linear in zip(outs, linears))


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _master_weight_linears(x, (self,), self.relax_master_weight_casts)[0]


def shared_input_linears(x: torch.Tensor, linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(x) for linear in linears)``; their input gradient summed inside the GEMMs (`_MasterWeightLinears`)
    when every one is a master-weight linear of the same casts (`use_master_weight_linears`) whose weight trains, else
    each by its own forward (LoRA's adapters, FSDP's hooks, a frozen model)."""
    casts = getattr(linears[0], "relax_master_weight_casts", None)
    shared = casts is not None and casts.share_input_gradients and torch.is_grad_enabled() and all(
        getattr(linear, "relax_master_weight_casts", None) is casts and linear.weight.requires_grad
        and getattr(linear.forward, "__func__", None) is _linear_forward for linear in linears)
    if not shared:
        return tuple(linear(x) for linear in linears)
    return _master_weight_linears(x, linears, casts)


def use_master_weight_linears(model: nn.Module, casts: MasterWeightCasts) -> int:
    """Route every float32 ``nn.Linear`` of ``model`` through `casts` and `accumulate_grad` (these instances
    only; Hugging Face's class keeps its forward). Returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32:
            module.relax_master_weight_casts = casts
            module.forward = types.MethodType(_linear_forward, module)
            count += 1
    return count


def embed_in_compute_dtype(model: nn.Module, dtype: torch.dtype) -> bool:
    """Cast the token embedding's output to ``dtype``, so the residual stream and every activation after it are in
    the compute dtype, as under FSDP's mixed precision. A float32 embedding otherwise keeps the residual stream in
    float32 under autocast, and every linear casts its input down in the forward and its input gradient back up in
    the backward: on the H200 profile of the Qwen3-0.6B shape's step, a dozen copies of the hidden states per layer
    and micro-batch (`benchmarks/train_gpu.py --profile`). Returns whether the model has an input embedding."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embedding is None:
        return False

    def cast(module, inputs, output):
        return output.to(dtype) if torch.is_floating_point(output) else output

    embedding.register_forward_hook(cast)
    return True
