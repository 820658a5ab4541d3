"""The analysis lease: of all collector processes sharing a database, one analyses at a time.

Ingest scales out (`serve --workers N`, or several collector hosts on one PostgreSQL); reduction
and detection must not: two analysers would reduce the same steps and race on the summaries and
findings. Each process's analysis thread asks for the lease before every cycle; the holder keeps
it until it stops or dies, and then another process takes over at its next cycle.

- PostgreSQL: a session-level advisory lock on a connection kept for the purpose. The server
  releases it when that connection ends, including when the process is killed.
- SQLite: an exclusive flock on `<database file>.analysis-lock`; the kernel releases it when the
  process exits, however it exits. (An in-memory database has one process: always granted.)

A holder can lose the lease mid-cycle (its lease session killed, timed out, cut off) while another
process takes it: `fence` makes each of the old holder's later write transactions fail instead of
overwriting the new holder's summaries and findings.
"""

from __future__ import annotations

import fcntl
import logging
import os
from typing import Any

from sqlalchemy import Connection, Engine, event, text
from sqlalchemy.orm import Session, SessionTransaction

log = logging.getLogger(__name__)

_PG_LOCK_KEY = 0x7476_414E_414C  # "tvANAL": one key per database, whatever the run
_ONE_PROCESS = object()  # an in-memory SQLite database: nobody else can open it
# The server ends the lease session of a host that vanished (and the lease with it) after about
# idle + interval * count seconds, not its default tcp_keepalives_idle of 2 hours; the client side
# the same, so that a holder cut off from the server stops holding it.
_KEEPALIVE_S = {"idle": 10, "interval": 5, "count": 3}


class LeaseLost(Exception):
    """This process's analysis lease ended: another process may analyse now."""


class RunGone(Exception):
    """The run was deleted while it was analysed."""


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
        self.backend_pid: int | None = None  # the PostgreSQL lease session's, for `fence`
        self.taken = 0  # how many times acquire() took the lease anew (rather than still held it)

    @property
    def held(self) -> bool:
        return self._held is not None

    def acquire(self) -> bool:
        """True when held; `taken` grows when it was not held before (a holder that lost it and took
        it again has missed the cycles run meanwhile by another process)."""
        before = self._held
        got = self._acquire_pg() if self._engine.dialect.name == "postgresql" else self._acquire_sqlite()
        if got and self._held is not before:
            self.taken += 1
        return got

    def release(self) -> None:
        held, self._held = self._held, None
        self.backend_pid = None
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
        k = _KEEPALIVE_S
        try:
            conn = psycopg.connect(
                url,
                autocommit=True,
                keepalives=1,
                keepalives_idle=k["idle"],
                keepalives_interval=k["interval"],
                keepalives_count=k["count"],
            )
        except psycopg.Error:
            return False
        try:
            for name, value in k.items():
                conn.execute(f"SET tcp_keepalives_{name} = {int(value)}")
            row = conn.execute("SELECT pg_try_advisory_lock(%s)", (_PG_LOCK_KEY,)).fetchone()
        except psycopg.Error:
            conn.close()
            return False
        if row and row[0]:
            self._held = conn
            self.backend_pid = conn.info.backend_pid
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


def fence(session: Session, *, lease: AnalysisLease | None, run_id: str | None) -> None:
    """Let `session` write only while `lease` is held (None: no lease asked) and, with run_id, only
    while that run exists: each transaction checks as it begins and again as it commits, and
    raises LeaseLost or RunGone instead (the caller rolls back, dropping the writes).

    On PostgreSQL the check also takes a KEY SHARE lock on the run's `runs` row, held to the end of
    the transaction: a delete (queries.delete_run, which locks the row FOR UPDATE first) waits for
    the write or the write for it, and ingest's updates of the row do not wait at all. The lease is
    checked in pg_locks: the advisory lock still granted to this process's lease session. SQLite:
    one writer at a time and one process analyses (the flock): the run is checked as the
    transaction commits, inside its write lock."""
    pg = session.get_bind().dialect.name == "postgresql"
    pid = lease.backend_pid if lease is not None and pg else None
    if pg and lease is not None and pid is None:
        raise LeaseLost("the analysis lease is not held")

    def check(conn: Connection) -> None:
        held, exists = _pg_fence(conn, pid, run_id) if pg else (True, _exists(conn, run_id))
        if not held:
            raise LeaseLost("the analysis lease ended: another process may be analysing")
        if not exists:
            raise RunGone(f"run {run_id} was deleted")

    def on_begin(_session: Session, _transaction: SessionTransaction, conn: Connection) -> None:
        if pg:
            check(conn)

    def on_commit(s: Session) -> None:
        check(s.connection())

    event.listen(session, "after_begin", on_begin)
    event.listen(session, "before_commit", on_commit)


_A, _B = _PG_LOCK_KEY >> 32, _PG_LOCK_KEY & 0xFFFF_FFFF  # pg_locks' classid, objid of a bigint key
_PG_HELD = (
    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
    f" AND classid::bigint = {_A} AND objid::bigint = {_B} AND objsubid = 1 AND pid = :pid"
)


def _pg_fence(conn: Connection, pid: int | None, run_id: str | None) -> tuple[bool, bool]:
    """(the lease is held or none was asked, the run exists or none was named)."""
    held = pid is None or conn.execute(text(_PG_HELD), {"pid": pid}).first() is not None
    if run_id is None or not held:
        return held, True
    row = conn.execute(text("SELECT 1 FROM runs WHERE run_id = :rid FOR KEY SHARE"), {"rid": run_id}).first()
    return held, row is not None


def _exists(conn: Connection, run_id: str | None) -> bool:
    if run_id is None:
        return True
    return conn.execute(text("SELECT 1 FROM runs WHERE run_id = :rid"), {"rid": run_id}).first() is not None
