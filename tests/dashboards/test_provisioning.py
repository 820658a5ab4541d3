"""Grafana provisioning and the Prometheus scrape config agree with the dashboards, and the
scrape config passes the real `promtool check config` (rule files included)."""

from __future__ import annotations

import json
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

import yaml

with warnings.catch_warnings():
    # The SDK's classic Dashboard model warns that a v2 model exists; Grafana's file provider
    # and Grafana <= 11 load the classic one.
    warnings.simplefilter("ignore", DeprecationWarning)
    from trainvitals.dashboards import panels

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
PROMETHEUS_CONFIG = DASHBOARDS / "prometheus" / "prometheus.yml"
DATASOURCES = DASHBOARDS / "provisioning" / "datasources" / "trainvitals.yml"
PROVIDERS = DASHBOARDS / "provisioning" / "dashboards" / "trainvitals.yml"
ALERT_RULES = DASHBOARDS / "alerts" / "trainvitals-alerts.yml"


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _job(config: dict[str, Any]) -> dict[str, Any]:
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == panels.SCRAPE_JOB]
    return job


def test_promtool_accepts_the_scrape_config_and_its_rule_files(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool not installed (Debian package prometheus: make system-deps)"
    config = _yaml(PROMETHEUS_CONFIG)
    # promtool checks that the token file exists; the deployed path is /etc/prometheus/...
    token = tmp_path / "trainvitals-read.token"
    token.write_text("tv_read_token_for_the_check\n")
    _job(config)["authorization"]["credentials_file"] = str(token)
    # rule_files are relative to the config file: resolve them before moving the config.
    config["rule_files"] = [str((PROMETHEUS_CONFIG.parent / f).resolve()) for f in config["rule_files"]]
    checked = tmp_path / "prometheus.yml"
    checked.write_text(yaml.safe_dump(config))
    res = subprocess.run([promtool, "check", "config", str(checked)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout and str(ALERT_RULES) in res.stdout


def test_scrape_config_serves_the_alerts_and_the_dashboards() -> None:
    config = _yaml(PROMETHEUS_CONFIG)
    assert [(PROMETHEUS_CONFIG.parent / f).resolve() for f in config["rule_files"]] == [ALERT_RULES]
    job = _job(config)
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"]["type"] == "Bearer"
    # The liveness alert and the collector panel select the same job name.
    assert f'up{{job="{panels.SCRAPE_JOB}"}}' in ALERT_RULES.read_text()
    run_board = (DASHBOARDS / "generated" / f"{panels.RUN_UID}.json").read_text()
    assert f'job=\\"{panels.SCRAPE_JOB}\\"' in run_board


def test_datasources_have_the_uids_the_dashboards_default_to() -> None:
    sources = {d["uid"]: d for d in _yaml(DATASOURCES)["datasources"]}
    assert sources[panels.DEFAULT_PROMETHEUS_UID]["type"] == panels.PROMETHEUS_TYPE
    assert sources[panels.DEFAULT_POSTGRES_UID]["type"] == panels.POSTGRES_TYPE
    # No password in the repository: Grafana reads it from the environment.
    assert sources[panels.DEFAULT_POSTGRES_UID]["secureJsonData"]["password"].startswith("${")
    # $__rate_interval is 4x the datasource's scrape interval: it must be the real one.
    scrape = _yaml(PROMETHEUS_CONFIG)["global"]["scrape_interval"]
    assert sources[panels.DEFAULT_PROMETHEUS_UID]["jsonData"]["timeInterval"] == scrape
    for name in (f"{panels.FLEET_UID}.json", f"{panels.RUN_UID}.json"):
        board = json.loads((DASHBOARDS / "generated" / name).read_text())
        defaults = {v["query"]: v["current"]["value"] for v in board["templating"]["list"] if v["type"] == "datasource"}
        assert all(sources[uid]["type"] == kind for kind, uid in defaults.items()), (name, defaults)


def test_dashboard_provider_loads_the_generated_files() -> None:
    (provider,) = _yaml(PROVIDERS)["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"].startswith("/")
    assert provider["allowUiUpdates"] is False  # the JSON in git is the source of truth
