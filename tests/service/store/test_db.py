"""The PostgreSQL pool pings a connection only after it sat idle, and replaces one that died; a
SQLite WAL that a long read made large is truncated once checkpoints catch up."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import text

from trainvitals.service.store import db


def _backend_pid(engine: object) -> int:
    with engine.connect() as conn:  # type: ignore[attr-defined]
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_a_connection_in_use_is_not_pinged_again(empty_pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = db.make_engine(empty_pg_url)
    pings: list[object] = []
    real_ping = engine.dialect.do_ping
    monkeypatch.setattr(engine.dialect, "do_ping", lambda c: pings.append(c) or real_ping(c))
    try:
        pids = {_backend_pid(engine) for _ in range(20)}
        assert len(pids) == 1  # one pooled connection, reused
        assert pings == []  # each checkout came within the idle window of the last use
        monkeypatch.setattr(db, "_PING_AFTER_IDLE_S", 0.0)
        _backend_pid(engine)
        assert len(pings) == 1
    finally:
        engine.dispose()


def test_an_idle_connection_that_died_is_replaced_at_checkout(
    empty_pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = db.make_engine(empty_pg_url)
    try:
        dead = _backend_pid(engine)
        admin = empty_pg_url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(admin, autocommit=True) as conn:
            assert conn.execute("SELECT pg_terminate_backend(%s)", (dead,)).fetchone() == (True,)
        monkeypatch.setattr(db, "_PING_AFTER_IDLE_S", 0.0)  # as if it sat idle past the window
        assert _backend_pid(engine) not in (dead, 0)  # the statement ran on a fresh connection
    finally:
        engine.dispose()


def test_a_sqlite_wal_grown_behind_a_long_read_shrinks_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that holds its snapshot (the analysis's long reads) keeps checkpoints from copying
    the WAL back, so it grows; once the reader is done, a checkpoint (WalCheckpointer's PASSIVE)
    and the next commit bring the file back under the limit instead of keeping its largest size."""
    monkeypatch.setattr(db, "_WAL_SIZE_LIMIT_BYTES", 256 * 1024)
    path = tmp_path / "tv.db"
    engine = db.make_engine(f"sqlite:///{path}")
    wal = Path(f"{path}-wal")
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE t (v BLOB)")
        reader = sqlite3.connect(path)
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM t").fetchone()  # its snapshot pins the WAL
        for _ in range(8):
            with engine.begin() as conn:
                conn.exec_driver_sql("INSERT INTO t VALUES (randomblob(256 * 1024))")
            db.WalCheckpointer(engine)._checkpoint()  # copies nothing past the reader's snapshot
        grown = wal.stat().st_size
        reader.rollback()
        reader.close()
        db.WalCheckpointer(engine)._checkpoint()  # now everything is copied back
        with engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO t VALUES (x'00')")  # restarts the WAL: truncated
        assert grown > 2 * 1024 * 1024
        assert wal.stat().st_size <= 256 * 1024
    finally:
        engine.dispose()
