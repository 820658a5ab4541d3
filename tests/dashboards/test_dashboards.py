"""The Grafana dashboards: regenerated JSON equals the committed JSON, it validates against
Grafana's own JSON schemas, it passes the lint rules of docs/dashboards.md, every PromQL
expression parses in the real promtool, and the heatmap's SQL runs against the real PostgreSQL.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import uuid
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft7Validator
from sqlalchemy import text

from trainvitals.service.cli import main as cli_main
from trainvitals.service.store import batches, db, queries
from trainvitals.testing import grafana
from trainvitals.wire import Batch, RunRegistration

with warnings.catch_warnings():
    # The SDK's classic Dashboard model warns that a v2 model exists; Grafana's file provider
    # and Grafana <= 11 load the classic one.
    warnings.simplefilter("ignore", DeprecationWarning)
    from trainvitals.dashboards import generate, panels, run

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "dashboards" / "generated"
METRICS_DOC = ROOT / "docs" / "metrics.md"
# Grafana's schemas are reference data shared by the project, read in place (never copied).
SCHEMAS = ROOT.parent / "shared" / "reference" / "grafana-schemas"

# Series Prometheus makes itself (not exported by the collector, so not in docs/metrics.md).
PROMETHEUS_SERIES = {"ALERTS", "up", "scrape_duration_seconds"}
# Values a Grafana variable or macro takes, for running the queries outside Grafana.
SUBSTITUTIONS = {
    "$__rate_interval": "2m",
    "$__interval": "30s",
    "$project": ".*",
    "$run": "r1",
}
CUSTOM_UNIT_PREFIXES = ("suffix:", "prefix:", "si:", "count:", "currency:", "time:")


# -- reading the generated dashboards ------------------------------------------------------


@cache
def _boards() -> dict[str, dict[str, Any]]:
    files = sorted(GENERATED.glob("*.json"))
    assert files, f"no dashboards in {GENERATED}"
    return {f.name: json.loads(f.read_text()) for f in files}


def _panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return grafana.panels(board)


def _annotations(board: dict[str, Any]) -> list[dict[str, Any]]:
    return grafana.query_annotations(board)


def _exprs(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target, annotation and variable query (label_values()
    rewritten as the PromQL Grafana runs for it)."""
    out = []
    for pn in _panels(board):
        for t in pn.get("targets", []):
            if t["datasource"]["type"] == panels.PROMETHEUS_TYPE:
                out.append((f"panel {pn['id']} {t['refId']}", t["expr"]))
    for a in _annotations(board):
        out.append((f"annotation {a['name']}", a["expr"]))
    for v in board["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"])
            assert m, v["query"]
            out.append((f"variable {v['name']}", f"group by ({m[2]}) ({m[1]})"))
    return out


def _substitute(expr: str) -> str:
    return grafana.substitute(expr, SUBSTITUTIONS)


def _ids() -> list[str]:
    return list(_boards())


# -- generated JSON is current ---------------------------------------------------------------


def test_regenerating_gives_the_committed_json(tmp_path: Path) -> None:
    # The rules file written beside them is checked in test_alert_rules.py.
    written = [p for p in generate.write(tmp_path) if p.suffix == ".json"]
    assert sorted(p.name for p in written) == sorted(p.name for p in GENERATED.glob("*.json")), (
        "dashboards/generated holds other files than the builders write"
    )
    for path in written:
        assert path.read_text() == (GENERATED / path.name).read_text(), (
            f"{path.name} is stale: run `trainvitals dashboards write` and commit dashboards/generated"
        )


def test_cli_writes_the_same_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["dashboards", "write", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.split() == [
        *(str(tmp_path / "out" / n) for n in generate.render_all()),
        str(tmp_path / "out" / "trainvitals-alerts.yml"),
    ]
    for name, body in generate.render_all().items():
        assert (tmp_path / "out" / name).read_text() == body
        assert body.endswith("}\n") and body.isascii()


def test_the_sdk_reads_the_json_back_unchanged() -> None:
    """Decoding through the SDK's own models and encoding again changes nothing: no field the
    SDK does not know, no value of the wrong type."""
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.models import dashboard as dash_m

    plugins.register_default_plugins()
    for name, board in _boards().items():
        assert panels.render(dash_m.Dashboard.from_json(board)) == (GENERATED / name).read_text()


# -- Grafana's schemas ---------------------------------------------------------------------


@cache
def _validator(schema: str, definition: str) -> Draft7Validator | None:
    path = SCHEMAS / f"{schema}.jsonschema.json"
    assert path.exists(), f"{path} missing: the Grafana schemas live in shared/reference beside the repo"
    definitions = json.loads(path.read_text())["definitions"]
    if definition not in definitions:
        return None
    return Draft7Validator({"$ref": f"#/definitions/{definition}", "definitions": definitions})


def _errors(validator: Draft7Validator, instance: object) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message[:300]}" for e in validator.iter_errors(instance)]


@pytest.mark.parametrize("name", _ids())
def test_dashboard_matches_the_grafana_schema(name: str) -> None:
    validator = _validator("dashboard", "Dashboard")
    assert validator is not None
    assert _errors(validator, _boards()[name]) == []


@pytest.mark.parametrize("name", _ids())
def test_panel_options_and_field_config_match_their_plugin_schemas(name: str) -> None:
    problems = []
    for pn in _panels(_boards()[name]):
        plugin = pn["type"].replace("-", "")  # state-timeline -> statetimeline.jsonschema.json
        options = _validator(plugin, "Options")
        assert options is not None, f"no schema for panel type {pn['type']}"
        problems += [f"panel {pn['id']} options {e}" for e in _errors(options, pn["options"])]
        custom = pn["fieldConfig"]["defaults"].get("custom")
        field_config = _validator(plugin, "FieldConfig")
        if field_config is None:
            # stat has no custom field config in Grafana: the JSON must not invent one.
            assert not custom, f"panel {pn['id']}: {pn['type']} has no custom field config"
        else:
            problems += [f"panel {pn['id']} custom {e}" for e in _errors(field_config, custom or {})]
    assert problems == []


@pytest.mark.parametrize("name", _ids())
def test_prometheus_targets_match_the_prometheus_query_schema(name: str) -> None:
    validator = _validator("prometheus", "Dataquery")
    assert validator is not None
    problems = []
    checked = 0
    for pn in _panels(_boards()[name]):
        for t in pn.get("targets", []):
            if t["datasource"]["type"] == panels.PROMETHEUS_TYPE:
                checked += 1
                problems += [f"panel {pn['id']} {t['refId']} {e}" for e in _errors(validator, t)]
    assert checked and problems == []


def test_the_schema_checks_catch_broken_json() -> None:
    """The schema checks are not vacuous: injected faults of the kinds they should catch fail."""
    board = json.loads(json.dumps(_boards()[f"{panels.RUN_UID}.json"]))
    target_panel = next(pn for pn in _panels(board) if pn["type"] == "timeseries")
    target_panel["gridPos"]["w"] = "12"
    board["graphTooltip"] = 7
    dashboard = _validator("dashboard", "Dashboard")
    assert dashboard is not None and len(_errors(dashboard, board)) >= 2
    options = _validator("timeseries", "Options")
    assert options is not None and _errors(options, {**target_panel["options"], "legend": {"displayMode": "nope"}})
    query = _validator("prometheus", "Dataquery")
    assert query is not None and _errors(query, {"refId": "A", "exrp": "up"})


# -- lint ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", _ids())
def test_every_panel_and_query_uses_a_datasource_variable(name: str) -> None:
    board = _boards()[name]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == panels.PROMETHEUS_TYPE

    def check(where: str, ref: dict[str, str]) -> None:
        m = re.fullmatch(r"\$\{(\w+)\}", ref["uid"])
        assert m, f"{where}: datasource uid {ref['uid']!r} is not a datasource variable"
        var = variables[m[1]]
        assert var["type"] == "datasource" and var["query"] == ref["type"], f"{where}: {ref} vs {var}"

    for pn in _panels(board):
        check(f"panel {pn['id']}", pn["datasource"])
        assert pn.get("targets"), f"panel {pn['id']} has no query"
        for t in pn["targets"]:
            assert t["datasource"] == pn["datasource"], f"panel {pn['id']} target {t['refId']}"
    for a in _annotations(board):
        check(f"annotation {a['name']}", a["datasource"])
    for v in variables.values():
        if v["type"] == "query":
            check(f"variable {v['name']}", v["datasource"])


@pytest.mark.parametrize("name", _ids())
def test_every_range_is_the_rate_interval(name: str) -> None:
    """rate/irate/increase (and deriv, changes) over $__rate_interval: at least four scrapes, so a
    missed scrape or a zoomed-out panel never yields an empty or jumpy rate."""
    bad = []
    functions = 0
    for where, expr in _exprs(_boards()[name]):
        functions += len(re.findall(r"\b(?:rate|irate|increase|deriv|changes)\s*\(", expr))
        bad += [f"{where}: [{r}]" for r in re.findall(r"\[([^\]]*)\]", expr) if r != "$__rate_interval"]
        for fn in re.finditer(r"\b(rate|irate|increase)\s*\(", expr):
            assert "[$__rate_interval]" in expr[fn.end() :], f"{where}: {fn[1]}() without $__rate_interval"
    assert bad == []
    if name == f"{panels.RUN_UID}.json":
        assert functions >= 3


@pytest.mark.parametrize("name", _ids())
def test_panel_ids_are_unique_and_the_grid_has_no_overlap(name: str) -> None:
    board = _boards()[name]
    ids = [pn["id"] for pn in grafana.all_panels(board)]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert all(isinstance(i, int) and i > 0 for i in ids), ids
    cells: dict[tuple[int, int], int] = {}
    for pn in grafana.all_panels(board):
        g = pn["gridPos"]
        assert g["w"] >= 1 and g["h"] >= 1 and g["x"] >= 0 and g["y"] >= 0, (pn["id"], g)
        assert g["x"] + g["w"] <= 24, f"panel {pn['id']} leaves the 24-column grid: {g}"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panels {cells[(x, y)]} and {pn['id']} overlap at {(x, y)}"
                cells[(x, y)] = pn["id"]


@pytest.mark.parametrize("name", _ids())
def test_panel_ids_follow_their_row(name: str) -> None:
    """Row N*100 holds panels N*100+1...: an id says where a panel is, and never moves."""
    row = None
    for pn in _boards()[name]["panels"]:
        if pn["type"] == "row":
            row = pn["id"]
            assert row % 100 == 0, pn["title"]
        else:
            assert row is not None and row < pn["id"] < row + 100, (row, pn["id"], pn["title"])


@cache
def _grafana_units() -> set[str]:
    definitions = json.loads((SCHEMAS / "units.jsonschema.json").read_text())["definitions"]
    return {d["const"] for d in definitions.values() if "const" in d}


@pytest.mark.parametrize("name", _ids())
def test_every_panel_has_a_title_a_unit_and_a_description(name: str) -> None:
    for pn in _panels(_boards()[name]):
        assert pn.get("title"), pn["id"]
        assert len(pn.get("description", "")) >= 30, f"panel {pn['id']} needs a description of what it answers"
        unit = pn["fieldConfig"]["defaults"].get("unit")
        assert unit, f"panel {pn['id']} has no unit"
        assert unit in _grafana_units() or unit.startswith(CUSTOM_UNIT_PREFIXES), f"panel {pn['id']}: {unit}"


@cache
def _documented_families() -> set[str]:
    return set(re.findall(r"^\| `(trainvitals_\w+)` \|", METRICS_DOC.read_text(), flags=re.M))


_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}


def _metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, label
    names (in {...}, by/on/... lists) or variables."""
    e = re.sub(r'"[^"]*"', '""', expr)
    e = re.sub(r"\$\{?\w+(:\w+)?\}?", "", e)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = re.findall(r"(?<![\w.])([A-Za-z_:][\w:]*)\b(?!\s*\()", e)
    return {n for n in names if n not in _KEYWORDS}


def test_metric_name_extraction() -> None:
    assert _metric_names(
        'max by (run) (rate(trainvitals_ingest_records_total{run="$run"}[$__rate_interval])) '
        '> on (run) clamp_min(10 * trainvitals_run_loss{stat="max"}, 120) and on (run) up == 1'
    ) == {"trainvitals_ingest_records_total", "trainvitals_run_loss", "up"}


@pytest.mark.parametrize("name", _ids())
def test_every_metric_is_one_the_collector_exports(name: str) -> None:
    documented = _documented_families()
    assert len(documented) > 20, "could not read the families of docs/metrics.md"
    used: set[str] = set()
    for where, expr in _exprs(_boards()[name]):
        names = _metric_names(expr)
        assert names, f"{where}: no metric in {expr}"
        # A histogram's series: its documented family plus _bucket, _sum or _count.
        names = {re.sub(r"_(bucket|sum|count)$", "", n) if re.sub(r"_(bucket|sum|count)$", "", n) in documented
                 else n for n in names}  # fmt: skip
        unknown = names - documented - PROMETHEUS_SERIES
        assert not unknown, f"{where} uses {sorted(unknown)}, not in docs/metrics.md"
        used |= names
    assert used & documented


# -- variables and links -------------------------------------------------------------------


def test_variables_and_links_between_the_dashboards() -> None:
    fleet = _boards()[f"{panels.FLEET_UID}.json"]
    run_board = _boards()[f"{panels.RUN_UID}.json"]
    assert [v["name"] for v in fleet["templating"]["list"]] == ["datasource", "project"]
    assert [v["name"] for v in run_board["templating"]["list"]] == [
        "datasource", "sql_datasource", "project", "run", "node_dashboard_url",
    ]  # fmt: skip
    run_var = run_board["templating"]["list"][3]
    assert run_var["query"].startswith("label_values(trainvitals_run_info{")
    for board in (fleet, run_board):
        assert panels.TAG in board["tags"]
        assert any(link["type"] == "dashboards" and panels.TAG in link["tags"] for link in board["links"])
        defaults = {v["name"]: v["current"]["value"] for v in board["templating"]["list"] if v["type"] == "datasource"}
        assert defaults["datasource"] == panels.DEFAULT_PROMETHEUS_UID
    # Every Fleet panel about runs links to the Run dashboard with var-run.
    linked = [pn for pn in _panels(fleet) if pn["fieldConfig"]["defaults"].get("links")]
    assert {pn["id"] for pn in linked} >= {201, 301, 302, 303, 304}
    for pn in linked:
        (link,) = pn["fieldConfig"]["defaults"]["links"]
        assert link["url"].startswith(f"/d/{panels.RUN_UID}/") and "var-run=${__" in link["url"], link
    # The slowest-ranks table links each host to the node's hardware dashboard (a hidden variable).
    (slowest,) = [pn for pn in _panels(run_board) if pn["id"] == 405]
    (node_link,) = slowest["fieldConfig"]["defaults"]["links"]
    assert node_link["url"].startswith("${node_dashboard_url}${__data.fields.host}")
    node_var = run_board["templating"]["list"][4]
    assert node_var["type"] == "textbox" and node_var["hide"] == 2 and node_var["query"].startswith("/d/")


# -- promtool ------------------------------------------------------------------------------


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not installed (Debian package prometheus: make system-deps)"
    return path


def _check_as_rules(tmp_path: Path, exprs: list[tuple[str, str]]) -> subprocess.CompletedProcess[str]:
    rules = [{"record": f"dashboard:query_{i}:expr", "expr": _substitute(e)} for i, (_, e) in enumerate(exprs)]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    return subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", _ids())
def test_every_promql_expression_parses_in_promtool(name: str, tmp_path: Path) -> None:
    exprs = _exprs(_boards()[name])
    res = _check_as_rules(tmp_path, exprs)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in res.stdout


def test_promtool_check_rejects_a_broken_expression(tmp_path: Path) -> None:
    res = _check_as_rules(
        tmp_path, [("ok", "max(trainvitals_run_loss)"), ("broken", "max by (run (trainvitals_run_loss)")]
    )
    assert res.returncode != 0


# -- the rank x step heatmap's SQL, on the real PostgreSQL -----------------------------------


def _steps_batch(run_id: str, rank: int, incarnation: int, steps: range, *, ts0: float, seconds: float) -> Batch:
    records = [
        {"kind": "step", "step": s, "ts": ts0 + s, "step_seconds": seconds, "loss": 2.0, "tokens": 64} for s in steps
    ]
    return Batch.model_validate({"run": run_id, "rank": rank, "incarnation": incarnation, "seq": 0, "records": records})


def test_rank_step_heatmap_sql_returns_rows_for_a_stored_run(pg_url: str) -> None:
    engine = db.make_engine(pg_url)
    run_id = f"heatmap-{uuid.uuid4().hex[:8]}"
    other = f"{run_id}-other"
    try:
        with db.make_sessionmaker(engine)() as session:
            for r in (run_id, other):
                batches.register_run(session, RunRegistration(run=r, parallelism={"world_size": 4}))
            for rank in range(4):
                seconds = 0.5 if rank == 2 else 0.1  # rank 2 straggles
                batches.store_batch(session, _steps_batch(run_id, rank, 1, range(10), ts0=1000.0, seconds=seconds))
                batches.store_batch(session, _steps_batch(other, rank, 1, range(10), ts0=1000.0, seconds=9.0))
            # Rank 0 crashed after step 5 and its relaunch (incarnation 2) repeated steps 6-9 later and slower.
            batches.store_batch(session, _steps_batch(run_id, 0, 2, range(6, 10), ts0=1100.0, seconds=0.3))
            session.commit()
        sql = grafana.expand_sql(run.RANK_STEP_HEATMAP_SQL, run_id=run_id, start=0, end=2e9, interval_s=1)
        with engine.connect() as conn:
            rows = conn.execute(text(sql)).all()
    finally:
        with db.make_sessionmaker(engine)() as session:
            for r in (run_id, other):
                queries.delete_run(session, run_id=r)
            session.commit()
        engine.dispose()
    cells = {(float(t), metric): value for t, metric, value in rows}
    assert len(cells) == len(rows) == 40  # 4 ranks x 10 steps, the other run left out
    assert {m for _, m in cells} == {"000000", "000001", "000002", "000003"}
    assert cells[(1003.0, "000002")] == pytest.approx(0.5)  # the straggler's hot row
    assert cells[(1003.0, "000001")] == pytest.approx(0.1)
    # The newest incarnation wins: rank 0's repeated steps sit at their relaunch time.
    assert (1007.0, "000000") not in cells
    assert cells[(1107.0, "000000")] == pytest.approx(0.3)
    assert [t for t, _m, _v in rows] == sorted(t for t, _m, _v in rows)  # Grafana wants time order


def test_heatmap_sql_time_range_and_run_are_variables() -> None:
    sql = run.RANK_STEP_HEATMAP_SQL
    assert (
        "${run:sqlstring}" in sql
        and "$__unixEpochFilter(ts)" in sql
        and "$__unixEpochGroupAlias(ts, $__interval)" in sql
    )
    board = _boards()[f"{panels.RUN_UID}.json"]
    (heatmap,) = [pn for pn in _panels(board) if pn["type"] == "heatmap"]
    (target,) = heatmap["targets"]
    assert target["rawSql"] == sql and target["format"] == "time_series"
    assert heatmap["datasource"] == {"type": panels.POSTGRES_TYPE, "uid": "${sql_datasource}"}
    assert heatmap["options"]["calculate"] is False


def test_the_crest_panel_draws_the_detectors_default_limit() -> None:
    """Panel 505's line is where fp8_precision_crest starts counting (its default): a panel line
    apart from the detector's would show a tensor as fine that the detector tickets, or the reverse."""
    from trainvitals.service.detectors.fp8 import Fp8Config

    (panel,) = [p for p in _panels(_boards()["trainvitals-run.json"]) if p["id"] == 505]
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps] == [None, Fp8Config().crest_bits]
    assert f"{Fp8Config().crest_sustain_steps} steps" in panel["description"]
