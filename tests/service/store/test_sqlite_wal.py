"""A SQLite database is switched to WAL by the first connection that finds it in rollback mode,
also while another connection holds its write lock: SQLite refuses that switch at once ("database
is locked", no busy wait), which made the collector's threads connecting at its start, or a test's
second engine, fail at random."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from sqlalchemy import text

from trainvitals.service.store import db


def test_the_switch_to_wal_waits_for_a_writer_in_rollback_mode(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    writer.execute("CREATE TABLE t (x)")  # as the migrations leave it: rollback mode
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("INSERT INTO t VALUES (1)")
    release = threading.Timer(0.3, writer.execute, ("COMMIT",))
    release.start()
    engine = db.make_engine(f"sqlite:///{path}")
    try:
        began = time.monotonic()
        with engine.connect() as conn:
            mode = conn.execute(text("PRAGMA journal_mode")).scalar_one()
            rows = conn.execute(text("SELECT count(*) FROM t")).scalar_one()
        assert (mode, rows) == ("wal", 1)
        assert time.monotonic() - began >= 0.2, "it waited for the writer's commit"
    finally:
        release.join()
        writer.close()
        engine.dispose()
