"""The Run dashboard's "Findings raised" query, evaluated by promtool's PromQL engine: a finding
kind whose first findings arrive in one scrape is still counted. increase() alone says 0 there,
because a series' first sample has nothing to increase from; every finding of that kind would
then go unannotated."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RUN_BOARD = ROOT / "dashboards" / "generated" / "trainvitals-run.json"
SERIES = 'trainvitals_findings_total{run="r1", kind="fp8_jump", severity="ticket"}'
OLD_EXPR = 'max by (kind, severity) (increase(trainvitals_findings_total{run="r1"}[2m])) > 0'


def _findings_query() -> str:
    """The annotation's expression as Grafana sends it for run r1 (a 1 m scrape: a 2 m rate interval)."""
    board = json.loads(RUN_BOARD.read_text())
    (annotation,) = [a for a in board["annotations"]["list"] if a["name"] == "Findings raised"]
    panels = [p for p in board["panels"] if p.get("title") == "Findings raised"]
    assert [t["expr"] for p in panels for t in p["targets"]] == [annotation["expr"]]  # the panel draws the same
    return annotation["expr"].replace("$run", "r1").replace("$__rate_interval", "2m")


def _promtool(tmp_path: Path, expr: str) -> subprocess.CompletedProcess[str]:
    """Six findings of one kind appear at 5 m in one scrape (a seventh follows at 10 m, not asserted)."""
    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": SERIES, "values": "_ _ _ _ _ 6 6 6 6 6 7 7 7 7 7"}],
                "promql_expr_test": [
                    {"expr": expr, "eval_time": "5m",
                     "exp_samples": [{"labels": '{kind="fp8_jump", severity="ticket"}', "value": 6}]},
                    {"expr": expr, "eval_time": "8m", "exp_samples": []},  # nothing new
                    {"expr": expr, "eval_time": "3m", "exp_samples": []},  # nothing yet
                ],
            }
        ],
    }  # fmt: skip
    (tmp_path / "t.yml").write_text(yaml.safe_dump(tests))
    promtool = shutil.which("promtool")
    assert promtool, "promtool not installed (Debian package prometheus)"
    return subprocess.run([promtool, "test", "rules", str(tmp_path / "t.yml")], capture_output=True, text=True)


def test_the_first_findings_of_a_kind_are_counted(tmp_path: Path) -> None:
    res = _promtool(tmp_path, _findings_query())
    assert res.returncode == 0, res.stdout + res.stderr


def test_increase_alone_misses_them(tmp_path: Path) -> None:
    """What the query was: the same series, and promtool finds no sample at 5 m."""
    res = _promtool(tmp_path, OLD_EXPR)
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert "time: 5m" in out and "got: nil" in out, out
