"""Alembic environment: metadata from the models, URL from the caller (see store/db.py)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, Engine, engine_from_config, event, pool, text

from trainvitals.service.store.models import Base

config = context.config
target_metadata = Base.metadata

# pg_advisory_xact_lock key for "migrating": another key than the analysis lease's (store/lease.py).
_PG_MIGRATION_LOCK = 0x7476_4D49_4752  # "tvMIGR"
# How long a SQLite upgrade waits for the write lock: another upgrade may be running a long revision.
_SQLITE_WAIT_MS = 600_000


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        _run(connectable)
        return
    engine = engine_from_config(
        config.get_section(config.config_ini_section, {}), prefix="sqlalchemy.", poolclass=pool.NullPool
    )
    if engine.dialect.name == "sqlite":
        _sqlite_transactions(engine)
    with engine.connect() as connection:
        _run(connection)


def _sqlite_transactions(engine: Engine) -> None:
    """pysqlite BEGINs only before INSERT/UPDATE/DELETE and runs DDL outside any transaction: a
    migration killed midway left its first half committed (0007's batch rebuild: the table
    _alembic_tmp_steps, the version still 0006) and every later start failed on it. With the
    driver's transaction handling off and our own BEGIN (SQLAlchemy's pysqlite recipe,
    "Serializable isolation / Savepoints / Transactional DDL"), the upgrade is one transaction that
    rolls back whole. IMMEDIATE takes the write lock before the version is read, so a second
    upgrade at the same time waits, then finds the first's revision."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: object, _record: object) -> None:
        dbapi_conn.isolation_level = None  # type: ignore[attr-defined]
        dbapi_conn.execute(f"PRAGMA busy_timeout = {_SQLITE_WAIT_MS}")  # type: ignore[attr-defined]

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _run(connection: Connection) -> None:
    # render_as_batch: SQLite cannot ALTER most things; batch mode rebuilds tables instead.
    # transactional_ddl: one transaction for the whole upgrade on SQLite too (Alembic's default
    # there is one per revision), so an interrupted upgrade leaves the database where it was.
    context.configure(
        connection=connection, target_metadata=target_metadata, render_as_batch=True, transactional_ddl=True
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Replicas (and serve with its analysis child) migrate at every start: the second to
            # come waits here until the first commits, then reads the version it left (Alembic
            # reads it after this), instead of repeating its DDL (DuplicateColumn, a traceback).
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
