"""Alembic: upgrade from empty and downgrade back, on SQLite and on PostgreSQL."""

from pathlib import Path

from sqlalchemy import inspect

from trainvitals.service.store import db
from trainvitals.service.store.models import Base


def _tables(url: str) -> set[str]:
    engine = db.make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _round_trip(url: str) -> None:
    db.upgrade(url)
    expected = {t.name for t in Base.metadata.sorted_tables}
    assert expected <= _tables(url)
    assert db.current_revision(url) is not None
    db.downgrade(url, "base")
    assert _tables(url) - {"alembic_version"} == set()
    assert db.current_revision(url) is None
    db.upgrade(url)  # and up again: downgrade left nothing behind that blocks it
    assert expected <= _tables(url)


def test_sqlite_upgrade_downgrade(tmp_path: Path) -> None:
    _round_trip(f"sqlite:///{tmp_path / 'm.db'}")


def test_postgresql_upgrade_downgrade(empty_pg_url: str) -> None:
    _round_trip(empty_pg_url)


def test_models_and_migrations_agree(tmp_path: Path) -> None:
    """Autogenerate finds nothing to do after upgrading: no schema change without a revision."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    url = f"sqlite:///{tmp_path / 'agree.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    engine.dispose()
