"""Turn validated wire messages into rows, atomically and idempotently.

The HTTP route and `trainvitals replay` both call `store_batch`: one transaction inserts the
batch's idempotency row and all its records, so a batch is stored whole or not at all, and a
retried batch (same run, rank, incarnation, seq) is acknowledged without storing anything.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractContextManager, nullcontext
from operator import attrgetter, itemgetter
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from trainvitals.service.store.models import RECORD_TABLES, DeliveredBatch, ReductionState, Run
from trainvitals.wire import Batch, BatchAck, RunRegistration


class UnknownRunError(LookupError):
    """A batch arrived for a run that was never registered."""


class WrongProjectError(PermissionError):
    """The run belongs to another project than the caller's token."""


def register_run(session: Session, registration: RunRegistration, *, now: float | None = None) -> bool:
    """Insert the run if new; returns True when it was created. Re-registration is a no-op."""
    now = time.time() if now is None else now
    existing = session.get(Run, registration.run)
    if existing is not None:
        if existing.project != registration.project:
            raise ValueError(
                f"run {registration.run!r} is registered under project {existing.project!r}, "
                f"not {registration.project!r}"
            )
        existing.last_seen_at = now
        if existing.status != "running":
            existing.status = "running"  # a resumed run is live again
        session.commit()
        return False
    session.add(
        Run(
            run_id=registration.run,
            project=registration.project,
            registration=registration.model_dump(mode="json"),
            world_size=registration.parallelism.world_size,
            status="running",
            created_at=registration.started_at or now,
            last_seen_at=now,
        )
    )
    try:
        session.commit()
    except IntegrityError:  # a concurrent registration from another rank won the race
        session.rollback()
        return False
    return True


# The record kinds every rank sends every step go through the fast path: one tuple per record
# (attrgetter, no model_dump), written with COPY on PostgreSQL and one executemany on SQLite.
# Checkpoints and events are rare and carry JSON columns; they keep the generic Core insert.
_FAST_KINDS = ("step", "tensor", "grad")
_PREFIX = ("run_id", "rank", "incarnation")


def _fast_columns(kind: str) -> tuple[str, ...]:
    """Table columns filled from the record, in table order (not id, not the batch's prefix)."""
    return tuple(c.name for c in RECORD_TABLES[kind].columns if c.name not in ("id", *_PREFIX))


_FAST_COLUMNS = {kind: _fast_columns(kind) for kind in _FAST_KINDS}
_FAST_GETTERS = {
    kind: attrgetter(*("group" if c == "group_name" else c for c in cols))
    for kind, cols in _FAST_COLUMNS.items()
}
_STEP_OF_ROW = itemgetter(len(_PREFIX))
assert all(cols[0] == "step" for cols in _FAST_COLUMNS.values())
_SQLITE_INSERT = {
    kind: f"INSERT INTO {RECORD_TABLES[kind].name} ({', '.join((*_PREFIX, *cols))}) "
    f"VALUES ({', '.join('?' * (len(_PREFIX) + len(cols)))})"
    for kind, cols in _FAST_COLUMNS.items()
}
_PG_COPY = {
    kind: f"COPY {RECORD_TABLES[kind].name} ({', '.join((*_PREFIX, *cols))}) FROM STDIN"
    for kind, cols in _FAST_COLUMNS.items()
}


def batch_rows(
    batch: Batch,
) -> tuple[dict[str, list[tuple[Any, ...]]], dict[str, list[dict[str, Any]]], int | None]:
    """A batch's records as rows (pure): tuples for the fast kinds in (run_id, rank, incarnation,
    *_FAST_COLUMNS[kind]) order, dicts for checkpoints and events, and the lowest step seen."""
    fast: dict[str, list[tuple[Any, ...]]] = {kind: [] for kind in _FAST_KINDS}
    other: dict[str, list[dict[str, Any]]] = {}
    prefix = (batch.run, batch.rank, batch.incarnation)
    getters = _FAST_GETTERS
    for record in batch.records:
        getter = getters.get(record.kind)
        if getter is not None:
            fast[record.kind].append(prefix + getter(record))
        else:
            row = record.model_dump(exclude={"kind"})
            row.update(run_id=batch.run, rank=batch.rank, incarnation=batch.incarnation)
            other.setdefault(record.kind, []).append(row)
    # `step` follows the prefix in every fast table (asserted at import): the low step is a C-level min.
    lows = [min(map(_STEP_OF_ROW, rows)) for rows in fast.values() if rows]
    low = min(lows) if lows else None
    return {k: v for k, v in fast.items() if v}, other, low


def _write_fast(session: Session, kind: str, rows: list[tuple[Any, ...]]) -> None:
    """Inside the session's transaction: COPY on PostgreSQL, one executemany elsewhere."""
    conn = session.connection()
    if conn.dialect.name == "postgresql":
        # COPY skips per-row statement execution on the server and per-row binds in the driver:
        # the cheapest way into PostgreSQL, and it runs in the same transaction as the batch row.
        raw = conn.connection.driver_connection
        with raw.cursor() as cur, cur.copy(_PG_COPY[kind]) as copy:  # type: ignore[union-attr]
            for row in rows:
                copy.write_row(row)
    else:
        # Plain DBAPI executemany: SQLAlchemy's per-row bind processing is not needed for these
        # column types (float, int, str, bool), and skipping it is most of the SQLite insert cost.
        conn.exec_driver_sql(_SQLITE_INSERT[kind], rows)  # type: ignore[arg-type]


def _mark_late_data(session: Session, run_id: str, low: int | None) -> None:
    """Records for steps already reduced (a spool replayed after an outage) re-dirty them."""
    if low is None:
        return
    state = session.get(ReductionState, run_id)
    if state is not None and low <= state.reduced_upto:
        state.dirty_from = low if state.dirty_from is None else min(state.dirty_from, low)


# SQLite has one writer at a time. Threads of this process colliding on its lock would wait in
# SQLite's busy handler, which sleeps in growing steps (up to 100 ms) rather than waking when the
# lock frees; queueing them on a Python lock hands the database over at once (p99 latency) while
# the waiting threads still parse and validate their batches on the other core.
_SQLITE_WRITER = threading.Lock()


def _writer(session: Session) -> AbstractContextManager[object]:
    return _SQLITE_WRITER if session.get_bind().dialect.name == "sqlite" else nullcontext()


# last_seen_at only feeds the idle horizon of live runs (an hour by default), so rewriting the one
# `runs` row of a 16,384-rank run from every batch buys nothing and, on PostgreSQL, makes
# concurrent batch transactions queue on that row's lock. Once a second is plenty.
_LAST_SEEN_RESOLUTION_S = 1.0


def store_batch(
    session: Session, batch: Batch, *, now: float | None = None, project: str | None = None
) -> BatchAck:
    """Store one batch atomically; a duplicate is acknowledged and stores nothing.

    project: the caller's project (None: auth off); a run of another project is refused.
    """
    now = time.time() if now is None else now
    run = session.execute(
        select(Run.project, Run.last_seen_at, Run.status).where(Run.run_id == batch.run)
    ).first()
    if run is None:
        raise UnknownRunError(f"run {batch.run!r} is not registered: POST /v1/runs first")
    if project is not None and run.project != project:
        raise WrongProjectError(
            f"run {batch.run!r} belongs to another project than this token's ({project!r})"
        )
    # Rows are built before the write transaction starts: on SQLite nothing else can write while
    # it is open, so it should hold only the inserts.
    fast, other, low = batch_rows(batch)
    with _writer(session):
        try:
            # The idempotency row first: a retried batch conflicts here, before any record is written.
            session.execute(
                insert(DeliveredBatch.__table__),
                {
                    "run_id": batch.run,
                    "rank": batch.rank,
                    "incarnation": batch.incarnation,
                    "seq": batch.seq,
                    "received_at": now,
                    "records": len(batch.records),
                },
            )
        except IntegrityError:
            session.rollback()
            return BatchAck(accepted=0, duplicate=True)
        for kind, rows in fast.items():
            _write_fast(session, kind, rows)
        for kind, dict_rows in other.items():
            session.execute(insert(RECORD_TABLES[kind]), dict_rows)
        _mark_late_data(session, batch.run, low)
        values: dict[Any, Any] = {}
        if now - run.last_seen_at >= _LAST_SEEN_RESOLUTION_S or run.status != "running":
            values[Run.last_seen_at] = now
        if batch.rank == 0 and any(r.kind == "event" and r.event == "stop" for r in batch.records):
            values[Run.status] = "finished"  # rank 0 closing its agent ends the run
        if values:
            session.execute(update(Run).where(Run.run_id == batch.run).values(values))
        session.commit()
    return BatchAck(accepted=len(batch.records), duplicate=False)
