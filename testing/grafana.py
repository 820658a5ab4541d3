"""Reading the generated Grafana dashboards and running their queries outside Grafana: the panels
and annotations of a dashboard, Grafana's variables and macros substituted as Grafana would
(tests/dashboards lints and parses them; tests/e2e runs them against a real Prometheus and
PostgreSQL)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any


def all_panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, and the panels held inside collapsed rows."""
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """The panels that draw something (not rows)."""
    return [pn for pn in all_panels(board) if pn["type"] != "row"]


def query_annotations(board: dict[str, Any]) -> list[dict[str, Any]]:
    """The dashboard's query annotations (not Grafana's built-in one)."""
    return [a for a in board["annotations"]["list"] if not a.get("builtIn")]


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """`expr` with each variable or macro of `values` replaced (longest name first, so $__interval
    does not eat the start of $__rate_interval); AssertionError if one is left."""
    for var in sorted(values, key=len, reverse=True):
        expr = expr.replace(var, values[var])
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def expand_sql(sql: str, *, run_id: str, start: float, end: float, interval_s: int) -> str:
    """Expand the Grafana PostgreSQL macros the heatmap uses, as Grafana documents them."""
    out = sql.replace("${run:sqlstring}", "'" + run_id.replace("'", "''") + "'")
    out = out.replace("$__interval", f"{interval_s}s")
    out = re.sub(r"\$__unixEpochFilter\((\w+)\)", rf"\1 >= {start} AND \1 <= {end}", out)
    out = re.sub(r"\$__unixEpochGroupAlias\((\w+), (\d+)s\)", r'floor(\1/\2)*\2 AS "time"', out)
    assert "$" not in out, out
    return out
