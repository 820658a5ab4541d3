"""Writes the trainvitals dashboards as Grafana JSON, one `<uid>.json` per dashboard.

The generated files are committed under dashboards/generated/ (Grafana's file provider reads
them, dashboards/provisioning/dashboards/trainvitals.yml); tests/dashboards regenerates them and
fails when the committed JSON differs. Regenerate after changing a builder::

    trainvitals dashboards write            # or: python -m trainvitals.dashboards.generate
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.models import dashboard as dash_m

from trainvitals.dashboards import fleet, panels, run

DEFAULT_DIRECTORY = Path("dashboards/generated")

BUILDERS: tuple[Callable[[], dash_m.Dashboard], ...] = (fleet.build, run.build)


def render_all() -> dict[str, str]:
    """{file name: JSON text} of every dashboard."""
    out: dict[str, str] = {}
    for build in BUILDERS:
        board = build()
        assert board.uid, f"{build.__module__} builds a dashboard without a uid"
        out[f"{board.uid}.json"] = panels.render(board)
    return out


def write(directory: str | Path = DEFAULT_DIRECTORY) -> list[Path]:
    """Write every dashboard into `directory` (created if missing); returns the paths written."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_all().items():
        path = target / name
        path.write_text(text, encoding="ascii")
        written.append(path)
    return written


if __name__ == "__main__":
    for written_path in write(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIRECTORY):
        print(written_path)
