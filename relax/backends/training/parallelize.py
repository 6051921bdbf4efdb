"""Puts a model on the trainer's mesh (`mesh.ParallelDims`): the family's tensor-parallel plan on its language
model, then FSDP2 over the data ranks (each decoder layer a unit, then the whole), in that order (FSDP2 shards the
tensor-parallel DTensors further over the data axis: a 2-D layout)."""

from __future__ import annotations

import logging
import re

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from relax.backends.models.parallel_plans import COLWISE, HEADS_NORM, PLANS, ROWWISE
from relax.backends.models.registry import family_of
from relax.backends.training.mesh import TP_FLAG, ParallelDims

logger = logging.getLogger("relax")


def _style(kind: str):
    if kind == COLWISE:
        return ColwiseParallel()
    if kind == ROWWISE:
        return RowwiseParallel()
    if kind == HEADS_NORM:  # input [..., heads, head_dim] split by heads (dim -2)
        return SequenceParallel(sequence_dim=-2, use_local_output=True)
    raise ValueError(f"unknown tensor-parallel style {kind!r}")


def tensor_parallel_plan(hf_model: nn.Module):
    """The family's plan for ``hf_model`` (refused, naming the flag, where the family has none)."""
    family = family_of(hf_model.config.model_type)
    plan = PLANS[family.parallel_plan] if family is not None else None
    if plan is None or not plan.tensor:
        name = family.name if family is not None else f"model_type {hf_model.config.model_type!r}"
        raise ValueError(f"{TP_FLAG}: {name} has no tensor-parallel plan (docs/parallelism.md)")
    return plan


def _matches(name: str, pattern: str) -> bool:
    """``pattern``'s ``*`` stands for one name of the module path."""
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), name) is not None


def apply_tensor_parallel(decoder: nn.Module, hf_model: nn.Module, dims: ParallelDims) -> int:
    """Split ``decoder`` (``hf_model``'s language model) over the mesh's tensor axis; returns the modules split."""
    plan = tensor_parallel_plan(hf_model)
    # the plan's patterns resolved to the modules this model has (hybrid families: some layers lack attention)
    styles = {name: _style(kind) for name, _ in decoder.named_modules()
              for pattern, kind in plan.tensor.items() if _matches(name, pattern)}
    parallelize_module(decoder, dims.tp_mesh, styles)
    # DTensor warns that the 2-D (data x tensor) norm of the gradients and the gathers of weight sync take two
    # collectives where one would do: true, and negligible next to a step; not worth a line per step in the logs
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    logger.info("tensor parallel over %d ranks (%s plan): %d modules split", dims.tp, plan.name, len(styles))
    return len(styles)


def shard_model(model: nn.Module, compute_dtype: torch.dtype, dims: ParallelDims | None = None) -> None:
    """FSDP2 over the data ranks (all ranks when ``dims`` is None): each decoder layer, then the whole model."""
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    mesh = dims.fsdp_mesh if dims is not None else None
    layer_classes = set(getattr(model.hf_model, "_no_split_modules", None) or [])
    for module in model.hf_model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
