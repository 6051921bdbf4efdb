"""A TransferQueue sampler that hands out whole GRPO groups, and every one that is ready.

TransferQueue's `GRPOGroupNSampler` assumes a fixed group size and consecutive global indexes,
and every built-in sampler returns exactly ``batch_size`` samples or nothing. The streaming reader
wants "all complete groups written so far", whatever their sizes. The writer tags each row with
``custom_meta = {"group_key", "group_size"}``; this sampler (running inside the controller actor)
returns the rows of every group whose members are all ready. Rows whose custom_meta has not
arrived yet (TransferQueue sets it right after the data) count as not ready.
"""

from __future__ import annotations

from typing import Any

from transfer_queue import BaseSampler


class WholeGroupSampler(BaseSampler):
    def sample(self, ready_indexes: list[int], batch_size: int, *args: Any, partition: Any = None,
               **kwargs: Any) -> tuple[list[int], list[int]]:
        """All ready rows of complete groups, groups in write order; ``batch_size`` is ignored."""
        custom_meta = partition.get_custom_meta(ready_indexes) if partition is not None else {}
        members: dict[str, list[int]] = {}
        sizes: dict[str, int] = {}
        for index in sorted(ready_indexes):
            meta = custom_meta.get(index) or {}
            if "group_key" not in meta:
                continue
            members.setdefault(meta["group_key"], []).append(index)
            sizes[meta["group_key"]] = meta["group_size"]
        chosen = [index for key, indexes in members.items() if len(indexes) == sizes[key] for index in indexes]
        return chosen, list(chosen)
