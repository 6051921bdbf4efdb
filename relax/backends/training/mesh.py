"""The trainer's layout over its processes: one `DeviceMesh` whose axes are pipeline, data replicate, data shard
(split in two: the ranks outside and inside an expert group), context and tensor (``pp, dp_replicate,
dp_shard_mod_ep, ep, cp, tp``, outermost first; torchtitan's order), every axis present even at size 1, so that
code asks for an axis by name whatever the layout.

- pipeline (``--pipeline-model-parallel-size``): each rank of a pipeline group holds a contiguous stage of the decoder
  layers (`pipeline`); the ranks of one stage form the other axes, and every collective of those axes stays within
  one stage;
- data (``dp_replicate x dp_shard``): each data rank trains on its share of the batch; FSDP2 shards parameters,
  gradients and optimizer state over ``dp_shard`` and, with ``--data-parallel-replicate-size`` R > 1, keeps R
  replicas of that sharding (HSDP: shards within a replica group, e.g. one node; gradients reduce-scattered within it
  and all-reduced across replicas);
- tensor (``--tensor-model-parallel-size``): the family's plan (`relax.backends.models.parallel_plans`) splits
  attention heads and MLP columns; the ranks of a tensor group see the same tokens;
- context (``--context-parallel-size``): the ranks of a context group hold the same samples and split each packed
  row's tokens; attention trades tokens for heads (Ulysses, `context_parallel`); FSDP2 shards over them too;
- experts (``--expert-model-parallel-size``): borrowed from ``dp_shard`` (each expert group's ranks hold different
  experts and exchange tokens), as torchtitan does.

`ParallelDims.check` names the flag and the reason for a layout that cannot be built (sizes that do not divide the
world, the heads, the key-value heads or the experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")
TP_FLAG = "--tensor-model-parallel-size"
EP_FLAG = "--expert-model-parallel-size"
CP_FLAG = "--context-parallel-size"
PP_FLAG = "--pipeline-model-parallel-size"
DP_REPLICATE_FLAG = "--data-parallel-replicate-size"
SP_FLAG = "--sequence-parallel"


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    tp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    cp: int = 1
    pp: int = 1

    @property
    def dp_shard(self) -> int:
        return self.world_size // (self.pp * self.dp_replicate * self.cp * self.tp)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many shares the batch is split into."""
        return self.dp_replicate * self.dp_shard

    def check(self, config=None) -> None:
        """Raise ValueError naming the flag when the layout does not fit the world or ``config`` (a transformers
        config: heads, key-value heads and experts must divide among the ranks that split them)."""
        inner = self.pp * self.dp_replicate * self.cp * self.tp
        if self.world_size % inner:
            raise ValueError(f"{PP_FLAG} {self.pp} x {DP_REPLICATE_FLAG} {self.dp_replicate} x {TP_FLAG} {self.tp} x "
                             f"{CP_FLAG} {self.cp} does not divide the {self.world_size} training processes")
        if self.dp_replicate > 1 and self.ep > 1:
            raise ValueError(f"{DP_REPLICATE_FLAG} with {EP_FLAG} is not built yet (docs/parallelism.md)")
        if self.ep > 1 and self.cp > 1:
            raise ValueError(f"{EP_FLAG} with {CP_FLAG} is not built yet")
        if self.pp > 1 and self.cp > 1:
            raise ValueError(f"{PP_FLAG} with {CP_FLAG} is not built yet (docs/parallelism.md)")
        if self.ep > 1 and self.dp_shard % self.ep:
            raise ValueError(f"{EP_FLAG} {self.ep} must divide the data-parallel shard size {self.dp_shard} "
                             f"(experts borrow the data ranks: {self.world_size} processes / tensor {self.tp})")
        if config is None:
            return
        text = config.get_text_config()
        if self.tp > 1:
            for field in ("num_attention_heads", "num_key_value_heads"):
                count = getattr(text, field, None)
                if count is not None and count % self.tp:
                    raise ValueError(f"{TP_FLAG} {self.tp} does not divide the model's {field} ({count}): each "
                                     "tensor-parallel rank computes whole heads")
        heads = getattr(text, "num_attention_heads", None)
        if self.cp > 1 and heads is not None and heads % (self.tp * self.cp):
            raise ValueError(f"{CP_FLAG} {self.cp} does not divide the {heads // self.tp} attention heads of a "
                             "tensor-parallel rank: Ulysses gives each context rank whole heads")
        if self.ep > 1:
            experts = getattr(text, "num_experts", None) or getattr(text, "n_routed_experts", None) or \
                getattr(text, "num_local_experts", None)
            if not experts:
                raise ValueError(f"{EP_FLAG} {self.ep}: {type(config).__name__} has no experts to distribute")
            if experts % self.ep:
                raise ValueError(f"{EP_FLAG} {self.ep} does not divide the model's {experts} experts")

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard // self.ep

    @cached_property
    def mesh(self) -> DeviceMesh:
        """The mesh over the default group's ranks; built once, collectively."""
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return init_device_mesh(device_type, tuple(getattr(self, axis) for axis in AXES), mesh_dim_names=AXES)

    @cached_property
    def _flattened(self) -> dict[str, DeviceMesh]:
        """Products of axes the layout uses as one: ``dp_shard_cp`` (both halves of the data-shard axis and the context
        axis: what FSDP2 shards over) and ``dp`` (all data ranks) (`_flatten`: private in torch 2.13, what torchtitan
        uses)."""
        mesh = self.mesh
        return {"dp_shard_cp": mesh["dp_shard_mod_ep", "ep", "cp"]._flatten("dp_shard_cp"),
                "dp": mesh["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp")}

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """What FSDP2 shards the dense weights over: the data ranks and the context ranks (which hold the same
        samples, different tokens); with replicas, a 2-D mesh (replicate, shard): FSDP2's HSDP."""
        shard = self._flattened["dp_shard_cp"]  # (also defines the flattened axis the 2-D slice names)
        return self.mesh["dp_replicate", "dp_shard_cp"] if self.dp_replicate > 1 else shard

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """This rank's pipeline: one rank of each stage, holding the same data."""
        return self.mesh["pp"].get_group()

    @cached_property
    def end_stages_group(self) -> dist.ProcessGroup | None:
        """This rank's pipeline's first and last stage, a group of two (None on the stages between). Collective: every
        rank builds every pipeline's pair."""
        ranks = self.mesh.mesh  # [pp, ...] global ranks
        pairs = [list(pair) for pair in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist())]
        group, _ = dist.new_subgroups_by_enumeration(pairs)
        return group

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.mesh["cp"].get_group()

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """What FSDP2 shards the experts over: the data ranks outside their expert group."""
        return self.mesh["dp_shard_mod_ep"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def ep_mesh(self) -> DeviceMesh:
        return self.mesh["ep"]

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.mesh["pp"].get_local_rank()

    @property
    def dp_rank(self) -> int:
        """This process's share of the batch."""
        return self._flattened["dp"].get_local_rank()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The data ranks' group (the ranks whose metrics differ), for sums of metrics."""
        return self._flattened["dp"].get_group()
