"""Turn validated wire messages into rows, atomically and idempotently.

`store_batches` is the one write path: the HTTP route reaches it through the group-commit writer
(service/ingest/batch_writer.py, many batches per transaction), `trainvitals replay` and tests through
`store_batch` (one). A transaction inserts its batches' idempotency rows and all their records,
so a batch is stored whole or not at all, and a retried batch (same run, rank, incarnation, seq)
is acknowledged without storing anything.
"""

from __future__ import annotations

import functools
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from itertools import chain, groupby
from operator import attrgetter
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias, cast

from msgspec.structs import astuple
from sqlalchemy import (
    BigInteger,
    Boolean,
    Integer,
    String,
    Table,
    bindparam,
    case,
    delete,
    insert,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import Executable

from trainvitals.service.store import run_keys
from trainvitals.service.store.db import SQLITE_WRITE_TURN
from trainvitals.service.store.models import (
    RECORD_TABLES,
    DeliveredBatch,
    IngestCount,
    ReductionState,
    RefusedIncarnation,
    Run,
    table_of,
)
from trainvitals.service.store.types import NAN_TEXT, Real
from trainvitals.wire import Batch, BatchAck, RunRegistration

if TYPE_CHECKING:
    from trainvitals.service.ingest.decode import Batch as FastBatch

# What ingest stores: a pydantic batch (replay, tests) or the route's msgspec decoding of one
# (the two read alike). A string: the store does not import the ingest half it serves.
AnyBatch: TypeAlias = "Batch | FastBatch"


class UnknownRunError(LookupError):
    """A batch arrived for a run that was never registered."""


class WrongProjectError(PermissionError):
    """The run belongs to another project than the caller's token."""


class UnstorableBatchError(ValueError):
    """The database refused a value of this batch (e.g. an integer beyond its column's range).

    Retrying cannot help, so the sender gets a 422 rather than a 503."""


class RunConflictError(ValueError):
    """A registration of an existing run id by another job (its model or layout contradicts the
    stored registration): refused (409), and so are the batches of the process that sent it."""


class RefusedIncarnationError(ValueError):
    """A batch of a process whose registration was refused as another job (409, the same reason)."""


# What tells one job from another under the same run id. A relaunch of the job (a crash, a requeue,
# torchrun restarting it) keeps all of them; another job (a different model, a different size of
# job that derived the same default run id from MASTER_ADDR:MASTER_PORT) rarely does. Every rank
# must send the same values, or the job would refuse its own ranks: so not layers and parameter
# counts, which an agent counting its own module sees per pipeline stage or shard. Batch sizes,
# sequence length, recompute, ZeRO stage, FP8 recipe, checkpoints and tags may change on a relaunch.
_IDENTITY: dict[str, tuple[str, ...]] = {
    "model": (
        "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "experts", "active_experts", "shared_ffn_hidden",
        "head_dim", "attention_core_width",
    ),
    "parallelism": ("world_size", "tp", "pp", "cp", "ep"),
}


def _contradictions(stored: dict[str, Any], registration: RunRegistration) -> list[str]:
    """'section.field: X registered, Y now' per identity field the registration sets to another
    value than the stored registration holds; a value absent (None, or not sent) on either side
    contradicts nothing (an older agent that did not derive the model dims is not another job)."""
    out = []
    for section, names in _IDENTITY.items():
        new, old = getattr(registration, section), stored.get(section) or {}
        for name in names:
            was, now = old.get(name), getattr(new, name)
            if name in new.model_fields_set and None not in (was, now) and was != now:
                out.append(f"{section}.{name}: {was} registered, {now} now")
    return out


def _fence(session: Session, run_key: str, registration: RunRegistration, reason: str, now: float) -> None:
    """Remember the refused process (committed: the registration's request fails, the fence stays)."""
    if registration.incarnation is not None:
        key = (run_key, registration.incarnation)
        if session.get(RefusedIncarnation, key) is None:
            session.add(RefusedIncarnation(run_id=key[0], incarnation=key[1], refused_at=now, reason=reason))
    try:
        session.commit()
    except IntegrityError:  # the same process's retry raced this one: fenced either way
        session.rollback()


def register_run(
    session: Session, registration: RunRegistration, *, now: float | None = None, unique_ids: bool = False
) -> bool:
    """Insert the run if new (under its project's key, store/run_keys.py); True when it was created.

    unique_ids: refuse (ValueError) a run id another project has (auth off: a batch names no
    project, so its run id must name one run).

    An existing run id registered again is a relaunch of the same job (a restart: a new
    incarnation, whose steps replace the old ones at equal steps) when the project agrees and so does
    the job's identity (`_IDENTITY`: model dims, world size, tp/pp/cp/ep), or when the registration
    declares `resume` (then it describes the run from now on). Anything else is another job reusing
    the id: RunConflictError names what differs and the fix, and the sending process's batches are
    refused from then on (docs/wire-format.md, "Run ids").
    """
    now = time.time() if now is None else now
    key = run_keys.run_key(registration.project, registration.run)
    existing = session.get(Run, key)
    if existing is None and unique_ids and run_keys.keys_by_id(session, registration.run):
        raise ValueError(f"run {registration.run!r} is registered under another project than {registration.project!r}")
    if existing is not None:
        differs = _contradictions(existing.registration, registration)
        if differs and not registration.resume:
            reason = (
                f"run {registration.run!r} is registered for another job ({'; '.join(differs)}): nothing of "
                "this process is stored under it. Give this job its own run id (attach(run=...) or "
                "TRAINVITALS_RUN); if it continues that run on a new model or layout, register it with "
                "resume=true (attach(registration={'resume': True}))"
            )
            _fence(session, key, registration, reason, now)
            raise RunConflictError(reason)
        if differs:  # a declared resume on a new layout: the run's world size and config are its own now
            existing.registration = registration.model_dump(mode="json")
            existing.world_size = registration.parallelism.world_size
        if registration.incarnation is not None:  # accepted now (e.g. declared a resume): not fenced
            t = RefusedIncarnation
            session.execute(delete(t).where(t.run_id == key, t.incarnation == registration.incarnation))
        existing.last_seen_at = now
        if existing.status != "running":
            existing.status = "running"  # a resumed run is live again
        session.commit()
        return False
    session.add(
        Run(
            run_id=key,
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


# The record kinds every rank sends every step go through the fast path: a batch's records of a
# kind become one flat list of column values (no model_dump, no object per record), written with
# COPY on PostgreSQL and multi-row INSERTs on SQLite. Checkpoints and events are rare and carry
# JSON columns; they keep the generic Core insert.
_FAST_KINDS = ("step", "tensor", "grad")
_PREFIX = ("run_id", "rank", "incarnation")


def _fast_columns(kind: str) -> tuple[str, ...]:
    """Table columns filled from the record, in table order (not id, not the batch's prefix)."""
    return tuple(c.name for c in RECORD_TABLES[kind].columns if c.name not in ("id", *_PREFIX))


_FAST_COLUMNS = {kind: _fast_columns(kind) for kind in _FAST_KINDS}
_FAST_GETTERS = {
    kind: attrgetter(*("group" if c == "group_name" else c for c in cols)) for kind, cols in _FAST_COLUMNS.items()
}
# Checkpoints and events: record attributes by column name (pydantic models and msgspec structs alike).
_OTHER_COLUMNS = {
    kind: tuple(c.name for c in table.columns if c.name not in ("id", *_PREFIX))
    for kind, table in RECORD_TABLES.items()
    if kind not in _FAST_KINDS
}
_WIDTH = {kind: len(_PREFIX) + len(cols) for kind, cols in _FAST_COLUMNS.items()}  # values per row
assert all(cols[0] == "step" for cols in _FAST_COLUMNS.values())


class SqliteInsert(NamedTuple):
    """sqlite_multirow's arguments for rows of some columns of a table, in order."""

    sql: str
    """The one-row INSERT."""
    real: tuple[int, ...]
    """Positions of the REAL columns (NaN written as text)."""
    nullable: tuple[int, ...]
    """Positions of the nullable columns (None in every row of a chunk: a literal NULL)."""
    boolean: tuple[int, ...]
    """Positions of the BOOLEAN columns (the same in every row of a chunk: a literal 0 or 1)."""


def sqlite_insert(table: Table, names: Sequence[str]) -> SqliteInsert:
    """The SqliteInsert of rows of `names`, columns of `table` in that order."""
    columns = [table.c[name] for name in names]
    return SqliteInsert(
        sql=f"INSERT INTO {table.name} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
        real=tuple(i for i, c in enumerate(columns) if isinstance(c.type, Real)),
        nullable=tuple(i for i, c in enumerate(columns) if c.nullable),
        boolean=tuple(i for i, c in enumerate(columns) if isinstance(c.type, Boolean)),
    )


_SQLITE_PLAN = {kind: sqlite_insert(RECORD_TABLES[kind], (*_PREFIX, *cols)) for kind, cols in _FAST_COLUMNS.items()}
_SQLITE_INSERT = {kind: plan.sql for kind, plan in _SQLITE_PLAN.items()}  # also the benchmark's floor statement


class PgCopy(NamedTuple):
    """A binary COPY of rows of some columns of a table, in order. psycopg packs each value in C
    instead of formatting text (about a third of the client's per-row cost), and the server skips
    parsing numbers from text."""

    sql: str
    types: list[str]
    """The columns' binary types (psycopg's set_types)."""


# Column type -> PostgreSQL binary type; BigInteger before Integer, its base class.
_PG_BINARY_TYPES = ((BigInteger, "int8"), (Integer, "int4"), (Real, "float8"), (Boolean, "bool"), (String, "varchar"))


def pg_copy(table: Table, names: Sequence[str]) -> PgCopy | None:
    """The PgCopy of rows of `names`, columns of `table` in that order; None when a column's type
    is not one of _PG_BINARY_TYPES (JSON)."""
    types = [next((t for cls, t in _PG_BINARY_TYPES if isinstance(table.c[n].type, cls)), None) for n in names]
    if None in types:
        return None
    sql = f"COPY {table.name} ({', '.join(names)}) FROM STDIN (FORMAT BINARY)"
    return PgCopy(sql, [t for t in types if t is not None])


def pg_copy_rows(dbapi: Any, plan: PgCopy, rows: Iterable[Sequence[Any]]) -> None:
    """rows through the plan's COPY, in the psycopg connection's transaction."""
    with dbapi.cursor() as cur, cur.copy(plan.sql) as copy:
        copy.set_types(plan.types)
        write_row = copy.write_row
        for row in rows:
            write_row(row)


_PG_PLAN = {kind: cast(PgCopy, pg_copy(RECORD_TABLES[kind], (*_PREFIX, *cols))) for kind, cols in _FAST_COLUMNS.items()}
assert all(_PG_PLAN.values())  # every fast column has a binary type


FlatRowsByKind = dict[str, list[Any]]
DictRowsByKind = dict[str, list[dict[str, Any]]]
BatchRows = tuple[FlatRowsByKind, DictRowsByKind, int | None]


def batch_rows(batch: AnyBatch) -> BatchRows:
    """A batch's records as rows (pure): for each fast kind one flat list of values, row after row
    in (run_id, rank, incarnation, *_FAST_COLUMNS[kind]) order (`_WIDTH[kind]` values a row), dicts
    for checkpoints and events, and the lowest step seen.

    Flat, not a tuple per row: the rows wait in the writer's queue, and 216 tuples per request
    were most of what the garbage collector had to visit; the statements want flat parameters."""
    fast: dict[str, list[Any]] = {}
    other: dict[str, list[dict[str, Any]]] = {}
    prefix = (batch.run, batch.rank, batch.incarnation)
    row_of = _ROW_OF
    # By runs of one record type (an agent's batch is a few long runs: a step's tensors, its
    # gradient groups): the type's lookups once a run, not once a record, take a fifth off the
    # time (docs/performance.md, session 59).
    for record_type, same_type in groupby(batch.records, type):
        records = list(same_type)
        kind, getter = row_of.get(record_type) or _learn_row_of(records[0])
        if getter is not None:
            flat = fast.setdefault(kind, [])
            for record in records:
                flat += prefix
                flat += getter(record)
        else:
            dict_rows = other.setdefault(kind, [])
            for record in records:
                row = {column: getattr(record, column) for column in _OTHER_COLUMNS[kind]}
                # A restarted rank's record about its previous process's save is stored under that one.
                saved_by = getattr(record, "saved_by_incarnation", None)
                incarnation = batch.incarnation if saved_by is None else saved_by
                row.update(run_id=batch.run, rank=batch.rank, incarnation=incarnation)
                dict_rows.append(row)
    # `step` follows the prefix in every fast table (asserted at import): a strided slice, a C-level min.
    lows = [min(flat[len(_PREFIX) :: _WIDTH[kind]]) for kind, flat in fast.items()]
    return fast, other, min(lows) if lows else None


# Record type -> (kind, its row's values in _FAST_COLUMNS order; None for checkpoints and events).
_ROW_OF: dict[type, tuple[str, Callable[[Any], tuple[Any, ...]] | None]] = {}


def _learn_row_of(record: Any) -> tuple[str, Callable[[Any], tuple[Any, ...]] | None]:
    """The route's msgspec structs (service/ingest/decode.py) have the table's columns as their
    fields, in order: msgspec's astuple reads a row in one C call, 40% less than attrgetter
    (about 30 us per batch). Any other record (pydantic: replay, tests, the route's fallback) is
    read by attribute name."""
    kind = record.kind
    getter: Callable[[Any], tuple[Any, ...]] | None = _FAST_GETTERS.get(kind)
    if getter is not None:
        columns = tuple("group" if c == "group_name" else c for c in _FAST_COLUMNS[kind])
        if getattr(type(record), "__struct_fields__", None) == columns:
            getter = astuple
    return _ROW_OF.setdefault(type(record), (kind, getter))


def _write_fast(session: Session, kind: str, flat: list[Any]) -> None:
    """Inside the session's transaction: COPY on PostgreSQL, multi-row INSERTs elsewhere."""
    conn = session.connection()
    if conn.dialect.name == "postgresql":
        # COPY skips per-row statement execution on the server and per-row binds in the driver:
        # the cheapest way into PostgreSQL, and it runs in the same transaction as the batch row.
        rows = zip(*[iter(flat)] * _WIDTH[kind], strict=True)  # the flat list, row by row
        pg_copy_rows(conn.connection.driver_connection, _PG_PLAN[kind], rows)
    else:
        # Plain DBAPI statements: SQLAlchemy's per-row bind processing is not needed for these
        # column types (float, int, str, bool; NaN handled here), and skipping it is most of the
        # SQLite insert cost.
        sqlite_multirow(conn.connection.driver_connection, _SQLITE_PLAN[kind], flat)


# Rows per statement at most. Every sqlite3 execute releases the GIL around its step and must take
# it back from the event loop, which holds it up to the switch interval (5 ms) while it decodes
# requests: under load those waits, not SQLite, were most of a group's time. So few, large
# statements: 4,096 rows (20 columns: 81,920 variables), fewer when the library's variable limit
# is lower (32,766 by default since SQLite 3.32).
_SQLITE_CHUNK_ROWS = 4096
# Fewer rows than this take at most two statements: a multiple of _SQLITE_ROW_STEP, then the rest
# (a group of 11 ordinary batches has 220 gradient rows: 208 + 12, against five power-of-two
# chunks). The sizes stay few, 30 below 256 for each statement, so sqlite3's cache of prepared
# statements (128 a connection) keeps them: preparing a 192-row INSERT costs 0.8 ms, four times
# executing it. Larger counts take power-of-two chunks down to a remainder below this.
_SQLITE_SMALL_ROWS = 256
_SQLITE_ROW_STEP = 16


@functools.lru_cache(maxsize=256)  # sizes x statements x the columns written as literals
def _sqlite_values_sql(head: str, values: str, rows: int, literals: tuple[tuple[int, str], ...] = ()) -> str:
    """`rows` copies of the one-row VALUES, with `literals` (position, SQL) in place of their marks;
    a literal "?1" (the first column bound once) makes each row's first mark refer to parameter 1."""
    if literals:
        marks = values[1:-1].split(", ")
        for i, literal in literals:
            marks[i] = literal
        values = f"({', '.join(marks)})"
    return f"{head} VALUES {','.join([values] * rows)}"


def sqlite_multirow(dbapi_conn: Any, plan: SqliteInsert, params: list[Any], tail: str = "") -> tuple[int, int | None]:
    """Multi-row INSERTs of power-of-two sizes, and below _SQLITE_SMALL_ROWS of two at most (a
    few dozen cached statements), over flat parameters (`plan.sql`'s VALUES row after row):
    sqlite3's executemany steps the statement once per row, releasing and re-taking the GIL each
    time; one statement per chunk steps once. Each chunk's parameters are built column by column
    (`_chunk_params`): NaN in the plan's REAL columns written as text, and a column that is the
    same in every row of the chunk written into the statement instead of bound. `tail`: appended
    to each statement (ON CONFLICT ...; not RETURNING, whose rows would each cost a step). Returns
    the rows inserted and the last one's rowid (None when no statement ran). `params` is left as
    it was."""
    head, _, values = plan.sql.partition(" VALUES ")
    width = values.count("?")
    limit = dbapi_conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // max(1, width)
    most = min(_SQLITE_CHUNK_ROWS, 1 << (limit.bit_length() - 1))
    cur = dbapi_conn.cursor()
    inserted, last = 0, None
    i, n = 0, len(params) // width
    while i < n:
        left = n - i
        if left >= _SQLITE_SMALL_ROWS:
            k = min(most, 1 << (left.bit_length() - 1))
        else:  # a multiple of the row step, then the rest
            k = min(most, left if left < _SQLITE_ROW_STEP else left - left % _SQLITE_ROW_STEP)
        chunk, literals = _chunk_params(params, width, i, k, plan)
        cur.execute(_sqlite_values_sql(head, values, k, literals) + tail, chunk)
        inserted += cur.rowcount
        last = cur.lastrowid
        i += k
    return inserted, last


def _chunk_params(
    params: list[Any], width: int, first: int, rows: int, plan: SqliteInsert
) -> tuple[list[Any], tuple[tuple[int, str], ...]]:
    """One statement's parameters, rows `first` to `first + rows` of the flat `params`, and the
    columns written into its statement instead, as (position, SQL): a nullable column None in
    every row (NULL), a BOOLEAN column the same in every row (0 or 1), and a first column holding
    the same string in every row (a run key), bound once as parameter 1 ("?1": each row's first
    mark refers to it, and "?" after it numbers on from 2). NaN in the bound REAL columns becomes
    'NaN' (SQLite would store NULL, see types.Real).

    sqlite3 binds a None or a bool through its adapter registry (0.1-0.2 us a value even when the
    lookup hits, below) and copies every string it binds: an ordinary step's tensor row has four
    None, a bool and its run key. On a 4,096-row chunk of such rows, the bool as a literal took 0.20
    us a row off the INSERT (1.18 -> 0.98 us) and the run key bound once 0.09 more
    (benchmarks/sqlite_bind_cost.py; docs/performance.md, session 61); the NULLs took 5.5 -> 3.9 ms
    a chunk (session 18).

    Column by column: each read once with a strided slice, checked with C-level calls, and the
    bound ones written into a new list with strided assignments. A column's first value decides
    which check runs: `count(None)` compares every value of a float column with None at 14 ns each
    (0.6 for a column of None), and a float sum finds NaN at 4 ns a value against 9 for the sum of
    the values filtered of None. Before session 62 the chunk was sliced out of the group's list,
    every nullable column counted and every REAL column summed filtered, and each literal column
    deleted from the chunk in place: 0.18 us a row of an ordinary step's tensor rows, now 0.09
    (docs/performance.md, session 62)."""
    start, stop = first * width, (first + rows) * width
    literals: list[tuple[int, str]] = []
    bound: list[list[Any]] = []
    shared: list[Any] = []  # the run key bound once, ahead of the rows
    changed = False  # a column written as a literal or its NaN as text: the chunk is not a plain slice
    for k in range(width):
        column = params[start + k : stop : width]
        head = column[0]
        if head is None and k in plan.nullable and column.count(None) == rows:
            literals.append((k, "NULL"))
        elif (head is True or head is False) and k in plan.boolean and column.count(head) == rows:
            literals.append((k, "1" if head else "0"))  # count's == as sqlite3 binds: True and 1 alike
        elif k == 0 and type(head) is str and column.count(head) == rows:
            shared.append(head)
            literals.append((0, "?1"))
        else:
            if k in plan.real and _holds_nan(column):
                column = [NAN_TEXT if v != v else v for v in column]
                changed = True
            bound.append(column)
            continue
        changed = True
    if not changed:
        return params[start:stop], ()
    kept = len(bound)
    chunk = shared + [None] * (rows * kept)
    offset = len(shared)
    for j, column in enumerate(bound):
        chunk[offset + j :: kept] = column
    return chunk, tuple(literals)


def _holds_nan(column: list[Any]) -> bool:
    """Whether a REAL column's values hold a NaN, C-level: their float sum is NaN when one is (an
    inf + -inf false alarm only costs the exact pass); with a None among them (TypeError), the sum
    of the others."""
    try:
        total = sum(column)
    except TypeError:
        total = sum(filter(None, column))
    return bool(total != total)


# sqlite3 binds an int, float or str directly, and sends every other value (None, bool) through its
# adapter registry, where a miss raises and clears an AttributeError: 0.2-0.4 us per value. A tensor
# row has five (its optional statistics, `shadow`): most of the cost of binding a group. With these
# adapters registered the lookup hits: None stays None (`{}.get`, a C callable, returns None) and a
# bool becomes the int sqlite3 binds for it anyway. Process-wide; no value binds differently.
sqlite3.register_adapter(type(None), cast(Callable[[None], None], {}.get))
sqlite3.register_adapter(bool, int)


_STATE = table_of(ReductionState)

# Records for steps already reduced, or claimed by a reduction in flight (a spool replayed after an
# outage, a rank's late batch), re-dirty them: the claim protocol's ingest half (store/summaries.py).
# One UPDATE, its condition evaluated on the row as locked, so a claim committed while this
# transaction waited is seen; a step not claimed touches nothing. Parameters: key, low.
_LATE_DATA = (
    update(_STATE)
    .where(_STATE.c.run_id == bindparam("key"), _STATE.c.claimed_upto >= bindparam("low"))
    .values(
        dirty_from=case(
            (or_(_STATE.c.dirty_from.is_(None), _STATE.c.dirty_from > bindparam("low")), bindparam("low")),
            else_=_STATE.c.dirty_from,
        ),
        dirty_marks=_STATE.c.dirty_marks + 1,
    )
)
# A batch's run: seen now (parameters: key, now), or seen and finished (rank 0's stop event).
_RUNS = table_of(Run)
# Never back in time: replicas' clocks differ, and a slower one's batch may be stored last.
_SEEN = update(_RUNS).where(_RUNS.c.run_id == bindparam("key")).values(
    last_seen_at=case((_RUNS.c.last_seen_at > bindparam("now"), _RUNS.c.last_seen_at), else_=bindparam("now"))
)
_FINISHED = _SEEN.values(status="finished")
# ... and it brought step records: the stall age (runs.last_step_at) starts again.
_LATER_STEP = case((_RUNS.c.last_step_at > bindparam("now"), _RUNS.c.last_step_at), else_=bindparam("now"))
_STEPPED = _SEEN.values(last_step_at=_LATER_STEP)
_STEPPED_AND_FINISHED = _FINISHED.values(last_step_at=_LATER_STEP)


def _writer(session: Session) -> AbstractContextManager[object]:
    """SQLite's one writer at a time (store/db.py SQLITE_WRITE_TURN); PostgreSQL's writers overlap."""
    return SQLITE_WRITE_TURN if session.get_bind().dialect.name == "sqlite" else nullcontext()


# last_seen_at only feeds the idle horizon of live runs (an hour by default), so rewriting the one
# `runs` row of a 16,384-rank run from every batch buys nothing and, on PostgreSQL, makes
# concurrent batch transactions queue on that row's lock. Once a second is plenty.
_LAST_SEEN_RESOLUTION_S = 1.0

BatchOutcome = BatchAck | UnknownRunError | WrongProjectError | UnstorableBatchError | RefusedIncarnationError


class _RunRow(NamedTuple):
    run_id: str
    project: str
    last_seen_at: float
    status: str
    last_step_at: float | None


_RUNS_AND_FENCES = (
    f"SELECT r.run_id, r.project, r.last_seen_at, r.status, r.last_step_at, f.incarnation, f.reason "
    f"FROM {Run.__tablename__} r "
    f"LEFT JOIN {RefusedIncarnation.__tablename__} f ON f.run_id = r.run_id AND f.incarnation {{incarnations}} "
    "WHERE r.run_id {runs}"
)
# PostgreSQL: arrays, so one constant statement whatever the group holds (prepared once).
_PG_RUNS_AND_FENCES = _RUNS_AND_FENCES.format(incarnations="= ANY(%s::bigint[])", runs="= ANY(%s::varchar[])")


@functools.lru_cache(maxsize=64)
def _sqlite_runs_and_fences(runs: int, incarnations: int) -> str:
    return _RUNS_AND_FENCES.format(
        incarnations=f"IN ({', '.join('?' * incarnations)})", runs=f"IN ({', '.join('?' * runs)})"
    )


def _runs_and_fences(
    session: Session, run_ids: set[str], incarnations: set[int]
) -> tuple[dict[str, _RunRow], dict[tuple[str, int], str]]:
    """The group's runs by key, and (run, incarnation) -> refusal for its processes whose
    registration was refused: one statement (a round trip less per group on PostgreSQL), the fence
    an outer join on a table that is empty unless run ids were reused.

    A plain DBAPI statement: through the ORM it cost the writer 0.8 ms of CPU per group, with the
    GIL held (a sixth of its thread's work on SQLite; docs/performance.md)."""
    conn = session.connection()
    dbapi = conn.connection.driver_connection
    cur = dbapi.cursor()  # type: ignore[union-attr]
    try:
        if conn.dialect.name == "postgresql":
            cur.execute(_PG_RUNS_AND_FENCES, [list(incarnations), list(run_ids)])
        else:
            cur.execute(_sqlite_runs_and_fences(len(run_ids), len(incarnations)), [*incarnations, *run_ids])
        rows = cur.fetchall()
    finally:
        cur.close()
    runs: dict[str, _RunRow] = {}
    fenced: dict[tuple[str, int], str] = {}
    for run_id, project, last_seen_at, status, last_step_at, incarnation, reason in rows:
        stepped = None if last_step_at is None else float(last_step_at)
        runs[run_id] = _RunRow(run_id, project, float(last_seen_at), status, stepped)
        if incarnation is not None:
            fenced[(run_id, incarnation)] = reason
    return runs, fenced


def store_batch(session: Session, batch: AnyBatch, *, now: float | None = None, project: str | None = None) -> BatchAck:
    """Store one batch atomically; a duplicate is acknowledged and stores nothing.

    project: the caller's project, whose run the batch names (None: auth off, the run with that
    id, store/run_keys.py).
    """
    outcome = store_batches(session, [(batch, project)], now=now)[0]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def _keyed(
    session: Session, items: Sequence[tuple[AnyBatch, str | None]], rows: Sequence[BatchRows | None] | None
) -> tuple[list[tuple[AnyBatch, str | None]], list[BatchRows | None], dict[int, str]]:
    """Each batch under its run's key (store/run_keys.py), with its rows (None where they must be
    built again, under the key), and why an item cannot be keyed (auth off, an id several projects
    hold) by index. The caller's project gives the key; with none (auth off), the run with that id."""
    given: list[BatchRows | None] = list(rows) if rows is not None else [None] * len(items)
    unscoped = {b.run for b, project in items if project is None}
    keys: dict[str, str] = {}
    refusals: dict[str, str] = {}
    if unscoped:
        bare = set(session.scalars(select(Run.run_id).where(Run.run_id.in_(unscoped))))  # the default project's
        for run in unscoped - bare:
            try:
                keys[run] = run_keys.key_by_id(session, run) or run
            except run_keys.AmbiguousRunError as exc:
                why = "with auth off a batch cannot name one: serve with auth (no --insecure-no-auth), or rename one"
                refusals[run] = f"{exc}; {why}"
    out: list[tuple[AnyBatch, str | None]] = []
    refused: dict[int, str] = {}
    for i, (batch, project) in enumerate(items):
        key = run_keys.key_for(project, batch.run) if project is not None else keys.get(batch.run, batch.run)
        if key != batch.run:
            batch, given[i] = run_keys.with_key(batch, key), None
        if batch.run in refusals:
            refused[i] = refusals[batch.run]
        out.append((batch, project))
    return out, given, refused


def store_batches(
    session: Session,
    items: Sequence[tuple[AnyBatch, str | None]],
    *,
    now: float | None = None,
    writer: str = "direct",
    rows: Sequence[BatchRows | None] | None = None,
    synchronous_commit: bool = True,
) -> list[BatchOutcome]:
    """Store several batches in one transaction (group commit); one outcome per item, in order.

    Each batch is still stored whole or not at all: the transaction commits every new batch of the
    group or, on a database error (raised), none. A batch whose key is already stored, or appears
    earlier in the same group, is a duplicate; an unknown run or another project's run is refused
    (returned, not raised) without affecting the others. One commit per group instead of one per
    batch is what lets a single writer keep up: the commit (WAL flush) is the fixed cost.

    writer: names the ingest_counts rows this transaction adds its outcomes to (one per writer
    thread, see IngestCount).

    rows: per item, its `batch_rows` when the caller built them already (None: built here). The
    group-commit writer has them built on the request's thread, so its own thread mostly writes.

    synchronous_commit: False commits without waiting for the WAL flush on PostgreSQL
    (`SET LOCAL synchronous_commit TO OFF`, sent in the tail's pipeline: no extra round trip).
    The group is then durable once the WAL writer flushes it, within about 0.6 s: a crash of the
    collector loses nothing, a crash of the database server or its host the last fraction of a
    second, as SQLite in WAL mode with synchronous=NORMAL (store/db.py). The collector's setting
    `ingest_synchronous_commit` chooses (docs/deployment.md). No effect on SQLite.
    """
    now = time.time() if now is None else now
    items, rows, refused = _keyed(session, items, rows)
    run_ids = {batch.run for batch, _ in items}
    runs, fenced = _runs_and_fences(session, run_ids, {batch.incarnation for batch, _ in items})
    outcomes: list[BatchOutcome | None] = [None] * len(items)
    candidates: dict[tuple[str, int, int, int], int] = {}  # idempotency key -> item index
    for i, (batch, project) in enumerate(items):
        run = runs.get(batch.run)
        if i in refused:
            outcomes[i] = UnknownRunError(refused[i])
        elif run is None:
            run_id = run_keys.run_id_of(batch.run)  # as the sender named it
            outcomes[i] = UnknownRunError(f"run {run_id!r} is not registered: POST /v1/runs first")
        elif project is not None and run.project != project:
            outcomes[i] = WrongProjectError(
                f"run {batch.run!r} belongs to another project than this token's ({project!r})"
            )
        elif (reason := fenced.get((batch.run, batch.incarnation))) is not None:
            outcomes[i] = RefusedIncarnationError(reason)
        else:
            key = (batch.run, batch.rank, batch.incarnation, batch.seq)
            if key in candidates:
                outcomes[i] = BatchAck(accepted=0, duplicate=True)  # a retry queued beside its original
            else:
                candidates[key] = i
    # Rows are built before the write transaction starts: on SQLite nothing else can write
    # while it is open, so it should hold only the inserts.
    given = rows or [None] * len(items)
    built = {i: given[i] or batch_rows(items[i][0]) for i in candidates.values()}
    with _writer(session):
        new_keys = _claim_keys(session, [items[i][0] for i in candidates.values()], now) if candidates else set()
        stored = [i for key, i in candidates.items() if key in new_keys]
        _write_records(session, [built[i] for i in stored])
        tail = _touch_runs(runs, [items[i][0] for i in stored], [built[i] for i in stored], now)
        for key, i in candidates.items():
            new = key in new_keys
            outcomes[i] = BatchAck(accepted=len(items[i][0].records) if new else 0, duplicate=not new)
        stored_set = set(stored)
        tail.append(
            _count(
                writer,
                [batch.run if batch.run in runs else run_keys.no_run_key(project) for batch, project in items],
                outcomes,
                [built[i] if i in stored_set else None for i in range(len(items))],
            )
        )
        _execute_and_commit(session, tail, synchronous_commit=synchronous_commit)
    return [o for o in outcomes if o is not None]


def count_unstorable(session: Session, batch: AnyBatch, *, writer: str, project: str | None = None) -> None:
    """Count a batch the database refused (its transaction rolled back) as rejected (under its
    run's key: project as for store_batches)."""
    batch = _keyed(session, [(batch, project)], None)[0][0][0]
    key = batch.run if session.get(Run, batch.run) is not None else run_keys.no_run_key(project)
    _execute_and_commit(session, [_count(writer, [key], [UnstorableBatchError()])])


_COUNTED = ("batches", "records", *(f"{kind}_records" for kind in RECORD_TABLES))
_COUNT_UPSERT = text(
    f"INSERT INTO {IngestCount.__tablename__} (run_id, outcome, writer, {', '.join(_COUNTED)}) "
    f"VALUES (:run_id, :outcome, :writer, {', '.join(':' + c for c in _COUNTED)}) "
    "ON CONFLICT (run_id, outcome, writer) DO UPDATE SET "
    + ", ".join(f"{c} = {IngestCount.__tablename__}.{c} + excluded.{c}" for c in _COUNTED)
)
_KIND_INDEX = {kind: 2 + i for i, kind in enumerate(RECORD_TABLES)}  # position in a _COUNTED vector


def retire_counts(session: Session, *, run_id: str) -> None:
    """Move a run's ingest counters to its project's no-run key (run_keys.no_run_key), for a run
    being deleted (not committed): left under its id they would add to a run registered again under
    it, and deleted they would make trainvitals_ingest_batches_total go down, which Prometheus reads
    as a counter reset; in the project's key they stay in that project's view of /metrics too."""
    run = session.get(Run, run_id)
    retired = run_keys.no_run_key(run.project if run is not None else None)
    t = IngestCount
    columns = [getattr(t, c) for c in _COUNTED]
    rows = session.execute(select(t.outcome, t.writer, *columns).where(t.run_id == run_id)).all()
    session.execute(delete(t).where(t.run_id == run_id))
    if rows:
        params = [
            {"run_id": retired, "outcome": outcome, "writer": writer, **dict(zip(_COUNTED, counts, strict=True))}
            for outcome, writer, *counts in rows
        ]
        session.execute(_COUNT_UPSERT, params)


def _count(
    writer: str,
    keys: list[str],
    outcomes: Sequence[BatchOutcome | None],
    stored_rows: Sequence[BatchRows | None] | None = None,
) -> Statement:
    """The statement adding this group's outcomes to the writer's counter rows (run in the same
    transaction: exact).

    keys: per item, its counter rows' key: its run's, or for a run not registered its project's
    no-run key (an unknown run's id is whatever the sender typed: not worth a row each).
    stored_rows: per item, the rows a stored batch wrote (None for the others): counted per kind."""
    totals: dict[tuple[str, str], list[int]] = {}
    for i, (run_id, outcome) in enumerate(zip(keys, outcomes, strict=True)):
        if isinstance(outcome, BatchAck):
            key = (run_id, "duplicate" if outcome.duplicate else "stored")
            records = outcome.accepted
        else:
            key = (run_id, "rejected")
            records = 0
        acc = totals.setdefault(key, [0] * len(_COUNTED))
        acc[0] += 1
        acc[1] += records
        rows = stored_rows[i] if stored_rows is not None else None
        if rows is not None:
            for kind, flat in rows[0].items():
                acc[_KIND_INDEX[kind]] += len(flat) // _WIDTH[kind]
            for kind, dict_rows in rows[1].items():
                acc[_KIND_INDEX[kind]] += len(dict_rows)
    return _COUNT_UPSERT, [
        {"run_id": run_id, "outcome": outcome, "writer": writer, **dict(zip(_COUNTED, acc, strict=True))}
        for (run_id, outcome), acc in sorted(totals.items())
    ]


_BATCH_COLUMNS = "run_id, rank, incarnation, seq, received_at, records"
# One statement whatever the group size (constant SQL: prepared once, no per-group compile).
_PG_CLAIM = (
    f"INSERT INTO {DeliveredBatch.__tablename__} ({_BATCH_COLUMNS}) "
    "SELECT * FROM unnest(%s::varchar[], %s::int[], %s::bigint[], %s::bigint[], %s::float8[], %s::int[]) "
    "ON CONFLICT DO NOTHING RETURNING run_id, rank, incarnation, seq"
)
# No NaN to write as text, no column to write as a literal but the run key.
_SQLITE_CLAIM = SqliteInsert(
    f"INSERT INTO {DeliveredBatch.__tablename__} ({_BATCH_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)", (), (), ()
)
_SQLITE_CLAIM_TAIL = " ON CONFLICT DO NOTHING"
# The rows a claim inserted, when it skipped some (parameter: the rowid below the first of them).
_SQLITE_CLAIMED = f"SELECT run_id, rank, incarnation, seq FROM {DeliveredBatch.__tablename__} WHERE rowid > ?"


def _claim_keys(session: Session, batches: list[AnyBatch], now: float) -> set[tuple[str, int, int, int]]:
    """Insert the idempotency rows; returns the keys that were new (the others are duplicates).

    ON CONFLICT DO NOTHING decides inside the database, so two collectors sharing PostgreSQL that
    receive the same retried batch cannot both store it.
    """
    rows = [(b.run, b.rank, b.incarnation, b.seq, now, len(b.records)) for b in batches]
    conn = session.connection()
    if conn.dialect.name == "postgresql":
        raw = conn.connection.driver_connection
        with raw.cursor() as cur:  # type: ignore[union-attr]
            cur.execute(_PG_CLAIM, [list(col) for col in zip(*rows, strict=True)])
            return {tuple(r) for r in cur.fetchall()}
    # SQLite: one multi-row INSERT, no RETURNING. sqlite3 steps a statement once per row it returns,
    # and every step releases the GIL and waits to take it back from the event loop: in a closed
    # loop's group of 11 batches, 12 waits where this takes one. Its count of inserted rows says
    # whether all were new, the usual case. When not (retries), the new rows are the last `inserted`
    # rowids: this transaction holds SQLite's one write lock, and each inserted row takes the
    # table's largest rowid + 1 (a skipped row takes none), so they are consecutive and the largest.
    dbapi = conn.connection.driver_connection
    inserted, last = sqlite_multirow(dbapi, _SQLITE_CLAIM, list(chain.from_iterable(rows)), tail=_SQLITE_CLAIM_TAIL)
    if inserted == len(rows):
        return {row[:4] for row in rows}
    if not inserted or last is None:
        return set()
    cur = dbapi.cursor()  # type: ignore[union-attr]
    try:
        return {tuple(r) for r in cur.execute(_SQLITE_CLAIMED, [last - inserted]).fetchall()}
    finally:
        cur.close()


def _write_records(session: Session, built: list[BatchRows]) -> None:
    """Every record of the stored batches: one COPY / executemany per kind for the whole group."""
    fast: dict[str, list[Any]] = {}
    other: dict[str, list[dict[str, Any]]] = {}
    for fast_rows, other_rows, _ in built:
        for kind, flat in fast_rows.items():
            fast.setdefault(kind, []).extend(flat)
        for kind, dict_rows in other_rows.items():
            other.setdefault(kind, []).extend(dict_rows)
    for kind, flat in fast.items():
        _write_fast(session, kind, flat)
    for kind, dict_rows in other.items():
        session.execute(insert(RECORD_TABLES[kind]), dict_rows)


def _touch_runs(
    runs: dict[str, _RunRow], batches: list[AnyBatch], rows: list[BatchRows], now: float
) -> list[Statement]:
    """The statements for late data (re-dirties reduced steps), last_seen_at and last_step_at (each
    at most once a second) and the end of a run."""
    out: list[Statement] = []
    low_by_run: dict[str, int] = {}
    stepped: set[str] = set()
    for batch, (fast, _, low) in zip(batches, rows, strict=True):
        if low is not None:
            low_by_run[batch.run] = min(low, low_by_run.get(batch.run, low))
        if "step" in fast:
            stepped.add(batch.run)
    # Run-id order for every shared row: concurrent groups then lock them in the same order.
    for run_id, low in sorted(low_by_run.items()):
        out.append((_LATE_DATA, [{"key": run_id, "low": low}]))
    finished = {
        b.run
        for b in batches
        if b.rank == 0 and any(r.kind == "event" and getattr(r, "event", None) == "stop" for r in b.records)
    }
    for run_id in sorted({b.run for b in batches}):
        run = runs[run_id]
        step_due = run_id in stepped and (
            run.last_step_at is None or now - run.last_step_at >= _LAST_SEEN_RESOLUTION_S
        )
        if run_id in finished:  # rank 0 closing its agent ends the run
            out.append((_STEPPED_AND_FINISHED if step_due else _FINISHED, [{"key": run_id, "now": now}]))
        elif step_due:
            out.append((_STEPPED, [{"key": run_id, "now": now}]))
        elif now - run.last_seen_at >= _LAST_SEEN_RESOLUTION_S or run.status != "running":
            out.append((_SEEN, [{"key": run_id, "now": now}]))
    return out


# PostgreSQL: this transaction's commit returns before its WAL is flushed (store_batches).
PG_ASYNC_COMMIT = "SET LOCAL synchronous_commit TO OFF"

# A statement of the group's tail and its parameter sets (constant statements: each is compiled
# once per dialect, `_compiled`, and run on the driver's cursor).
Statement: TypeAlias = "tuple[Executable, list[dict[str, Any]]]"


def _execute_and_commit(session: Session, statements: list[Statement], *, synchronous_commit: bool = True) -> None:
    """The group's last statements, then its commit, on the driver's cursor: the parameters are
    plain ints, floats and strings, so SQLAlchemy's per-execution work (about 50 us a statement,
    GIL held, on the writer's thread) buys nothing. On PostgreSQL the statements go in one
    pipeline: sent together, answered together, one round trip instead of one per statement (each
    round trip also costs the writer thread a wait for the GIL to read its answer: under load, most
    of a group's time)."""
    conn = session.connection()
    raw = conn.connection.driver_connection
    if conn.dialect.name != "postgresql":
        cur = raw.cursor()  # type: ignore[union-attr]
        try:
            for statement, params in statements:
                compiled = _compiled(statement, conn.dialect)
                names = compiled.positiontup or ()  # qmark: the bind names in placeholder order
                cur.executemany(str(compiled), [[c[n] for n in names] for c in map(compiled.construct_params, params)])
        finally:
            cur.close()
    else:
        with raw.pipeline(), raw.cursor() as cur:  # type: ignore[union-attr]
            if not synchronous_commit:  # for this transaction's commit only (store_batches)
                cur.execute(PG_ASYNC_COMMIT)
            for statement, params in statements:
                compiled = _compiled(statement, conn.dialect)
                cur.executemany(str(compiled), [compiled.construct_params(p) for p in params])
    session.commit()


@functools.lru_cache(maxsize=64)  # a handful of statements per engine's dialect
def _compiled(statement: Executable, dialect: Dialect) -> SQLCompiler:
    return cast(SQLCompiler, statement.compile(dialect=dialect))  # type: ignore[attr-defined]
