"""metrics.jsonl, the record every view of a run (plots, resume, reports) reads: its name, JSON-safe values, and reading it back."""

from __future__ import annotations

import enum
import json
import logging
import math
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


logger = logging.getLogger(__name__)


def to_json_safe(value: Any) -> Any:
    """Convert ``value`` to plain JSON types, so a dump never fails and never writes a non-standard ``NaN`` token.

    Enums become their value, tensors and numpy arrays or scalars become (nested) Python numbers, non-finite floats
    become ``None`` (JSON null), paths become strings, and any other object becomes its ``str()``: a sample dump is a
    record for humans, and an odd object in ``metadata`` must not crash the run that produced it.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, enum.Enum):
        return to_json_safe(value.value)
    if isinstance(value, dict):
        return {str(key): to_json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_safe(item) for item in value]
    if hasattr(value, "tolist"):  # torch.Tensor, numpy arrays and numpy scalars, without importing either
        return to_json_safe(value.tolist())
    return str(value)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl`` file into a list of rows, one dict per logged step.

    A last line that is not valid JSON is a write cut short by a kill and is dropped silently. An invalid line
    elsewhere means the file was damaged: it is skipped with a warning that names the file and line, so that
    plotting or resuming a damaged run still works. A missing file reads as no rows.
    """
    if not Path(path).exists():
        return []
    with open(path, encoding="utf-8", errors="replace") as metrics_file:
        lines = metrics_file.read().splitlines()
    rows = []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif line_number < len(lines):
            logger.warning("%s:%d is not a JSON object; skipped", path, line_number)
    return rows
