"""The analysis lease: of all collector processes sharing a database, one analyses at a time.

Ingest scales out (`serve --workers N`, or several collector hosts on one PostgreSQL); reduction
and detection must not: two analysers would reduce the same steps and race on the summaries and
findings. Each process's analysis thread asks for the lease before every cycle; the holder keeps
it until it stops or dies, and then another process takes over at its next cycle.

- PostgreSQL: a session-level advisory lock on a connection kept for the purpose. The server
  releases it when that connection ends, including when the process is killed.
- SQLite: an exclusive flock on `<database file>.analysis-lock`; the kernel releases it when the
  process exits, however it exits. (An in-memory database has one process: always granted.)
"""

from __future__ import annotations

import fcntl
import logging
import os
from typing import Any

from sqlalchemy import Engine

log = logging.getLogger(__name__)

_PG_LOCK_KEY = 0x7476_414E_414C  # "tvANAL": one key per database, whatever the run
_ONE_PROCESS = object()  # an in-memory SQLite database: nobody else can open it


class AnalysisLease:
    """Usage::

    lease = AnalysisLease(engine)
    if lease.acquire():   # cheap when already held; retried every cycle when not
        analyse()
    lease.release()
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._held: Any = None  # the PostgreSQL connection or the locked file descriptor

    @property
    def held(self) -> bool:
        return self._held is not None

    def acquire(self) -> bool:
        if self._engine.dialect.name == "postgresql":
            return self._acquire_pg()
        return self._acquire_sqlite()

    def release(self) -> None:
        held, self._held = self._held, None
        if held is None or held is _ONE_PROCESS:
            return
        try:
            if isinstance(held, int):
                os.close(held)  # closing the descriptor drops the flock
            else:
                held.close()  # ending the session drops the advisory lock
        except Exception:  # noqa: BLE001 - already gone is released too
            log.debug("releasing the analysis lease", exc_info=True)

    def _acquire_pg(self) -> bool:
        if self._held is not None:
            try:  # still ours as long as the session is alive
                self._held.execute("SELECT 1")
                return True
            except Exception:  # noqa: BLE001 - the connection died: the server released the lock
                self.release()
        import psycopg

        url = self._engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        try:
            conn = psycopg.connect(url, autocommit=True)
        except psycopg.Error:
            return False
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (_PG_LOCK_KEY,)).fetchone()
        if row and row[0]:
            self._held = conn
            return True
        conn.close()
        return False

    def _acquire_sqlite(self) -> bool:
        if self._held is not None:
            return True
        path = self._engine.url.database
        if not path or path == ":memory:":
            self._held = _ONE_PROCESS
            return True
        fd = os.open(f"{path}.analysis-lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._held = fd
        return True
