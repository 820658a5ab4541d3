"""create_app at start: the schema check when it does not migrate."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainvitals.service.main import create_app
from trainvitals.service.settings import Settings
from trainvitals.service.store import db


def test_a_start_without_migrating_refuses_a_database_not_at_head(tmp_path: Path) -> None:
    """TRAINVITALS_MIGRATE_ON_START=false skipped every check: /healthz answered 200 while /v1/runs
    and /metrics failed with 500 on a missing column."""
    url = f"sqlite:///{tmp_path / 'tv.db'}"
    with pytest.raises(db.SchemaError, match="no trainvitals tables: create them with `trainvitals db upgrade"):
        create_app(Settings(db=url, migrate_on_start=False))
    db.upgrade(url, "0016")
    with pytest.raises(db.SchemaError) as refused:
        create_app(Settings(db=url, migrate_on_start=False))
    assert str(refused.value) == (
        "the database is at schema revision 0016, this trainvitals reads 0020: migrate it with "
        "`trainvitals db upgrade --db URL` (serve does so when it starts); TRAINVITALS_MIGRATE_ON_START=false, "
        "so this start does not migrate"
    )
    assert db.current_revision(url) == "0016"
    db.upgrade(url)
    create_app(Settings(db=url, migrate_on_start=False))  # at head: starts
