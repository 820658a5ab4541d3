"""SQLite's WAL. A database is switched to WAL by the first connection that finds it in rollback
mode, also while another connection holds its write lock: SQLite refuses that switch at once
("database is locked", no busy wait), which made the collector's threads connecting at its start,
or a test's second engine, fail at random. And the WAL checkpointer has the WAL start again under
a writer that never pauses (store/db.py WalCheckpointer)."""

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


def _wal_frames_written(path: Path, *, restart_frames: int, seconds: float = 1.0) -> int:
    """The largest the WAL grew (frames) while one thread committed small transactions back to
    back in the process's write turn, as ingest's writer does, beside a WalCheckpointer."""
    engine = db.make_engine(f"sqlite:///{path}")
    checkpointer = db.WalCheckpointer(engine, interval=0.02, restart_frames=restart_frames)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE t (x BLOB)"))
        checkpointer.start()
        deadline = time.monotonic() + seconds
        with engine.connect() as conn:
            while time.monotonic() < deadline:
                with db.SQLITE_WRITE_TURN:
                    conn.execute(text("INSERT INTO t VALUES (randomblob(3000)), (randomblob(3000))"))
                    conn.commit()
            # Read while a connection is open: the last one to close deletes the WAL.
            frames = (path.with_name(path.name + "-wal").stat().st_size - 32) // (24 + 4096)
    finally:
        checkpointer.stop()
        engine.dispose()
    return frames


def test_the_checkpointer_has_the_wal_start_again_under_a_steady_writer(tmp_path: Path) -> None:
    """SQLite writes the WAL from its start again only when a transaction begins with every frame
    copied back: a checkpoint beside a writer that never pauses never gets there, and the WAL grew
    to its 50,000-frame backstop, whose checkpoint then ran in ingest's commit (25-40 ms every 2.5 s
    at 100k records/s). The checkpointer now finishes its copy in the write turn once the WAL holds
    `restart_frames`, and the WAL file stays a fraction of the control's (about 3,000 frames against
    44,000 here: a round every 20 ms lets ~900 frames in between)."""
    control = _wal_frames_written(tmp_path / "control.db", restart_frames=10**9)  # the turn never taken
    kept = _wal_frames_written(tmp_path / "kept.db", restart_frames=200)
    assert control > 2_000, f"the control's writer should have grown the WAL past 2,000 frames: {control}"
    assert kept * 4 < control, f"the WAL should start again near 200 frames, it reached {kept} (control: {control})"
