"""Render results as strict JSON (RFC 8259): what `trainvitals query`, `token list`, `plan --json`
and `advise --json` print, and what a CSV cell holds for a float.

Python's json writes a non-finite float as `Infinity`/`NaN`, which is not JSON: jq and most parsers
refuse the whole document. A non-finite value becomes null, as pydantic writes it in the HTTP
answers; where it matters a count says that it was there (`loss_nonfinite`, `grad_nonfinite`,
a tensor's `nonfinite`).
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(data: Any) -> Any:
    """data with every non-finite float (inf, -inf, nan), however deep in dicts and lists, as None."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [finite(v) for v in data]
    return data


def to_json(data: Any) -> str:
    """Indented strict JSON; values json cannot write (a datetime) as their str()."""
    return json.dumps(finite(data), indent=2, allow_nan=False, default=str)
