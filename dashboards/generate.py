"""Writes the trainvitals dashboards as Grafana JSON, one `<uid>.json` per dashboard, and the
alert rules with their links to the dashboards' panels and to the runbooks (alert_rules.py).

The generated files are committed: the JSON under dashboards/generated/ (Grafana's file provider
reads it, dashboards/provisioning/dashboards/trainvitals.yml) and the rules as
dashboards/alerts/trainvitals-alerts.yml (with placeholder URLs); tests/dashboards regenerates
them and fails when a committed file differs. Regenerate after changing a builder or a rule::

    trainvitals dashboards write            # or: python -m trainvitals.dashboards.generate

An installation writes everything into one directory with its own URLs::

    trainvitals dashboards write DIR --grafana-url URL --runbook-base-url URL
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.models import dashboard as dash_m

from trainvitals.dashboards import alert_rules, fleet, panels, run

DEFAULT_DIRECTORY = Path("dashboards/generated")
DEFAULT_RULES_FILE = Path("dashboards/alerts") / alert_rules.RULES_FILE_NAME

BUILDERS: tuple[Callable[[], dash_m.Dashboard], ...] = (fleet.build, run.build)


def build_all() -> list[dash_m.Dashboard]:
    """Every dashboard, built."""
    boards = [build() for build in BUILDERS]
    for build, board in zip(BUILDERS, boards, strict=True):
        assert board.uid, f"{build.__module__} builds a dashboard without a uid"
    return boards


def render_all() -> dict[str, str]:
    """{file name: JSON text} of every dashboard."""
    return {f"{board.uid}.json": panels.render(board) for board in build_all()}


def render_rules(config: alert_rules.Config | None = None) -> str:
    """The alert rules with their dashboard_url and runbook_url for `config` (default: the
    placeholders of the committed file)."""
    return alert_rules.render(
        alert_rules.SOURCE.read_text(encoding="utf-8"), boards=build_all(), config=config or alert_rules.Config()
    )


def write(directory: str | Path | None = None, *, config: alert_rules.Config | None = None) -> list[Path]:
    """Write every dashboard and the alert rules; returns the paths written.

    Without `directory`: the committed layout (DEFAULT_DIRECTORY and DEFAULT_RULES_FILE, relative
    to the working directory, i.e. the repository root). With one: every file into it (created if
    missing), the rules as `trainvitals-alerts.yml`."""
    if directory is None:
        target, rules_file = DEFAULT_DIRECTORY, DEFAULT_RULES_FILE
    else:
        target = Path(directory)
        rules_file = target / alert_rules.RULES_FILE_NAME
    # Render everything before writing anything: a bad rule or panel reference leaves no half-written set.
    files = {target / name: text for name, text in render_all().items()}
    files[rules_file] = render_rules(config)
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return list(files)


if __name__ == "__main__":
    for written_path in write(sys.argv[1] if len(sys.argv) > 1 else None):
        print(written_path)
