"""Engine, sessions and migrations. SQLite is the zero-setup default; PostgreSQL for production."""

from __future__ import annotations

import logging
import random
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry

import trainvitals.migrations as _migrations
from trainvitals.service.periodic import Periodic

DEFAULT_SQLITE_URL = "sqlite:///trainvitals.db"
_BUSY_TIMEOUT_S = 30.0  # how long a SQLite connection waits for another's lock
log = logging.getLogger(__name__)

# One SQLite writer at a time in this process. Threads colliding on SQLite's own lock would wait in
# its busy handler, which sleeps in growing steps (up to 100 ms) rather than waking when the lock
# frees; queueing them on a Python lock hands the database over at once (p99 latency) while the
# waiting threads still parse and validate their batches on the other core. Ingest's writer takes
# it around each group (store/batches.py), the WAL checkpointer to finish a copy (WalCheckpointer).
SQLITE_WRITE_TURN = threading.Lock()


# What PostgreSQL's pg_stat_activity (and a log_line_prefix with %a) shows for a connection the
# collector did not name more precisely: `serve` and `analyse` name theirs (make_engine).
APPLICATION_NAME = "trainvitals"
SERVE_APPLICATION_NAME = "trainvitals-serve"  # the collector's process: ingest, reads, /metrics
ANALYSE_APPLICATION_NAME = "trainvitals-analyse"  # the analysis worker's process


def make_engine(url: str, *, application_name: str = APPLICATION_NAME) -> Engine:
    """An engine tuned for append-heavy ingest on either backend.

    application_name: on PostgreSQL, the name its connections show in pg_stat_activity, so that a
    DBA (and benchmarks/ingest_throughput.py) can tell the collector's ingest from its analysis;
    an `application_name` in the URL's query wins. Unused on SQLite."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": _BUSY_TIMEOUT_S})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: object, _record: object) -> None:
            cur = dbapi_conn.cursor()  # type: ignore[attr-defined]
            # WAL lets /metrics and queries read while ingest writes; NORMAL sync is durable
            # across process crashes (the collector being killed), which is the failure we expect.
            _switch_to_wal(cur)
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            # Every batch inserts into three tables with string-keyed indexes; with SQLite's
            # default 2 MiB page cache those B-tree pages are re-read from the OS on every batch
            # once a run has a few hundred thousand rows. 64 MiB per connection (allocated only
            # as pages are touched) keeps them hot; measured in benchmarks/ingest_throughput.py.
            cur.execute("PRAGMA cache_size=-65536")
            cur.execute("PRAGMA temp_store=MEMORY")
            # Checkpoints (copying the WAL back into the database file) are what made commits
            # expensive: run by whichever connection commits past the threshold, i.e. the ingest
            # writer. WalCheckpointer does them from its own thread instead (sqlite3 releases
            # the GIL, so on another core); this larger threshold is only the backstop.
            cur.execute(f"PRAGMA wal_autocheckpoint={_WAL_BACKSTOP_PAGES}")
            # No journal_size_limit: the analysis's long reads let the WAL grow to 700+ MB under
            # load, and the limit has ingest's writer truncate it at its first commit after the WAL
            # restarts (an ftruncate of 700 MB took 116 ms on this disk; with 64 MiB, p99 at 100k
            # records/s rose from 120-161 to 289-466 ms). The file keeps its largest size until the
            # collector stops (docs/performance.md).
            cur.close()

        return engine
    # In the URL, not connect_args: the analysis lease's own connection (store/lease.py) is made
    # from the engine's URL, and carries the name too.
    parsed = make_url(url)
    if "application_name" not in parsed.query:
        parsed = parsed.update_query_dict({"application_name": application_name})
    engine = create_engine(parsed, pool_size=8, max_overflow=8)
    _ping_when_idle(engine)
    return engine


def _switch_to_wal(cur: sqlite3.Cursor) -> None:
    """Put the database in WAL mode (it stays so): a read where it already is; where it is not
    (a database an older trainvitals migrated, or another tool made), retried while another connection holds
    a write lock. SQLite answers that case "database is locked" at once, without waiting out the
    busy timeout (it would deadlock two connections switching together): the collector's threads
    connecting at its start, or a second process, then failed at random (a CI flake)."""
    if cur.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
        return
    deadline = time.monotonic() + _BUSY_TIMEOUT_S
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(random.uniform(0.005, 0.05))  # apart, so two switching together do not meet again


# A pooled connection idle this long is pinged before use (a database restart or a dropped
# connection is then found at checkout, not by the statement). SQLAlchemy's pool_pre_ping pings on
# every checkout: a round trip per ingest group, whose connection was in use a moment ago.
_PING_AFTER_IDLE_S = 1.0


def _ping_when_idle(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    @event.listens_for(engine, "checkin")
    def _mark_used(_dbapi_conn: object, record: ConnectionPoolEntry) -> None:
        record.info["checked_in_at"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_conn: DBAPIConnection, record: ConnectionPoolEntry, _proxy: object) -> None:
        if time.monotonic() - record.info.get("checked_in_at", 0.0) < _PING_AFTER_IDLE_S:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:  # noqa: BLE001 - any failure: the pool replaces the connection
            raise DisconnectionError(f"idle connection failed its ping: {exc}") from exc


_WAL_BACKSTOP_PAGES = 50_000  # ~200 MB of WAL with 4 KiB pages
_WAL_RESTART_FRAMES = 10_000  # ~40 MB: WalCheckpointer has the WAL start again past this


class WalCheckpointer:
    """Checkpoints a SQLite database's WAL every `interval` seconds from a background thread, and
    has the WAL start again from its beginning once it holds `restart_frames`.

    PASSIVE mode never blocks writers or readers; it copies what it can and leaves the rest for
    the next round. A no-op for other backends.

    Often, because of what a complete checkpoint leaves to the ingest writer: its next commit
    restarts the WAL and syncs it (SQLite does, in NORMAL mode), and that sync's cost grows with the
    WAL written since the last one. At 100k records/s that commit stalled ingest 25-60 ms every
    ~1.8 s with a 1 s interval and ~115 ms with 5 s; with 0.2 s, 15-30 ms (open-loop p99 44-75 ms
    -> 25-29 ms; closed-loop throughput unchanged; docs/performance.md).

    The WAL starts again only when a write transaction begins with every frame copied and no reader
    in it. Under steady ingest a round never gets there by itself: the writer appends while the
    round copies (17-25 ms, its syncs), so the WAL grew to the backstop (`_WAL_BACKSTOP_PAGES`),
    whose checkpoint then ran in ingest's commit: 25-40 ms every ~2.5 s at 100k records/s, over
    half of that benchmark's slow groups (docs/performance.md, session 63). So once the WAL holds
    `restart_frames` and a round copied every frame it found, the checkpointer takes the write turn
    (SQLITE_WRITE_TURN) and copies the few appended meanwhile (about 9 ms): ingest's next transaction
    finds the WAL wholly copied and writes it from its start. At most once per `restart_frames`
    frames; while a reader (the analysis) holds a round short of the end, the turn is not taken.
    """

    def __init__(self, engine: Engine, interval: float = 0.25, restart_frames: int = _WAL_RESTART_FRAMES) -> None:
        self._engine = engine
        self._restart_frames = restart_frames
        self._turn_frames = 0  # the WAL's frames at the last turn, until it starts again
        self._thread = Periodic("trainvitals-wal-checkpoint", interval, self._checkpoint)

    def start(self) -> None:
        if self._engine.dialect.name == "sqlite":
            self._thread.start()

    def stop(self) -> None:
        self._thread.stop()

    def _checkpoint(self) -> None:
        try:
            with self._engine.connect() as conn:
                _, frames, copied = conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)").one()
                if frames < self._turn_frames:  # it started again since the last turn
                    self._turn_frames = 0
                if copied == frames and frames - self._turn_frames >= self._restart_frames:
                    with SQLITE_WRITE_TURN:  # no frame is appended meanwhile
                        conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")
                    self._turn_frames = frames
        except Exception:  # noqa: BLE001 - a busy or closing database: try again next round
            log.debug("WAL checkpoint failed", exc_info=True)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(_migrations.__file__).parent))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


class SchemaError(RuntimeError):
    """The database's schema revision and this trainvitals do not go together; the message names
    both and the fix (one line)."""


class MigrationRefused(SchemaError):
    """A revision that cannot migrate this database's rows; raised inside the migration's
    transaction, so nothing changed. The message names the rows and the fix (one line)."""


def upgrade(url: str, revision: str = "head") -> None:
    _migrate(command.upgrade, url, revision)


def downgrade(url: str, revision: str) -> None:
    """No default: `base` drops every table, so it is asked for by name."""
    _migrate(command.downgrade, url, revision)


def prepare(url: str, *, migrate: bool) -> None:
    """What serve and analyse do at start: migrate to head, or, with TRAINVITALS_MIGRATE_ON_START=false,
    refuse a database not at head (it started, then /v1/runs and /metrics failed on a missing column)."""
    if migrate:
        upgrade(url)
        return
    problem = schema_problem(url)
    if problem is None and current_revision(url) is None:
        problem = "the database has no trainvitals tables: create them with `trainvitals db upgrade --db URL`"
    if problem is not None:
        raise SchemaError(f"{problem}; TRAINVITALS_MIGRATE_ON_START=false, so this start does not migrate")


def _migrate(step: Callable[[Config, str], None], url: str, revision: str) -> None:
    from alembic.util import CommandError

    current, ours = _state(url)
    problem = _not_ours(current, ours) or _wrong_direction(current, revision, upgrading=step is command.upgrade)
    if problem is not None:
        raise SchemaError(problem)
    try:
        step(alembic_config(url), revision)
    except CommandError as exc:
        known = _revisions()[0]
        raise SchemaError(f"{exc}: revisions are head, base, +N/-N or {known[0]}..{known[-1]}") from None


def _revisions() -> tuple[list[str], str]:
    """This code's migration revisions, oldest first, and its head."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    head = script.get_current_head()
    assert head is not None  # migrations/versions holds the schema's migrations
    return [r.revision for r in reversed(list(script.walk_revisions()))], head


def _state(url: str) -> tuple[str | None, set[str]]:
    """The database's schema revision, and which of trainvitals' tables it holds. Tables first:
    an upgrade that commits in between then shows its tables and its revision, never tables
    without a revision."""
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import inspect

    from trainvitals.service.store.models import Base

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ours = set(inspect(conn).get_table_names()) & set(Base.metadata.tables)
            return MigrationContext.configure(conn).get_current_revision(), ours
    finally:
        engine.dispose()


def _not_ours(current: str | None, ours: set[str]) -> str | None:
    """The line for a database trainvitals did not migrate (or a newer one did), else None."""
    known, head = _revisions()
    if current is None:
        if not ours:
            return None  # empty, or another application's: upgrading creates the tables beside its own
        return (f"the database has tables named as trainvitals' ({', '.join(sorted(ours)[:3])}, ...) but no "
                "schema revision (no alembic_version row): `trainvitals db upgrade` did not create them; "
                "point --db / TRAINVITALS_DB at the collector's database or at an empty one")  # fmt: skip
    if current in known:
        return None
    if re.fullmatch(r"\d{4}", current) and current > head:  # trainvitals' revisions are numbered 0001, 0002, ...
        return (f"the database is at schema revision {current!r}, which this trainvitals (schema {head}) "
                "does not know: a newer trainvitals migrated it; use that version, or another database")
    return (f"the database's alembic_version holds revision {current!r}, not one of trainvitals' "
            f"({known[0]}..{head}): another application migrated it; give trainvitals a database of its own")


def _wrong_direction(current: str | None, revision: str, *, upgrading: bool) -> str | None:
    """Alembic does nothing, and says nothing, for an upgrade to a revision the database is past."""
    known = _revisions()[0]
    if current is None or current not in known or revision not in known:
        return None
    at, to = known.index(current), known.index(revision)
    if upgrading and at > to:
        return (f"the database is at schema revision {current}, past {revision}: `db upgrade` only moves "
                f"forward; to go back, `trainvitals db downgrade --revision {revision} --db URL`")
    if not upgrading and at < to:
        return (f"the database is at schema revision {current}, before {revision}: `db downgrade` only moves "
                f"back; to go forward, `trainvitals db upgrade --revision {revision} --db URL`")
    return None


def schema_problem(url: str) -> str | None:
    """Why a reading command cannot use this database's schema (None: it is at this code's head)."""
    current, ours = _state(url)
    if (problem := _not_ours(current, ours)) is not None:
        return problem
    if current is None:
        return None  # the caller says "no trainvitals tables", with its own fix
    head = _revisions()[1]
    if current != head:
        return (f"the database is at schema revision {current}, this trainvitals reads {head}: "
                "migrate it with `trainvitals db upgrade --db URL` (serve does so when it starts)")
    return None


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
