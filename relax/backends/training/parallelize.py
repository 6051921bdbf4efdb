"""Puts a model on the trainer's mesh (`mesh.ParallelDims`), in this order: the family's tensor-parallel plan on its
language model (and its LM head split by vocabulary, unless it is the token embedding), its experts spread over the expert axis, then FSDP2 over the data (and context) ranks, each decoder
layer a unit, then the whole; FSDP2 shards the DTensors of the first two further (2-D layouts). Context parallelism
changes no module: it lives in the attention function and the trainer's inputs (`context_parallel`)."""

from __future__ import annotations

import logging
import re

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from relax.backends.models.parallel_plans import COLWISE, HEADS_NORM, PLANS, ROWWISE
from relax.backends.models.registry import family_of
from relax.backends.training.grouped_experts import IMPLEMENTATION, grouped_layout, is_experts
from relax.backends.training.mesh import EP_FLAG, SP_FLAG, TP_FLAG, ParallelDims
from relax.backends.training.response_model import language_model, ties_embeddings

logger = logging.getLogger("relax")


# A block's last projection: under sequence parallelism it reduce-scatters over the tokens instead of all-reducing
# (a projection inside a mixture-of-experts block, a shared expert's, keeps its all-reduce: the block's output is
# sliced as a whole).
_BLOCK_OUTPUTS = ("layers.*.self_attn.o_proj", "layers.*.mlp.down_proj")


def _style(kind: str, name: str = "", sequence_parallel: bool = False):
    if kind == COLWISE:
        return ColwiseParallel()
    if kind == ROWWISE:
        if sequence_parallel and any(_matches(name, pattern) for pattern in _BLOCK_OUTPUTS):
            return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        return RowwiseParallel()
    if kind == HEADS_NORM:  # input [..., heads, head_dim] split by heads (dim -2)
        return SequenceParallel(sequence_dim=-2, use_local_output=True)
    raise ValueError(f"unknown tensor-parallel style {kind!r}")


def tensor_parallel_plan(config):
    """The family's plan for a model of ``config`` (refused, naming the flag, where the family has none)."""
    family = family_of(config.model_type)
    plan = PLANS[family.parallel_plan] if family is not None else None
    if plan is None or not plan.tensor:
        name = family.name if family is not None else f"model_type {config.model_type!r}"
        raise ValueError(f"{TP_FLAG}: {name} has no tensor-parallel plan (docs/parallelism.md)")
    return plan


def _matches(name: str, pattern: str) -> bool:
    """``pattern``'s ``*`` stands for one name of the module path."""
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), name) is not None


# The decoder layer a sequence-parallel plan knows: a norm before attention and one before the MLP, which is a dense
# MLP with its output projection named down_proj or a mixture-of-experts block (Llama, Qwen2.5, Qwen3, Qwen3-MoE).
_SEQUENCE_PARALLEL_LAYER = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def _sequence_parallel_styles(decoder: nn.Module) -> dict[str, object]:
    """Megatron's sequence parallelism around the plan's projections: the embedding's output, every norm, residual and
    the final norm hold 1/T of the row's tokens (``Shard(1)``); each block gathers them before its column-parallel
    projections and its row-parallel projection reduce-scatters (not all-reduces) back; the final norm's output is
    gathered for the LM head. A mixture-of-experts block gets its whole input (as under tensor parallelism alone: its
    experts are not split by it) and its output is sliced."""
    styles = {}
    for index, layer in enumerate(decoder.layers):
        children = {name for name, _ in layer.named_children()}
        norms = {name for name, module in layer.named_children() if "norm" in type(module).__name__.lower()}
        if not set(_SEQUENCE_PARALLEL_LAYER) <= children or norms - set(_SEQUENCE_PARALLEL_LAYER):
            raise ValueError(f"{SP_FLAG}: {type(layer).__name__} (layer {index}) is not a pre-norm attention + MLP "
                             "block, the layout sequence parallelism is built for (Llama, Qwen2.5, Qwen3, Qwen3-MoE)")
        prefix = f"layers.{index}"
        styles[f"{prefix}.input_layernorm"] = SequenceParallel()
        styles[f"{prefix}.post_attention_layernorm"] = SequenceParallel()
        styles[f"{prefix}.self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                           desired_input_kwarg_layouts={"hidden_states": Replicate()})
        if hasattr(layer.mlp, "down_proj"):  # its down projection reduce-scatters (`_BLOCK_OUTPUTS`)
            styles[f"{prefix}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        else:  # a mixture-of-experts block: plain tensors in and out, its output sliced by token
            styles[f"{prefix}.mlp"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=False)
    return styles


def apply_tensor_parallel(hf_model: nn.Module, dims: ParallelDims, sequence_parallel: bool = False) -> int:
    """Split ``hf_model``'s language model over the mesh's tensor axis (with ``sequence_parallel``, the activations
    between the blocks' projections too, by token); returns the modules split."""
    plan = tensor_parallel_plan(hf_model.config)
    decoder = language_model(hf_model)
    # the plan's patterns resolved to the modules this model has (hybrid families: some layers lack attention)
    styles = {name: _style(kind, name, sequence_parallel) for name, _ in decoder.named_modules()
              for pattern, kind in plan.tensor.items() if _matches(name, pattern)}
    if sequence_parallel:
        styles.update(_sequence_parallel_styles(decoder))
        # the embedding's output kept by token slice; the final norm on slices, its output gathered for the head
        styles["embed_tokens"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                                     use_local_output=False)
        styles["norm"] = SequenceParallel()
    parallelize_module(decoder, dims.tp_mesh, styles)
    if sequence_parallel:  # (a second style on the final norm: its hooks run after SequenceParallel's)
        parallelize_module(decoder.norm, dims.tp_mesh, PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True))
    head = hf_model.get_output_embeddings()
    vocab_parallel = head is not None and not ties_embeddings(hf_model)
    if vocab_parallel:
        # split by vocabulary: each rank computes its slice of the logits (`vocab_parallel`); a head that is the
        # token embedding stays whole (the embedding would have to be split the same way)
        parallelize_module(head, dims.tp_mesh, ColwiseParallel(output_layouts=Shard(-1)))
    # DTensor warns that the 2-D (data x tensor) norm of the gradients and the gathers of weight sync take two
    # collectives where one would do: true, and negligible next to a step; not worth a line per step in the logs
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    logger.info("tensor parallel over %d ranks (%s plan): %d modules split%s%s", dims.tp, plan.name, len(styles),
                ", the LM head by vocabulary" if vocab_parallel else "",
                ", activations between blocks by token (sequence parallel)" if sequence_parallel else "")
    return len(styles) + vocab_parallel


def apply_expert_parallel(hf_model: nn.Module, dims: ParallelDims) -> int:
    """Spread every MoE layer's experts over the mesh's expert axis (rank r of a group holds experts
    ``[r * E / ep, (r + 1) * E / ep)``, as DTensors sharded on the expert dimension); their forward exchanges tokens
    with the group (`grouped_experts.dispatch_to_experts`). Returns the expert modules spread."""
    experts = [module for module in hf_model.modules() if is_experts(module)]
    for module in experts:
        if module.config._experts_implementation != IMPLEMENTATION or not grouped_layout(module):
            raise ValueError(f"{EP_FLAG} {dims.ep}: {type(module).__name__} does not run on Relax's grouped experts "
                             "(a layout with biases or transposed weights, or --no-moe-grouped-gemm)")
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), dims.ep_mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.relax_expert_group = dims.ep_mesh.get_group()
    logger.info("expert parallel over %d ranks: %d MoE layers, %d experts per rank", dims.ep, len(experts),
                experts[0].num_experts // dims.ep if experts else 0)
    return len(experts)


def shard_model(model: nn.Module, compute_dtype: torch.dtype, dims: ParallelDims | None = None) -> None:
    """FSDP2 over the data ranks (all ranks when ``dims`` is None): experts spread by expert parallelism over the
    data ranks outside their group, then each decoder layer, then the whole model."""
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    mesh = dims.fsdp_mesh if dims is not None else None
    if dims is not None and dims.ep > 1:
        for module in model.hf_model.modules():
            if getattr(module, "relax_expert_group", None) is not None:
                # (their gradients are averaged over the ranks this mesh spans; the trainer corrects that by the
                # expert group's size after the reduction: `FSDPTrainBackend.end_step`)
                fully_shard(module, mesh=dims.expert_fsdp_mesh, mp_policy=policy)
    layer_classes = set(getattr(model.hf_model, "_no_split_modules", None) or [])
    # innermost first: a family may list a tower beside its layers (Qwen3-Omni's audio encoder), and FSDP2 takes a
    # module's parameters that no unit inside it took
    for module in reversed(list(model.hf_model.modules())):
        if type(module).__name__ in layer_classes:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
