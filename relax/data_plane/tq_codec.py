"""`Sample` <-> TransferQueue columns.

TransferQueue's SimpleStorage keeps rows (samples) by columns (fields). The per-token lists go in
jagged int64/float32 columns (TransferQueue returns every non-scalar column as a jagged nested
tensor anyway; environment-notes §3 pitfall 2); everything else of a sample (prompt, label,
metadata, reward, status, multimodal inputs, ...) goes in one `NonTensorStack` column of dicts,
which TransferQueue pickles. A per-token column that is None on the sample is written empty and
listed in the record's ``none_fields`` so it decodes back to None. Rollout log-probs travel as
float32 (what the engine computes them in), so they come back rounded to float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

from relax.data.sample import Sample, SampleStatus

TOKEN_COLUMNS: dict[str, torch.dtype] = {
    "tokens": torch.int64,
    "loss_mask": torch.int64,
    "rollout_log_probs": torch.float32,
    "weight_version": torch.int64,
}
RECORD_COLUMN = "sample"
COLUMNS = [*TOKEN_COLUMNS, RECORD_COLUMN]


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


# Not in the record: the streaming roles' fields travel as columns of their own (`encode_fields`).
_NOT_RECORDED = {*TOKEN_COLUMNS, "stage_fields"}


def _record(sample: Sample) -> dict[str, Any]:
    """The sample's non-per-token fields, plus how to restore the per-token ones."""
    record = {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample) if f.name not in _NOT_RECORDED}
    record["status"] = sample.status.value
    record["none_fields"] = [name for name in TOKEN_COLUMNS if getattr(sample, name) is None]
    record["scalar_weight_version"] = isinstance(sample.weight_version, int)
    return record


def _jagged(rows: list[list], dtype: torch.dtype) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.tensor(row, dtype=dtype) for row in rows], layout=torch.jagged)


def encode_rows(samples: list[Sample], extra_records: list[dict] | None = None) -> TensorDict:
    """A TensorDict of ``len(samples)`` rows; ``extra_records`` are merged into each row's record."""
    columns: dict[str, Any] = {
        name: _jagged([_as_list(getattr(s, name)) for s in samples], dtype) for name, dtype in TOKEN_COLUMNS.items()
    }
    records = [_record(s) for s in samples]
    for record, extra in zip(records, extra_records or [{}] * len(samples), strict=True):
        record.update(extra)
    columns[RECORD_COLUMN] = NonTensorStack(*records)
    return TensorDict(columns, batch_size=len(samples))


def _rows(column: torch.Tensor) -> list[list]:
    """Per-row Python lists of a column that may come back jagged (nested) or dense."""
    parts = column.unbind() if column.is_nested else list(column)
    return [part.reshape(-1).tolist() for part in parts]


def decode_rows(data: TensorDict) -> list[dict[str, Any]]:
    """The records of ``data`` with the per-token columns put back (still dicts: markers are not samples)."""
    per_token = {name: _rows(data[name]) for name in TOKEN_COLUMNS}
    records = []
    for row, record in enumerate(data[RECORD_COLUMN]):
        record = dict(record)
        for name in TOKEN_COLUMNS:
            record[name] = None if name in record["none_fields"] else per_token[name][row]
        if record["scalar_weight_version"] and record["weight_version"] is not None:
            record["weight_version"] = record["weight_version"][0]
        records.append(record)
    return records


def encode_fields(fields: dict[str, list[torch.Tensor]]) -> TensorDict:
    """A streaming role's per-sample fields (one 1-D tensor per row) as jagged float32 columns."""
    rows = len(next(iter(fields.values())))
    return TensorDict({name: torch.nested.nested_tensor([v.detach().reshape(-1).float().cpu() for v in values],
                                                        layout=torch.jagged)
                       for name, values in fields.items()}, batch_size=rows)


def decode_field(column: torch.Tensor) -> list[torch.Tensor]:
    """The per-row tensors of a column written by `encode_fields`."""
    parts = column.unbind() if column.is_nested else list(column)
    return [part.reshape(-1).clone() for part in parts]


def record_to_sample(record: dict[str, Any]) -> Sample:
    names = {f.name for f in dataclasses.fields(Sample)}
    sample = Sample(**{name: value for name, value in record.items() if name in names})
    sample.status = SampleStatus(sample.status)
    return sample
