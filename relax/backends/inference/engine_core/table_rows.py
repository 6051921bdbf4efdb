"""The block tables of the decoding sequences as rows of one host array, kept from step to step.

A decode step hands the device every sequence's block table. Built from the sequences' lists at each step (a
batch of 256 sequences 768 tokens long is 12,000 Python ints), that was the largest share of the host's work per
step, and on the GPU the host's work per step is what a small model's decode waits for. A sequence's table
changes only when it opens a block (every ``block_size`` tokens), when a shared block is copied on write, or
when it is preempted and admitted again, so each sequence keeps one row here: a row is rewritten when its table
differs from the copy it was last written from, and a step gathers its batch's rows in one indexing.
"""

from __future__ import annotations

import numpy as np

from relax.backends.inference.engine_core.block_manager import RESERVED_BLOCK
from relax.backends.inference.engine_core.sequence import Sequence


class BlockTableRows:
    """``capacity`` rows of ``width`` block ids (`RESERVED_BLOCK` past a table's end), one per sequence that
    decoded at the last step; a sequence that leaves the batch gives its row back at the next step. ``capacity``
    is at least twice the largest batch, so a batch of new sequences finds rows while the last batch's are kept."""

    def __init__(self, capacity: int, width: int) -> None:
        self.width = width
        self.array = np.full((capacity, width), RESERVED_BLOCK, dtype=np.int64)
        self._lengths = np.zeros(capacity, dtype=np.int64)
        # sequence -> (its row, the table that row was written from)
        self._rows: dict[Sequence, tuple[int, list[int]]] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def rows(self, sequences: list[Sequence]) -> np.ndarray:
        """The row of each of ``sequences`` (int64), each row holding its sequence's current table."""
        if len(self._rows) > len(sequences) or len(self._rows) + len(sequences) > len(self.array):
            self._forget_all_but(sequences)
        indices = np.empty(len(sequences), dtype=np.int64)
        rows = self._rows
        for position, sequence in enumerate(sequences):
            table = sequence.block_table
            entry = rows.get(sequence)
            if entry is None or entry[1] != table:
                entry = self._write(sequence, table, entry[0] if entry is not None else self._free.pop())
            indices[position] = entry[0]
        return indices

    def clear(self) -> None:
        """Forget every sequence (the runner let its pool go): no finished request is kept alive by its row."""
        self._forget_all_but([])

    def longest(self, indices: np.ndarray) -> int:
        """The longest table among rows ``indices``."""
        return int(self._lengths[indices].max()) if len(indices) else 0

    def _write(self, sequence: Sequence, table: list[int], row: int) -> tuple[int, list[int]]:
        if len(table) > self.width:
            raise ValueError(f"request {sequence.request_id!r}: a block table of {len(table)} blocks is wider than "
                             f"the runner's {self.width}")
        self.array[row, :len(table)] = table
        self.array[row, len(table):self._lengths[row]] = RESERVED_BLOCK
        self._lengths[row] = len(table)
        entry = self._rows[sequence] = (row, list(table))
        return entry

    def _forget_all_but(self, sequences: list[Sequence]) -> None:
        keep = set(sequences)
        for sequence in [s for s in self._rows if s not in keep]:
            self._free.append(self._rows.pop(sequence)[0])
