"""A sample left in the data plane, named by its row: what a trainer that passes keys, not payloads, decides on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax.data.sample import SampleStatus


@dataclass
class RowHandle:
    """A sample left in TransferQueue: what the trainer's reader decides on (its group, status and oldest weight
    version, from the row's metadata) and the row itself, which the process that trains on it reads
    (`TransferQueueDataPlane.samples_of`). The controller then passes keys, not payloads."""

    index: int
    group_index: int
    status: SampleStatus
    weight_version: int | None
    fetched: Any  # the BatchMeta of the poll that found the row, shared by the handles of that poll
    row: int  # the row's position in ``fetched``
