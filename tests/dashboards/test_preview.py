"""The dashboard previews (dashboards/preview.py): both generated dashboards drawn to PNG from a
results file, on the grid's pixel size, with every panel's status reported.

The query results here are SYNTHETIC: made up by `synthetic_results` below in the shape of
Prometheus's HTTP API (and of the heatmap's SQL rows), not measured. They test the drawing, not
the dashboards; the end-to-end test draws the real pictures from a real Prometheus and PostgreSQL.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any

import pytest

from trainvitals.dashboards import preview

GENERATED = Path(__file__).resolve().parents[2] / "dashboards" / "generated"
FLEET, RUN = "trainvitals-fleet", "trainvitals-run"
START, STEP, POINTS = 1_760_000_000, 60, 90
END = START + STEP * (POINTS - 1)

# Panels the synthetic results leave without data, to see them reported (ids of run.py/fleet.py).
EMPTY_PANEL = (RUN, "503")  # its one query returns an empty result
EMPTY_QUERY = (RUN, "203", "B")  # one of two queries returns nothing
MISSING_PANEL = (FLEET, "304")  # no entry in the results file


def _boards() -> dict[str, dict[str, Any]]:
    return {b["uid"]: b for b in (json.loads(f.read_text()) for f in sorted(GENERATED.glob("*.json")))}


def _labels_of(target: dict[str, Any]) -> list[str]:
    """The labels a synthetic series of `target` carries: those its legend names, or for a
    table query those of its first `by (...)` and any `group_left (...)`."""
    named = re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", ""))
    if named or target.get("format") != "table":
        return named
    expr = target.get("expr", "")
    by = re.search(r"\bby \(([^)]*)\)", expr)
    left = re.search(r"group_left \(([^)]*)\)", expr)
    return [n.strip() for m in (by, left) if m for n in m.group(1).split(",") if n.strip()]


def _value(unit: str, series: int, i: int, *, state: bool = False, mapped: bool = False) -> float:
    if state:
        return 1.0 if (i // (10 + 7 * series)) % 2 else 0.0
    if mapped:
        return 0.0
    wave = math.sin(i / 9 + series) * 0.1
    if unit == "percentunit":
        return 0.35 + 0.05 * series + wave
    if unit == "s":
        return 1.2 + 0.3 * series + wave
    return round(3 + 2 * series + 10 * wave, 3)


def _target_result(panel: dict[str, Any], target: dict[str, Any]) -> list[dict[str, Any]]:
    labels = _labels_of(target)
    unit = panel["fieldConfig"]["defaults"].get("unit", "none")
    state = panel["type"] == "state-timeline"
    mapped = bool(panel["fieldConfig"]["defaults"].get("mappings")) and not state
    count = 3 if labels else 1
    series = []
    for n in range(count):
        metric = {name: f"{name}-{n}" for name in labels}
        if target.get("instant"):
            series.append({"metric": metric, "value": [END, str(_value(unit, n, POINTS, mapped=mapped))]})
        else:
            values = [[START + STEP * i, str(_value(unit, n, i, state=state))] for i in range(POINTS)]
            if state:  # Prometheus leaves out the steps where a series does not exist
                values = [v for v in values if v[1] == "1.0"]
            series.append({"metric": metric, "values": values})
    return series


def synthetic_results() -> dict[str, Any]:
    """SYNTHETIC query results for every panel and annotation of the generated dashboards."""
    results: dict[str, Any] = {
        "start": START,
        "end": END,
        "step": STEP,
        "variables": {"run": "synthetic-run", "project": "synthetic"},
        "source": "SYNTHETIC values made up by tests/dashboards/test_preview.py, not measured",
        "dashboards": {},
        "annotations": {},
    }
    for uid, board in _boards().items():
        panels: dict[str, Any] = {}
        for panel in board["panels"]:
            if panel["type"] == "row":
                continue
            entry: dict[str, Any] = {"targets": []}
            for target in panel.get("targets", []):
                if "rawSql" in target:
                    ranks = [f"{r:06d}" for r in range(8)]
                    rows = [[START + STEP * i, rank, 1.0 + (r == 5) * 0.8 + 0.05 * math.sin(i)] for i in range(POINTS)
                            for r, rank in enumerate(ranks)]  # fmt: skip
                    entry["sql"] = {"columns": ["time", "metric", "value"], "rows": rows}
                else:
                    entry["targets"].append(
                        {
                            "refId": target["refId"],
                            "expr": target["expr"],
                            "instant": bool(target.get("instant")),
                            "result": _target_result(panel, target),
                        }
                    )
            panels[str(panel["id"])] = entry
        results["dashboards"][uid] = panels
        results["annotations"][uid] = {
            a["name"]: [{"metric": {}, "values": [[START + STEP * i, "1"] for i in (20 + 15 * k, 21 + 15 * k)]}]
            for k, a in enumerate(board["annotations"]["list"])
            if not a.get("builtIn")
        }
    uid, pid = EMPTY_PANEL
    for target in results["dashboards"][uid][pid]["targets"]:
        target["result"] = []
    uid, pid, ref = EMPTY_QUERY
    next(t for t in results["dashboards"][uid][pid]["targets"] if t["refId"] == ref)["result"] = []
    uid, pid = MISSING_PANEL
    del results["dashboards"][uid][pid]
    return results


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


@pytest.fixture(scope="module")
def drawn(tmp_path_factory: pytest.TempPathFactory) -> dict[str, preview.Preview]:
    results = tmp_path_factory.mktemp("results") / "results.json"
    results.write_text(json.dumps(synthetic_results()))
    return preview.render_all(results, tmp_path_factory.mktemp("previews"))


def test_each_dashboard_is_drawn_on_the_grid(drawn: dict[str, preview.Preview]) -> None:
    boards = _boards()
    assert set(drawn) == set(boards) == {FLEET, RUN}
    for uid, board in boards.items():
        path = drawn[uid].path
        assert path.name == f"dashboard-{uid}.png" and path.is_file()
        rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"])
        width, height = _png_size(path)
        # 24 columns of COLUMN_PX, each grid row ROW_PX, below the header that says "PREVIEW"
        assert (width, height) == (24 * preview.COLUMN_PX, preview.HEADER_PX + rows * preview.ROW_PX)
        assert (width, height) == preview.image_size(board)


def test_every_panel_has_a_status(drawn: dict[str, preview.Preview]) -> None:
    for uid, board in _boards().items():
        ids = {str(p["id"]) for p in board["panels"] if p["type"] != "row"}
        assert set(drawn[uid].panels) == ids
        assert set(drawn[uid].panels.values()) <= set(preview.PANEL_STATUSES)


def test_empty_and_missing_panels_are_reported(drawn: dict[str, preview.Preview]) -> None:
    statuses = {(uid, pid): s for uid, p in drawn.items() for pid, s in p.panels.items()}
    assert statuses.pop(EMPTY_PANEL) == preview.NO_DATA
    assert statuses.pop(EMPTY_QUERY[:2]) == preview.PARTIAL
    assert statuses.pop(MISSING_PANEL) == preview.MISSING
    # every other panel, of every type (timeseries, stat, table, state-timeline, heatmap), has data
    assert set(statuses.values()) == {preview.DRAWN}
    assert drawn[RUN].notes[EMPTY_QUERY[1]] == "no data: query B"
    lines = preview.problems(drawn)
    assert len(lines) == 3
    assert any(line.startswith("trainvitals-run 503 Saturated tensors: no data") for line in lines)


def test_cli_strict_fails_on_a_panel_without_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = synthetic_results()
    boards = tmp_path / "boards"
    boards.mkdir()
    (boards / f"{FLEET}.json").write_text((GENERATED / f"{FLEET}.json").read_text())
    (tmp_path / "results.json").write_text(json.dumps(results))
    args = [str(tmp_path / "results.json"), str(tmp_path / "out"), "--dashboards", str(boards)]
    assert preview.main([*args, "--strict"]) == 1
    out = capsys.readouterr().out
    assert "304 missing" in out and (tmp_path / "out" / f"dashboard-{FLEET}.png").is_file()
    # with the missing panel's results back, everything is drawn
    entry = {"targets": [{"refId": "A", "expr": "x", "instant": False, "result": _target_result(
        _panel(FLEET, 304), _panel(FLEET, 304)["targets"][0])}]}  # fmt: skip
    results["dashboards"][FLEET]["304"] = entry
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert preview.main([*args, "--strict"]) == 0


def _panel(uid: str, pid: int) -> dict[str, Any]:
    return next(p for p in _boards()[uid]["panels"] if p["id"] == pid)


def test_legend_format_is_grafanas() -> None:
    labels = {"severity": "page", "kind": "straggler"}
    assert preview.legend_name("{{severity}} {{ kind }} {{missing}}!", labels) == "page straggler !"
    assert preview.legend_name(None, {"__name__": "up", "job": "tv"}) == 'up{job="tv"}'
    assert preview.legend_name("", {}, "max(up)") == "max(up)"


@pytest.mark.parametrize(
    ("value", "unit", "text"),
    [
        (1.5, "s", "1.5 s"),
        (0.0123, "s", "12.3 ms"),
        (150, "s", "2.5 min"),
        (0.4231, "percentunit", "42.3%"),
        (12345, "short", "12.3 K"),
        (12345, "none", "12345"),
        (3, "suffix: bits", "3 bits"),
        (1.25, "suffix:x", "1.25x"),
        (2000, "suffix: tok/s", "2000 tok/s"),
        (float("nan"), "s", "NaN"),
    ],
)
def test_units(value: float, unit: str, text: str) -> None:
    assert preview.format_value(value, unit) == text


def test_table_merges_and_renames_like_grafana() -> None:
    panel = _panel(FLEET, 201)  # merge, then organize: excludes Time and Value #A, renames B..H
    targets = []
    for target in panel["targets"]:
        labels = ["run", "project", "status"] if target["refId"] == "A" else ["run"]
        result = [{"metric": {k: f"{k}-{n}" for k in labels}, "value": [END, f"{n}.5"]} for n in range(2)]
        targets.append({"refId": target["refId"], "expr": target["expr"], "instant": True, "result": result})
    table = preview.table_of(panel, preview.panel_data(panel, {"targets": targets}))
    renames = panel["transformations"][1]["options"]["renameByName"]
    assert table.columns == ["project", "run", "status", *renames.values()]
    assert len(table.rows) == 2  # one row per run: every query's value joined on `run`
    assert table.rows[0]["run"] == "run-1"  # sorted by "s since last step", descending
    assert all(row["complete step"] == row["world size"] for row in table.rows)
    assert table.notes == []


def test_annotation_events_join_consecutive_steps() -> None:
    result = [{"metric": {"alertname": "A"}, "values": [[100, "1"], [160, "1"], [400, "1"]]}]
    assert preview.annotation_events(result, 60) == [(100, 160), (400, 400)]
    assert preview.annotation_events([result], 60) == [(100, 160), (400, 400)]
    assert preview.annotation_events(None, 60) == []
