"""Mixture-of-experts layers in the compute dtype, as grouped GEMMs over tokens sorted by expert.

Hugging Face MoE families (Qwen3-MoE, Qwen3.5-MoE, Qwen3-VL-MoE, DeepSeek-V3, ...) keep their experts as 3-D
parameters (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) and dispatch their forward through transformers'
``ExpertsInterface`` (``config._experts_implementation``). Its ``grouped_mm`` implementation is the right shape of
computation (one sort of the token-expert pairs, one grouped GEMM per projection), but it multiplies in the dtype
of the weights, and ``torch._grouped_mm`` has no autocast rule: a trainer that keeps float32 master weights and
computes under autocast ran every expert GEMM in float32 (Qwen3-30B-A3B's layer on the H200: 10% MFU).

`relax_grouped_mm`, registered under that name in the interface, is the same computation with the weights in the
compute dtype:

- with `MasterWeightCasts` (``--gradient-accumulation-fusion``, the default outside FSDP), each expert weight is
  cast once per step and its gradient is added into the float32 ``.grad`` per micro-batch (CUDA's grouped GEMM
  writes only its inputs' dtype in torch 2.11, "Grouped gemm output dtype must match `mat_a` dtype" on the H200: a
  micro-batch's expert gradient is a bf16 product, widened inside the add, as under autocast; float32 where a
  kernel offers it);
- under plain autocast, the weights are cast per call (autograd casts the gradient back);
- otherwise (FSDP2's bf16 parameters, float32 on CPU) it is transformers' computation as it is.

Under expert parallelism (`parallelize.apply_expert_parallel`) the sorted rows go to the rank that holds their
expert and come back by all-to-all (`dispatch_to_experts`); the rest is the same.

Routing replay hooks the routers, not the experts, so it works unchanged; so do LoRA (attention projections) and
the auxiliary load-balancing loss (router logits).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.tensor import DTensor
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

from relax.backends.training.master_weights import MasterWeightCasts

IMPLEMENTATION = "relax_grouped_mm"


def _grouped_mm(x: torch.Tensor, weight_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x[rows of group g] @ weight_t[g]`` for each group g (``offsets``: cumulative row counts)."""
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return grouped_mm(x, weight_t, offs=offsets)


_float32_output: bool | None = None  # whether this torch's CUDA grouped GEMM writes float32 from bf16 (found once)


def _weight_grads(grad_out: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``[E, out, in]``: per group, ``grad_out[rows].T @ x[rows]`` (float32 where the kernel can write it)."""
    global _float32_output
    if grad_out.is_cuda:  # one grouped GEMM over the shared (token) dimension
        if _float32_output is not False:
            try:
                product = torch._grouped_mm(grad_out.t(), x, offs=offsets, out_dtype=torch.float32)
                _float32_output = True
                return product
            except (RuntimeError, TypeError):  # a kernel without float32 output (torch 2.11): the bf16 product
                _float32_output = False
        return torch._grouped_mm(grad_out.t(), x, offs=offsets)
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    return torch.stack([grad_out[s:e].float().t() @ x[s:e].float() for s, e in zip(starts, ends)])


class _GroupedMasterLinear(torch.autograd.Function):
    """``x @ low_weight[g].T`` per group; the backward sums the weight gradient into ``weight.grad`` (float32)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, low_weight: torch.Tensor,
                offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, low_weight, offsets)
        ctx.master = weight  # a leaf parameter: kept for its .grad, not saved as an activation
        return _grouped_mm(x, low_weight.transpose(-2, -1), offsets)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, low_weight, offsets = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = _grouped_mm(grad_out, low_weight, offsets) if ctx.needs_input_grad[0] else None
        master = ctx.master
        if ctx.needs_input_grad[1]:
            grads = _weight_grads(grad_out, x, offsets)
            if master.grad is None:
                master.grad = grads.to(master.dtype)
            else:  # (a bf16 product is widened inside the add, not by a copy first)
                master.grad.add_(grads)
        return grad_x, None, None, None


def _sum_copies(rows: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[N * k, H]`` in token order to ``[N, H]``: each token's ``k`` rows summed, in float32 at least."""
    wide = torch.promote_types(rows.dtype, torch.float32)
    return rows.view(-1, top_k, rows.shape[-1]).sum(dim=1, dtype=wide).to(rows.dtype)


class _ToExpertRows(torch.autograd.Function):
    """Token rows ``[N, H]`` to token-expert rows ``[N * k, H]`` in expert order (row ``j`` is token
    ``order[j] // k``). The backward sums each token's ``k`` rows by gathering them (``unsorted``: the inverse of
    ``order``), where autograd's indexing backward would scatter-add with a sort."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, unsorted: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(unsorted)
        ctx.top_k = top_k
        return x[order // top_k]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (unsorted,) = ctx.saved_tensors
        return _sum_copies(grad[unsorted], ctx.top_k), None, None, None


class _FromExpertRows(torch.autograd.Function):
    """The inverse: token-expert rows in expert order ``[N * k, H]`` back to tokens, each token's ``k`` rows summed
    in float32 in a fixed order (``index_add_`` would sum with atomics on CUDA, not reproducibly); the backward
    gathers."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, order: torch.Tensor, unsorted: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.top_k = top_k
        return _sum_copies(rows[unsorted], top_k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        return grad[order // ctx.top_k], None, None, None


def _compute_dtype(module: nn.Module, x: torch.Tensor) -> torch.dtype:
    """The dtype the experts multiply in: the master weights' casts, autocast's, or the weights' own."""
    casts: MasterWeightCasts | None = getattr(module, "relax_master_weight_casts", None)
    if casts is not None:
        return casts.dtype
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return module.down_proj.dtype


def _linear(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The grouped projection of ``x`` by ``weight`` ``[E, out, in]`` in the compute dtype."""
    casts: MasterWeightCasts | None = getattr(module, "relax_master_weight_casts", None)
    if casts is not None and weight.dtype != casts.dtype:
        x = x.to(casts.dtype)
        low_weight = casts.cast(weight)
        if torch.is_grad_enabled() and weight.requires_grad:
            return _GroupedMasterLinear.apply(x, weight, low_weight, offsets)
        return _grouped_mm(x, low_weight.transpose(-2, -1), offsets)
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        weight, x = weight.to(dtype), x.to(dtype)
    return _grouped_mm(x.to(weight.dtype), weight.transpose(-2, -1), offsets)


def grouped_layout(module: nn.Module) -> bool:
    """Whether `relax_grouped_mm` computes ``module``'s layout (gated, concatenated, untransposed, no biases, no
    post-expert norm; the last two attributes are newer than transformers 5.17)."""
    return (module.has_gate and not module.has_bias and not module.is_transposed and module.is_concatenated
            and not getattr(module, "has_post_expert_norm", False)
            and not getattr(module, "_is_expert_parallel", False))


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight spread over the expert group (`expert_parallel`), or the weight."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def relax_grouped_mm_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward signature: ``hidden_states [N, H]``, ``top_k_index``/``top_k_weights``
    ``[N, k]``; returns ``[N, H]``."""
    if not grouped_layout(self):  # layouts this path does not know: transformers' own
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    top_k = top_k_index.shape[-1]
    # token-expert pairs sorted by expert, so that each expert's rows are contiguous
    expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    unsorted = torch.empty_like(order)
    unsorted[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(expert_ids, minlength=self.num_experts)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    # cast before the k-fold copy (the residual stream is float32 under master weights)
    routed = _ToExpertRows.apply(hidden_states.to(_compute_dtype(self, hidden_states)), order, unsorted, top_k)
    group = getattr(self, "relax_expert_group", None)
    if group is None:
        gate_up = _linear(self, routed, self.gate_up_proj, offsets)
        hidden = _linear(self, self._apply_gate(gate_up), self.down_proj, offsets)
    else:
        hidden = dispatch_to_experts(self, routed, counts, group)
    hidden = hidden * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(hidden.dtype)
    return _FromExpertRows.apply(hidden, order, unsorted, top_k).to(hidden_states.dtype)


def dispatch_to_experts(self: nn.Module, routed: torch.Tensor, counts: torch.Tensor,
                        group: dist.ProcessGroup) -> torch.Tensor:
    """Expert parallelism: ``routed`` ``[S, H]`` (this rank's token-expert rows, sorted by global expert; ``counts``
    per expert) go to the ranks that hold their experts (all-to-all), are computed there by the local experts, and
    come back in the same order (all-to-all). Rank r of the group holds experts ``[r * L, (r + 1) * L)``."""
    ranks = group.size()
    local = self.num_experts // ranks
    # how many rows every rank sends to each of this rank's experts: [ranks, L], source-major
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    send_splits = counts.view(ranks, local).sum(dim=1).tolist()  # (a host sync: the split sizes are host lists)
    receive_splits = received_counts.view(ranks, local).sum(dim=1).tolist()
    # (torch's differentiable all-to-all: its backward is the all-to-all the other way)
    received = wait_tensor(all_to_all_single_autograd(routed, receive_splits, send_splits, group))
    # received rows come by (source rank, local expert): regroup them by local expert for the grouped GEMMs
    expert_of_row = torch.arange(local, device=routed.device).repeat(ranks).repeat_interleave(received_counts)
    _, by_expert = torch.sort(expert_of_row, stable=True)
    back = torch.empty_like(by_expert)
    back[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
    offsets = torch.cumsum(received_counts.view(ranks, local).sum(dim=0), dim=0, dtype=torch.int32)
    rows = received[by_expert]
    gate_up = _linear(self, rows, _local(self.gate_up_proj), offsets)
    computed = _linear(self, self._apply_gate(gate_up), _local(self.down_proj), offsets)[back]
    return wait_tensor(all_to_all_single_autograd(computed, send_splits, receive_splits, group))


def use_grouped_experts(model: nn.Module) -> int:
    """Route the experts of ``model`` (and of its sub-models) through `relax_grouped_mm`; returns how many expert
    modules there are (0: a dense model, left as it is)."""
    experts = [module for module in model.modules() if is_experts(module)]
    if experts:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, relax_grouped_mm_experts_forward)
        for module in experts:
            module.config._experts_implementation = IMPLEMENTATION
    return len(experts)


def is_experts(module: nn.Module) -> bool:
    """A module built by transformers' ``use_experts_implementation`` (its forward dispatches on the config)."""
    return hasattr(module, "has_gate") and hasattr(module, "is_concatenated") and hasattr(module, "num_experts")


def set_master_weight_casts(model: nn.Module, casts: MasterWeightCasts) -> int:
    """Have the float32 experts of ``model`` take their compute-dtype weights from ``casts``; returns how many."""
    count = 0
    for module in model.modules():
        if is_experts(module) and module.down_proj.dtype == torch.float32:
            module.relax_master_weight_casts = casts
            count += 1
    return count
