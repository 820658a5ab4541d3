"""create_app at start: the schema check when it does not migrate."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainvitals.service.main import create_app
from trainvitals.service.settings import ConfigError, Settings, load
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
        "the database is at schema revision 0016, this trainvitals reads 0022: migrate it with "
        "`trainvitals db upgrade --db URL` (serve does so when it starts); TRAINVITALS_MIGRATE_ON_START=false, "
        "so this start does not migrate"
    )
    assert db.current_revision(url) == "0016"
    db.upgrade(url)
    create_app(Settings(db=url, migrate_on_start=False))  # at head: starts


@pytest.mark.parametrize(
    ("backend", "env", "wait_s"),
    [("postgresql", None, 0.005), ("sqlite", None, 0.0), ("postgresql", "0", 0.0), ("sqlite", "2.5", 0.0025)],
)
def test_the_writers_wait_for_a_fuller_group_on_postgresql_unless_told_otherwise(
    backend: str, env: str | None, wait_s: float, request: pytest.FixtureRequest, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """PostgreSQL's writers wait 5 ms for more batches by default (a transaction's fixed cost on the
    server); SQLite's one writer does not; TRAINVITALS_INGEST_GROUP_WAIT_MS sets either."""
    if env is not None:
        monkeypatch.setenv("TRAINVITALS_INGEST_GROUP_WAIT_MS", env)
    url = request.getfixturevalue("pg_url") if backend == "postgresql" else f"sqlite:///{tmp_path / 'tv.db'}"
    app = create_app(Settings(db=url))
    try:
        assert app.state.batch_writer._group_wait_s == pytest.approx(wait_s)  # noqa: SLF001
    finally:
        app.state.engine.dispose()


def test_a_negative_group_wait_is_refused_in_one_line_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINVITALS_INGEST_GROUP_WAIT_MS", "-1")
    with pytest.raises(ConfigError) as refused:
        load()
    assert str(refused.value) == (
        "TRAINVITALS_INGEST_GROUP_WAIT_MS='-1': should be greater than or equal to 0: "
        "fix or unset TRAINVITALS_INGEST_GROUP_WAIT_MS"
    )
