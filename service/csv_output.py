"""Render query results as CSV (HTTP `?format=csv` and `trainvitals query --format csv`).

A cell holds what the JSON answer holds, spelled for a spreadsheet: null and a non-finite number
are empty (as in JSON, service/json_output.py), booleans `true`/`false`, nested values JSON. Text
that a spreadsheet would run as a formula (`=HYPERLINK(...)` as a tensor name, a project, an
error text) gets a leading `'` (OWASP's advice on CSV injection); numbers are left as they are.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from trainvitals.service.json_output import finite

# What Excel, LibreOffice and Google Sheets start a formula (or DDE call) with.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def to_csv(data: Any, *, columns: Sequence[str] = ()) -> str:
    """Lists of dicts become one row per dict, under `columns` (written even without rows) and
    any further keys the rows hold; a step-time matrix becomes step x rank columns; any other dict
    becomes key,value rows (nested values as JSON)."""
    rows: list[list[Any]]
    if isinstance(data, dict) and {"ranks", "steps", "seconds"} <= data.keys():
        rows = [["step", *[f"rank{r}" for r in data["ranks"]]]]
        rows += [[step, *row] for step, row in zip(data["steps"], data["seconds"], strict=True)]
    elif isinstance(data, list):
        keys = list(columns)
        for row in data:
            keys.extend(k for k in row if k not in keys)
        rows = [keys, *[[row.get(k) for k in keys] for row in data]]
    else:
        rows = [["key", "value"], *[[k, v] for k, v in data.items()]]
    return "".join(",".join(_field(_cell(v)) for v in row) + "\n" for row in rows)


def _field(text: str) -> str:
    # RFC 4180 quoting, by hand: csv.writer with "\n" line ends leaves a field with a CR unquoted, so
    # a CR in an error text split its row.
    return '"' + text.replace('"', '""') + '"' if any(c in text for c in ',"\r\n') else text


def _cell(v: Any) -> str:
    v = finite(v)
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict | list | tuple | set):
        return json.dumps(sorted(v) if isinstance(v, set) else v, default=str)
    text = str(v)
    return "'" + text if isinstance(v, str) and text.startswith(_FORMULA_START) else text
