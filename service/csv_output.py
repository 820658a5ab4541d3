"""Render query results as CSV (HTTP `?format=csv` and `trainvitals query --format csv`)."""

from __future__ import annotations

import csv
import io
import json
from typing import Any


def to_csv(data: Any) -> str:
    """Lists of dicts become one row per dict; a step-time matrix becomes step x rank columns;
    any other dict becomes key,value rows (nested values as JSON)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if isinstance(data, dict) and {"ranks", "steps", "seconds"} <= data.keys():
        writer.writerow(["step", *[f"rank{r}" for r in data["ranks"]]])
        for step, row in zip(data["steps"], data["seconds"], strict=True):
            writer.writerow([step, *["" if v is None else v for v in row]])
    elif isinstance(data, list):
        keys: list[str] = []
        for row in data:
            keys.extend(k for k in row if k not in keys)
        writer.writerow(keys)
        for row in data:
            writer.writerow([_cell(row.get(k)) for k in keys])
    else:
        writer.writerow(["key", "value"])
        for k, v in data.items():
            writer.writerow([k, _cell(v)])
    return out.getvalue()


def _cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, (dict, list, tuple, set)):
        return json.dumps(sorted(v) if isinstance(v, set) else v, default=str)
    return v
