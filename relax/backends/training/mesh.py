"""The trainer's layout over its processes: one `DeviceMesh` whose axes are pipeline, data replicate, data shard,
context and tensor (``pp, dp_replicate, dp_shard, cp, tp``, outermost first; torchtitan's order), every axis present
even at size 1, so that code asks for an axis by name whatever the layout.

- data (``dp_replicate x dp_shard``): each data rank trains on its share of the batch; FSDP2 shards parameters,
  gradients and optimizer state over ``dp_shard`` (and replicates them over ``dp_replicate``, HSDP);
- tensor (``--tensor-model-parallel-size``): the family's plan (`relax.backends.models.parallel_plans`) splits
  attention heads and MLP columns; the ranks of a tensor group see the same tokens;
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

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
TP_FLAG = "--tensor-model-parallel-size"
EP_FLAG = "--expert-model-parallel-size"


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

    @property
    def trivial(self) -> bool:
        """Data parallelism only (the layout before the mesh)."""
        return self.tp == self.ep == self.cp == self.pp == self.dp_replicate == 1

    def check(self, config=None) -> None:
        """Raise ValueError naming the flag when the layout does not fit the world or ``config`` (a transformers
        config: heads, key-value heads and experts must divide among the ranks that split them)."""
        inner = self.pp * self.dp_replicate * self.cp * self.tp
        if self.world_size % inner:
            raise ValueError(f"{TP_FLAG} {self.tp} (x context {self.cp} x pipeline {self.pp} x data replicate "
                             f"{self.dp_replicate}) does not divide the {self.world_size} training processes")
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
        if self.ep > 1:
            experts = getattr(text, "num_experts", None) or getattr(text, "n_routed_experts", None) or \
                getattr(text, "num_local_experts", None)
            if not experts:
                raise ValueError(f"{EP_FLAG} {self.ep}: {type(config).__name__} has no experts to distribute")
            if experts % self.ep:
                raise ValueError(f"{EP_FLAG} {self.ep} does not divide the model's {experts} experts")

    @cached_property
    def mesh(self) -> DeviceMesh:
        """The mesh over the default group's ranks (built once, collectively)."""
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return init_device_mesh(device_type, tuple(getattr(self, axis) for axis in AXES), mesh_dim_names=AXES)

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """What FSDP2 shards (and replicates) over."""
        return self.mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else self.mesh["dp_shard"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_rank(self) -> int:
        """This process's share of the batch."""
        return self.mesh["dp_replicate"].get_local_rank() * self.dp_shard + self.mesh["dp_shard"].get_local_rank()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The data ranks' group (the ranks whose metrics differ), for sums of metrics."""
        if self.dp_replicate > 1:
            return self.mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()
        return self.mesh["dp_shard"].get_group()
