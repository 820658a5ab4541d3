"""Alert rules and Alertmanager config, checked with the real promtool, amtool and Alertmanager."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "dashboards" / "alerts" / "trainvitals-alerts.yml"
RULE_TESTS = ROOT / "dashboards" / "alerts" / "trainvitals-alerts.test.yml"
AM_DIR = ROOT / "dashboards" / "alertmanager"
AM_CONFIG = AM_DIR / "alertmanager.yml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"


def _tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    # A missing binary is a failure, not a skip: these checks are the point of the test.
    assert path, f"{name} not installed (Debian packages prometheus / prometheus-alertmanager)"
    return path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=120)


def _alerts() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_check_rules() -> None:
    res = _run(_tool("promtool"), "check", "rules", str(RULES))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in res.stdout


def test_promtool_unit_tests_pass() -> None:
    res = _run(_tool("promtool"), "test", "rules", str(RULE_TESTS))
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_unit_tests_can_fail(tmp_path: Path) -> None:
    """The unit tests detect a broken rule: flip one alert's severity filter and they must fail."""
    broken = RULES.read_text().replace('kind=~"fp8_clipping", severity=~"page|ticket"',
                                       'kind=~"fp8_clipping", severity=~"ticket"')
    assert broken != RULES.read_text()
    (tmp_path / "trainvitals-alerts.yml").write_text(broken)
    doc = yaml.safe_load(RULE_TESTS.read_text())
    doc["tests"] = [t for t in doc["tests"] if t["name"].startswith("TrainvitalsFp8Clipping")]
    assert len(doc["tests"]) == 1
    (tmp_path / "t.yml").write_text(yaml.safe_dump(doc))
    res = _run(_tool("promtool"), "test", "rules", str(tmp_path / "t.yml"))
    assert res.returncode != 0
    assert "TrainvitalsFp8Clipping" in res.stdout + res.stderr


def test_every_alert_is_unit_tested_firing_and_silent() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired: set[str] = set()
    silent: set[str] = set()
    for t in tests:
        for a in t.get("alert_rule_test", []):
            (fired if a["exp_alerts"] else silent).add(a["alertname"])
    names = {a["alert"] for a in _alerts()}
    assert names <= fired, names - fired
    assert names <= silent, names - silent


def test_alerts_carry_severity_and_runbook_sections() -> None:
    anchors = {_anchor(h) for h in re.findall(r"^## (.+)$", RUNBOOKS.read_text(), flags=re.M)}
    for a in _alerts():
        ann = a["annotations"]
        # Finding alerts take severity from the finding (page|ticket filter); the others set it.
        fixed = a.get("labels", {}).get("severity")
        assert fixed in ("page", "ticket") or 'severity=~"page|ticket"' in a["expr"]
        assert ann["runbook_url"].startswith("docs/runbooks.md#"), a["alert"]
        assert ann["runbook_url"].split("#", 1)[1] in anchors, (a["alert"], ann["runbook_url"])
        assert "summary" in ann and "description" in ann


def _anchor(heading: str) -> str:
    # GitHub's anchor rule for ASCII headings: lower case, drop punctuation, spaces to dashes.
    return re.sub(r"[^a-z0-9 -]", "", heading.strip().lower()).replace(" ", "-")


def test_amtool_check_config_and_routes() -> None:
    amtool = _tool("amtool")
    res = _run(amtool, "check-config", str(AM_CONFIG))
    assert res.returncode == 0, res.stdout + res.stderr
    res = _run("sh", str(AM_DIR / "routes.test.sh"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all routes ok" in res.stdout


def test_am_config_groups_by_run_and_alertname() -> None:
    cfg = yaml.safe_load(AM_CONFIG.read_text())
    assert cfg["route"]["group_by"] == ["run", "alertname"]
    for route in cfg["route"]["routes"]:
        assert "group_by" not in route  # inherited: one page per run and alert everywhere


# --------------------------------------------------------------------------- a real Alertmanager


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    binary = _tool("prometheus-alertmanager")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, f"--config.file={AM_CONFIG}", f"--storage.path={tmp_path}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, "alertmanager exited"
            assert time.monotonic() < deadline, "alertmanager not ready"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _post(url: str, alerts: list[dict]) -> None:
    req = urllib.request.Request(f"{url}/api/v2/alerts", data=json.dumps(alerts).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


def _get(url: str, path: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}{path}", timeout=5) as r:
        return json.loads(r.read())


def _alert(name: str, severity: str, **labels: str) -> dict:
    return {"labels": {"alertname": name, "severity": severity, **labels}, "annotations": {"summary": name}}


def test_alertmanager_inhibits_stragglers_of_a_stalled_run_and_groups_per_run(alertmanager: str) -> None:
    _post(alertmanager, [
        _alert("TrainvitalsRunStalled", "page", run="r1"),
        _alert("TrainvitalsStraggler", "page", run="r1", subject="3"),
        _alert("TrainvitalsStraggler", "page", run="r1", subject="5"),
        _alert("TrainvitalsStraggler", "page", run="r2", subject="7"),
        _alert("TrainvitalsCheckpointFailed", "page", run="r2", subject="6"),
        _alert("TrainvitalsCheckpointOverdue", "ticket", run="r2"),
    ])
    deadline = time.monotonic() + 15
    while True:
        state = {
            (a["labels"]["alertname"], a["labels"].get("run"), a["labels"].get("subject")):
                a["status"]["state"]
            for a in _get(alertmanager, "/api/v2/alerts")
        }
        if len(state) == 6 and state[("TrainvitalsStraggler", "r1", "3")] != "unprocessed":
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
    assert state[("TrainvitalsStraggler", "r1", "3")] == "suppressed"
    assert state[("TrainvitalsStraggler", "r1", "5")] == "suppressed"
    assert state[("TrainvitalsStraggler", "r2", "7")] == "active"  # r2 is not stalled
    assert state[("TrainvitalsRunStalled", "r1", None)] == "active"
    assert state[("TrainvitalsCheckpointOverdue", "r2", None)] == "suppressed"  # failing saves explain it
    groups = _get(alertmanager, "/api/v2/alerts/groups")
    keys = sorted((g["labels"].get("run"), g["labels"].get("alertname"), len(g["alerts"])) for g in groups)
    # One group (one notification) per run and alert, whatever the number of subjects.
    assert ("r1", "TrainvitalsStraggler", 2) in keys
    assert ("r2", "TrainvitalsStraggler", 1) in keys
