"""The detectors' input as stored: the summary tables and the per-rank timing of raw steps, read
as numpy columns (service/analysis/detector_inputs.py keeps them between analysis cycles).

Reads of long step ranges (the first read of a run: 600 steps x 16,384 ranks of timing, 20,000
steps x 384 tensors: 17 million rows) are what bounds the first analysis cycle after a collector
start or a lease takeover. On PostgreSQL they are read as one array per step (timing) or per
tensor and group, in binary straight into numpy (`_array_rows`): a few thousand rows instead of
millions of Python row tuples, seconds instead of two minutes. On SQLite they stream in chunks of
rows. A cycle's few new steps are read whole, row by row, on both.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
from sqlalchemy import BigInteger, ColumnElement, Float, Select, cast, func, literal_column, select
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import InstrumentedAttribute, Session

from trainvitals.service.store.incarnations import newest_incarnation_only
from trainvitals.service.store.models import (
    EventRow,
    GradSummary,
    Run,
    StepRow,
    StepSummary,
    TensorSummary,
)
from trainvitals.wire.conventions import GLOBAL_GROUP

I64, F64 = np.int64, np.float64
AnySelect: TypeAlias = Select[*tuple[Any, ...]]

STEP_DTYPES = (I64, F64, F64, I64, F64, F64, F64, F64, I64, F64, I64)
"""step_columns: step, loss, grad_norm, grad_nonfinite, step_seconds_max, ts, tokens, flops,
loss_nonfinite, mfu, skipped_ranks."""
GROUP_DTYPES = (I64, object, F64)
"""group_norm_columns: step, group name, norm."""
TENSOR_DTYPES = (I64, F64, F64, F64, F64, F64, F64, F64)
"""TensorRows.columns: step, amax, headroom_bits, lag_bits, sat_frac, underflow_frac, nonfinite,
crest_bits (last: detector blocks stored before it had seven columns, detector_inputs.py)."""
RANK_DTYPES = (I64, I64, F64, F64, F64, F64)
"""rank_timing_columns: step, rank, step_seconds, compute_seconds, wait_seconds, pp_stage (NaN:
unknown)."""


def _column(values: Sequence[Any], dtype: Any) -> np.ndarray:
    if dtype is F64:
        return np.array([np.nan if v is None else v for v in values], dtype=F64)
    if dtype is object:
        return np.array(values, dtype=object)
    return np.array([0 if v is None else v for v in values], dtype=dtype)


_CHUNK_ROWS = 50_000  # rows fetched and converted at a time by a streamed read
_STREAM_STEPS = 64  # reads of more steps than this stream; a cycle's few new steps do not


def _partitions(session: Session, stmt: AnySelect, steps: int) -> Any:
    """The rows in lists of at most _CHUNK_ROWS. Core execution on the session's connection: the
    ORM's row loading cost more than the fetch. Only long step ranges stream: PostgreSQL plans a
    cursor for its first rows, which for a cycle's few new steps meant walking a whole primary key."""
    conn = session.connection()
    if steps <= _STREAM_STEPS:
        rows = conn.execute(stmt).all()
        return [rows] if rows else []
    return conn.execute(stmt.execution_options(yield_per=_CHUNK_ROWS)).partitions()


def _read_columns(session: Session, stmt: AnySelect, dtypes: Sequence[Any], steps: int) -> list[np.ndarray]:
    """A query's rows as numpy columns, fetched and converted 50,000 rows at a time (a server-side
    cursor on PostgreSQL). The first read of a 16,384-rank run is tens of millions of rows: held
    as Python rows all at once they took ~8 GB."""
    parts: list[list[np.ndarray]] = [[] for _ in dtypes]
    for rows in _partitions(session, stmt, steps):
        for part, values, dtype in zip(parts, zip(*rows, strict=True), dtypes, strict=True):
            part.append(_column(values, dtype))
    return [np.concatenate(p) if p else np.empty(0, dtype=d) for p, d in zip(parts, dtypes, strict=True)]


def _long_pg_read(session: Session, steps: int) -> bool:
    """Is this a long read (the first of a run) on PostgreSQL, which `_array_rows` serves?"""
    return steps > _STREAM_STEPS and session.connection().dialect.name == "postgresql"


_ARRAY_HEAD = struct.Struct(">iiIii")  # ndim, has nulls, element type, length, lower bound
_F8_ARRAY_OID, _I8_ARRAY_OID = 1022, 1016  # float8[], int8[]


def _numpy_array(data: Any, element: str, dtype: Any) -> np.ndarray:
    """A one-dimensional PostgreSQL array without NULLs (the statements coalesce them), binary
    format: a header, then a 4-byte length and the 8-byte value per element."""
    if len(data) < _ARRAY_HEAD.size:  # an empty array has no dimension
        return np.empty(0, dtype=dtype)
    ndim, has_nulls, _, n, _ = _ARRAY_HEAD.unpack_from(data)
    if ndim != 1 or has_nulls:
        raise ValueError("expected a one-dimensional array without NULLs")
    cells = np.frombuffer(data, dtype=np.dtype([("len", ">i4"), ("value", element)]), count=n, offset=_ARRAY_HEAD.size)
    return cells["value"].astype(dtype)


def _array_rows(session: Session, stmt: AnySelect, *, rows_per_fetch: int) -> Iterator[tuple[Any, ...]]:
    """The statement's rows with float8[] and int8[] columns loaded as numpy arrays, through a
    server-side cursor `rows_per_fetch` rows at a time (a timing row of 16,384 ranks is ~1.2 MB on
    the wire: the whole result at once would double the read's peak memory)."""
    from psycopg.adapt import Loader
    from psycopg.pq import Format

    class F8Array(Loader):
        format = Format.BINARY

        def load(self, data: Any) -> np.ndarray:
            return _numpy_array(data, ">f8", F64)

    class I8Array(Loader):
        format = Format.BINARY

        def load(self, data: Any) -> np.ndarray:
            return _numpy_array(data, ">i8", I64)

    conn = session.connection()
    compiled = stmt.compile(dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
    # The session's own connection and transaction: the cycle's reduction wrote what is read here.
    driver = conn.connection.driver_connection
    assert driver is not None  # a checked-out connection
    with driver.cursor(name="trainvitals_detector_read", binary=True) as cur:
        cur.adapters.register_loader(_F8_ARRAY_OID, F8Array)
        cur.adapters.register_loader(_I8_ARRAY_OID, I8Array)
        cur.itersize = rows_per_fetch
        cur.execute(str(compiled), compiled.params)
        yield from cur


def _f8s(column: InstrumentedAttribute[Any] | ColumnElement[Any]) -> ColumnElement[Any]:
    """array_agg of a column as float8, NULL as NaN (as `_column` reads it)."""
    return func.array_agg(func.coalesce(cast(column, Float(53)), literal_column("'NaN'::float8")))


def _i8s(column: InstrumentedAttribute[Any] | ColumnElement[Any]) -> ColumnElement[Any]:
    """array_agg of a column as int8, NULL as 0 (as `_column` reads it)."""
    return func.array_agg(func.coalesce(cast(column, BigInteger), 0))


def _by_step(columns: list[np.ndarray]) -> list[np.ndarray]:
    """Columns reordered ascending by their first (array_agg keeps no order unless told, and an
    ORDER BY per aggregate costs a sort per column)."""
    if len(columns[0]) and not bool(np.all(columns[0][1:] >= columns[0][:-1])):
        order = np.argsort(columns[0], kind="stable")
        return [c[order] for c in columns]
    return columns


def run_in_project(session: Session, *, run_id: str, project: str) -> bool:
    """Is `run_id` a run of `project`? (A baseline must be: a run never reads another project's.)"""
    return session.scalar(select(Run.run_id).where(Run.run_id == run_id, Run.project == project)) is not None


def newest_summary(session: Session, *, run_id: str) -> tuple[int, float | None] | None:
    """(step, peak_flops_total) of the run's newest step summary; None before its first reduction."""
    s = StepSummary
    row = session.execute(
        select(s.step, s.peak_flops_total).where(s.run_id == run_id).order_by(s.step.desc()).limit(1)
    ).first()
    return None if row is None else (int(row[0]), row[1])


def step_columns(session: Session, *, run_id: str, after: int, upto: int) -> list[np.ndarray]:
    """Step summaries of steps after < step <= upto, ascending (columns: STEP_DTYPES)."""
    s = StepSummary
    stmt = (
        select(
            s.step, s.loss, s.grad_norm, s.grad_nonfinite, s.step_seconds_max, s.ts, s.tokens, s.flops,
            s.loss_nonfinite, s.mfu, s.skipped_ranks,
        )
        .where(s.run_id == run_id, s.step > after, s.step <= upto)
        .order_by(s.step)
    )
    return _read_columns(session, stmt, STEP_DTYPES, upto - after)


def group_norm_columns(session: Session, *, run_id: str, after: int, upto: int) -> list[np.ndarray]:
    """Per parameter group norms (not the global one) of steps after < step <= upto, ascending by
    step (columns: GROUP_DTYPES)."""
    g = GradSummary
    where = (g.run_id == run_id, g.step > after, g.step <= upto, g.group_name != GLOBAL_GROUP)
    if _long_pg_read(session, upto - after):  # one row per group: name, its steps, its norms
        stmt_a = select(g.group_name, _i8s(g.step), _f8s(g.norm)).where(*where).group_by(g.group_name)
        groups = list(_array_rows(session, stmt_a, rows_per_fetch=64))
        if not groups:
            return [np.empty(0, dtype=d) for d in GROUP_DTYPES]
        names = np.array([name for name, *_ in groups], dtype=object)
        counts = [len(steps) for _, steps, _ in groups]
        steps, norms = (np.concatenate([row[i] for row in groups]) for i in (1, 2))
        return _by_step([steps, np.repeat(names, counts), norms])
    stmt = select(g.step, g.group_name, g.norm).where(*where).order_by(g.step)
    return _read_columns(session, stmt, GROUP_DTYPES, upto - after)


@dataclass(frozen=True, slots=True)
class TensorRows:
    """Consecutive rows of one tensor, ascending by step; a tensor's rows may come in several."""

    key: tuple[str, str]
    """(tensor, role)."""
    format: str
    """The format of its first row here."""
    shadow: bool
    columns: list[np.ndarray]
    """TENSOR_DTYPES."""


def tensor_rows(session: Session, *, run_id: str, after: int, upto: int) -> Iterator[TensorRows]:
    """Tensor summaries of steps after < step <= upto, by (tensor, role), then step."""
    t = TensorSummary
    where = (t.run_id == run_id, t.step > after, t.step <= upto)
    values = (t.amax, t.headroom_bits, t.lag_bits, t.sat_frac, t.underflow_frac, t.nonfinite, t.crest_bits)
    if _long_pg_read(session, upto - after):
        yield from _tensor_arrays(session, run_id=run_id, after=after, upto=upto)
        return
    stmt = select(t.tensor, t.role, t.format, t.shadow, t.step, *values).where(*where)
    stmt = stmt.order_by(t.tensor, t.role, t.step)
    for rows in _partitions(session, stmt, upto - after):
        cols = list(zip(*rows, strict=True))
        keys = list(zip(cols[0], cols[1], strict=True))
        columns = [_column(v, d) for v, d in zip(cols[4:], TENSOR_DTYPES, strict=True)]
        starts = [0] + [i for i in range(1, len(keys)) if keys[i] != keys[i - 1]]
        for lo, hi in zip(starts, [*starts[1:], len(keys)], strict=True):
            yield TensorRows(key=keys[lo], format=cols[2][lo], shadow=bool(cols[3][lo]),
                             columns=[c[lo:hi] for c in columns])  # fmt: skip


def _tensor_arrays(session: Session, *, run_id: str, after: int, upto: int) -> Iterator[TensorRows]:
    """PostgreSQL: one row per tensor with its columns as arrays; then each tensor's format and
    shadow flag from its first row in the range (one primary-key probe per tensor)."""
    t = TensorSummary
    stmt = (
        select(
            t.tensor, t.role, _i8s(t.step), _f8s(t.amax), _f8s(t.headroom_bits), _f8s(t.lag_bits), _f8s(t.sat_frac),
            _f8s(t.underflow_frac), _f8s(t.nonfinite), _f8s(t.crest_bits),
        )
        .where(t.run_id == run_id, t.step > after, t.step <= upto)
        .group_by(t.tensor, t.role)
        .order_by(t.tensor, t.role)
    )
    arrays = {(tensor, role): _by_step(cols) for tensor, role, *cols in _array_rows(session, stmt, rows_per_fetch=16)}
    for key, fmt, shadow in _first_formats(session, run_id=run_id, after=after, upto=upto, keys=list(arrays)):
        yield TensorRows(key=key, format=fmt, shadow=bool(shadow), columns=arrays[key])


def _first_formats(
    session: Session, *, run_id: str, after: int, upto: int, keys: list[tuple[str, str]]
) -> Iterator[tuple[tuple[str, str], str, bool]]:
    """(key, format, shadow) of each key's first row in after < step <= upto, in the keys' order."""
    if not keys:
        return
    t = TensorSummary
    k = func.unnest(
        cast([tensor for tensor, _ in keys], postgresql.ARRAY(t.tensor.type)),
        cast([role for _, role in keys], postgresql.ARRAY(t.role.type)),
    ).table_valued("tensor", "role", with_ordinality="i").render_derived()
    first = (
        select(t.format, t.shadow)
        .where(t.run_id == run_id, t.tensor == k.c.tensor, t.role == k.c.role, t.step > after, t.step <= upto)
        .order_by(t.step)
        .limit(1)
        .lateral()
    )
    stmt = select(k.c.tensor, k.c.role, first.c.format, first.c.shadow).select_from(k)
    stmt = stmt.join(first, literal_column("true")).order_by(k.c.i)
    for tensor, role, fmt, shadow in session.connection().execute(stmt):
        yield (tensor, role), fmt, shadow


def rank_timing_columns(session: Session, *, run_id: str, after: int, upto: int) -> list[np.ndarray]:
    """Per (step, rank) timing of raw steps after < step <= upto: one row per cell, the newest
    incarnation's (columns: RANK_DTYPES). Ascending by step (ranks within a step in any order), so
    a rank's pipeline stage is the one of its newest step wherever it changed."""
    s = StepRow
    where = (
        s.run_id == run_id,
        s.step > after,
        s.step <= upto,
        newest_incarnation_only(s, run_id=run_id, first=after + 1, last=upto),
    )
    if _long_pg_read(session, upto - after):  # one row per step: its ranks and their timing as arrays
        stmt_a = (
            select(s.step, _i8s(s.rank), _f8s(s.step_seconds), _f8s(s.compute_seconds), _f8s(s.wait_seconds),
                   _f8s(s.pp_stage))  # fmt: skip
            .where(*where)
            .group_by(s.step)
            .order_by(s.step)
        )
        rows = list(_array_rows(session, stmt_a, rows_per_fetch=32))
        if not rows:
            return [np.empty(0, dtype=d) for d in RANK_DTYPES]
        step = np.repeat(np.array([r[0] for r in rows], dtype=I64), [len(r[1]) for r in rows])
        return [step, *(np.concatenate([r[i] for r in rows]) for i in range(1, len(RANK_DTYPES)))]
    stmt = select(s.step, s.rank, s.step_seconds, s.compute_seconds, s.wait_seconds, s.pp_stage).where(*where)
    return _read_columns(session, stmt.order_by(s.step, s.rank), RANK_DTYPES, upto - after)


def events(session: Session, *, run_id: str) -> Sequence[EventRow]:
    """Every run event, by time."""
    return session.scalars(select(EventRow).where(EventRow.run_id == run_id).order_by(EventRow.ts)).all()
