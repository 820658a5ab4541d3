"""The reduction's storage: how far each run is reduced, the raw rows a cycle reduces, and the
summaries it writes.

A cycle (service/analysis/pipeline.py) reads the raw rows of the steps it reduces, the cross-rank
reductions are done in memory (service/analysis/reduction.py) except the FP8 tensor summary, which
is a GROUP BY here (hundreds of tensors x every rank: the rows never leave the database). The
summaries of those steps are then replaced in one transaction with the reduction state that says
how far they go. Every read of raw rows goes through the newest-incarnation rule
(store/incarnations.py): in SQL here, or in memory for the step rows.

Claims: ingest and the reduction run concurrently, and a row for a step being reduced must not be
missed (read too late by the reduction, and seen by ingest as not yet reduced). So:

1. The reduction claims its steps before reading any row (`claim_steps`, its own transaction):
   it raises `claimed_upto` and notes `dirty_marks`. On PostgreSQL it first locks the run's `runs`
   row FOR UPDATE, which waits for every ingest transaction storing a batch of the run (each holds
   a key-share lock on that row through the `batches` foreign key from its first insert to its
   commit) and holds back new ones until the claim commits; on SQLite the claim is a write, and
   SQLite has one writer at a time.
2. An ingest transaction that stores a row for a step at or below `claimed_upto` re-dirties it
   (`store/batches.py`: `dirty_from` lowered, `dirty_marks` bumped, one UPDATE whose condition is
   evaluated on the row as locked). Every transaction that committed before the claim is in the
   reduction's reads; every one after it sees the claim.
3. The reduction writes its summaries and `reduced_upto`, and clears `dirty_from` only if
   `dirty_marks` has not moved since its claim (`replace_summaries`); otherwise the next cycle
   reduces again from `dirty_from`. A reduction that fails after its claim clears nothing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Boolean,
    Connection,
    Float,
    Integer,
    String,
    Table,
    case,
    delete,
    func,
    insert,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.orm import Session

from trainvitals.service.store.batches import (
    PG_ASYNC_COMMIT,
    PgCopy,
    SqliteInsert,
    pg_copy,
    pg_copy_rows,
    sqlite_insert,
    sqlite_multirow,
)
from trainvitals.service.store.incarnations import newest_incarnation_only
from trainvitals.service.store.models import (
    GradStatRow,
    GradSummary,
    RankWindow,
    ReductionState,
    Run,
    StepRow,
    StepSummary,
    TensorStatRow,
    TensorSummary,
    table_of,
)
from trainvitals.service.store.types import Real
from trainvitals.wire.v1 import INT64_MAX


def saturated_count(total: float) -> int:
    """A count summed over ranks, as its 64-bit column holds it: each rank's count is in range (the
    wire checks it), their sum need not be, and one run's numbers must not stop its reduction."""
    return min(int(total), INT64_MAX)


def reduction_state(session: Session, *, run_id: str) -> ReductionState:
    """The run's reduction state, created (flushed, not committed) on its first cycle."""
    state = session.get(ReductionState, run_id)
    if state is None:
        state = ReductionState(run_id=run_id, reduced_upto=-1, dirty_from=None, claimed_upto=-1, dirty_marks=0)
        session.add(state)
        session.flush()
    return state


@dataclass(frozen=True, slots=True)
class Progress:
    """A run's reduction state as read (the ORM object may be stale: claims write with Core)."""

    reduced_upto: int
    dirty_from: int | None
    """Lowest re-dirtied step (None: nothing below reduced_upto changed)."""
    dirty_marks: int

    @property
    def start(self) -> int:
        """The first step the next reduction (re)reduces."""
        start = self.reduced_upto + 1
        return start if self.dirty_from is None else min(start, self.dirty_from)


_STATE = table_of(ReductionState)


def progress(session: Session, *, run_id: str) -> Progress:
    """The run's reduction state (its row created, flushed, on the first call)."""
    reduction_state(session, run_id=run_id)
    t = _STATE
    row = session.execute(select(t.c.reduced_upto, t.c.dirty_from, t.c.dirty_marks).where(t.c.run_id == run_id)).one()
    return Progress(row.reduced_upto, row.dirty_from, row.dirty_marks)


def claim_steps(session: Session, *, run_id: str, upto: int) -> Progress:
    """Claim the run's steps up to `upto` for a reduction (committed; see the module docstring);
    returns the state as claimed: reduce from its `start` to `upto`, then `replace_summaries`."""
    session.commit()  # the claim is a transaction of its own, started now
    bind = session.get_bind()
    if bind.dialect.name == "postgresql":
        # Only the order of the claim matters, not its durability: the reduction's final commit
        # flushes the WAL after it anyway.
        session.execute(text(PG_ASYNC_COMMIT))
        # Waits for the ingest transactions of this run in flight (key-share locks, module docstring).
        session.execute(select(Run.run_id).where(Run.run_id == run_id).with_for_update())
    reduction_state(session, run_id=run_id)
    t = _STATE
    session.execute(
        update(t)
        .where(t.c.run_id == run_id)
        .values(claimed_upto=case((t.c.claimed_upto < upto, upto), else_=t.c.claimed_upto))
    )
    claimed = progress(session, run_id=run_id)
    session.commit()
    return claimed


def first_unreduced_step(session: Session, *, run_id: str) -> int:
    """The first step the analysis has not reduced (0 before the run's first cycle)."""
    state = session.get(ReductionState, run_id)
    return 0 if state is None else state.reduced_upto + 1


def reducible_upto(session: Session, *, run: Run, start: int, now: float, settle_seconds: float) -> int:
    """Newest step up to which every rank has reported (low watermark), or older than the settle
    time. Reads only steps >= start: the cost of a cycle follows the new rows, not the run's length."""
    rid = run.run_id
    if run.status == "finished":
        newest = session.scalar(select(func.max(StepRow.step)).where(StepRow.run_id == rid))
        return start - 1 if newest is None else int(newest)
    # Both reads are answered from ix_steps_run_step_rank_ts alone (store/models.py StepRow): a
    # column added to them needs it in that index, or each unreduced row costs a lookup.
    watermark = start - 1
    for step, ranks in session.execute(
        select(StepRow.step, func.count(func.distinct(StepRow.rank)))
        .where(StepRow.run_id == rid, StepRow.step >= start)
        .group_by(StepRow.step)
        .order_by(StepRow.step)
    ):
        if ranks < run.world_size:
            break
        watermark = step
    settled = session.scalar(
        select(func.max(StepRow.step)).where(
            StepRow.run_id == rid, StepRow.step >= start, StepRow.ts <= now - settle_seconds
        )
    )
    return max(watermark, settled if settled is not None else -1)


def step_buckets(
    session: Session, *, run_id: str, first: int, last: int, steps: int, reduced: bool = False
) -> list[int]:
    """step // steps of every raw step (reduced: every summarised step) in first..last: the cycles
    of that many steps which hold any step."""
    col = StepSummary.step if reduced else StepRow.step
    run = StepSummary.run_id if reduced else StepRow.run_id
    stmt = select(func.distinct(col // steps)).where(run == run_id, col >= first, col <= last)
    return [int(b) for b in session.scalars(stmt)]


def step_rows(
    session: Session, *, run_id: str, first: int, last: int, columns: Sequence[str]
) -> Sequence[Sequence[Any]]:
    """Raw step rows of steps first..last, every incarnation's (the reducer keeps the newest in
    memory: it needs the rows anyway), with `columns` in that order."""
    cols = [getattr(StepRow, c) for c in columns]
    stmt = select(*cols).where(StepRow.run_id == run_id, StepRow.step >= first, StepRow.step <= last)
    return session.execute(stmt).all()


@contextmanager
def _hashed_aggregates(session: Session) -> Iterator[None]:
    """On PostgreSQL, the GROUP BYs of the statements inside hash instead of sort (SET LOCAL,
    restored after them; if one fails, the transaction's rollback undoes it).

    The planner's choice rests on the raw tables' statistics, and there are none until the first
    ANALYZE (autovacuum off, or a run younger than autovacuum's first pass). Then it expects a
    handful of rows and sorts: a 16,384-rank cycle's 3.1M tensor rows went through an external
    merge sort (75 MB of temporary files a step) in 4.9-6.0 s under ingest, against 2.4-2.8 s hashed
    into its 1,536 groups (docs/performance.md). A reduction's groups (steps x tensors) are few."""
    if session.get_bind().dialect.name != "postgresql":
        yield
        return
    for setting in _SORTS:
        session.execute(text(f"SET LOCAL {setting} = off"))
    yield
    for setting in _SORTS:
        session.execute(text(f"SET LOCAL {setting} TO DEFAULT"))


_SORTS = ("enable_sort", "enable_incremental_sort")
_GRAD_SUM_SCALE = 2.0**-64


def grad_summaries(session: Session, *, run_id: str, first: int, last: int) -> list[dict[str, Any]]:
    """Gradient statistics of steps first..last reduced over ranks, the newest incarnation's records
    only: one dict per (step, group) in that order, keys = GradSummary columns but run_id.

    - norm: sqrt of the sum of every rank's owned_sq (each element counted once across the job);
      NaN when a rank's is NaN, or the sum is NaN or negative.
    - nonfinite: summed (saturated).
    - replica_spread: max / min of the ranks' local_sq, NaN ones ignored, the max at least 0; None
      unless the min is a positive finite number.

    A GROUP BY: a 16,384-rank step has 82k gradient rows, which cost the analysis child ~4 us each
    when reduced in Python."""
    g = GradStatRow
    # NaN sorts above every number on both backends (see Real), so `<= inf` drops NaN only.
    local = case((g.local_sq <= math.inf, g.local_sq))
    stmt = (
        select(
            g.step,
            g.group_name,
            # Scaled: PostgreSQL raises on a float sum that overflows (Python's is inf); a power of
            # two is exact (for values above ~1e-288, which it would make subnormal). SQLite's
            # sum() counts its 'NaN' text as 0 (and inf + -inf as NULL): the max says NaN.
            func.sum(g.owned_sq * _GRAD_SUM_SCALE),
            func.max(g.owned_sq),
            func.sum(func.cast(g.nonfinite, Float)),  # as in the tensor aggregation: cannot overflow
            func.min(local),
            func.max(local),
        )
        .where(
            g.run_id == run_id,
            g.step >= first,
            g.step <= last,
            newest_incarnation_only(g, run_id=run_id, first=first, last=last),
        )
        .group_by(g.step, g.group_name)
    )
    out = []
    with _hashed_aggregates(session):
        rows = session.execute(stmt).all()
    for step, group, owned_sum, owned_max, nonfinite, lo, hi in rows:
        nan = owned_sum is None or math.isnan(owned_sum) or math.isnan(owned_max) or owned_sum < 0
        lo = math.inf if lo is None else lo
        hi = max(0.0, 0.0 if hi is None else hi)
        out.append(
            {
                "step": step,
                "group_name": group,
                "norm": math.nan if nan else math.sqrt(owned_sum / _GRAD_SUM_SCALE),
                "nonfinite": saturated_count(nonfinite),
                "replica_spread": hi / lo if 0 < lo < math.inf else None,
            }
        )
    # Sorted here: PostgreSQL's collation may order the group names otherwise than Python.
    return sorted(out, key=lambda d: (d["step"], d["group_name"]))


_TENSOR_KEYS = (
    "step",
    "tensor",
    "role",
    "format",
    "amax",
    "headroom_bits",
    "lag_bits",
    "staleness_steps",
    "sat_frac",
    "underflow_frac",
    "crest_bits",
    "nonfinite",
    "shadow",
)


# SQLite cannot checkpoint its WAL past a read that is still running, and the tensor aggregation is
# the reduction's longest read. Whatever ingest writes meanwhile waits in the WAL, and the first
# commit of ingest's writer after the read ends copies it back (SQLite's automatic checkpoint runs
# in the committing connection): a statement over a 16,384-rank step (786k rows, 1.2-1.5 s under
# ingest) left ~40,000 pages to copy and stalled ingest 83-111 ms each time, its p99 at 100k
# records/s 47-103 ms. Statements of about this many rows run 0.1-0.2 s; with them the p99 was
# 22-31 ms (docs/performance.md, "Slices of a step"). PostgreSQL's reads hold nothing back.
_SQLITE_TENSOR_ROWS_PER_READ = 100_000
# A piece spans at most this many times the steps (or the rowids) of the one before it: the rows a
# piece counted size the next, and a stretch without FP8 records (sampled tiers) must not make the
# next piece unbounded.
_SQLITE_PIECE_GROWTH = 16


def tensor_summaries(session: Session, *, run_id: str, first: int, last: int) -> list[dict[str, Any]]:
    """FP8 tensor statistics of steps first..last reduced over ranks and TP shards of the same
    tensor (amax max, headroom min, non-finite summed: see TensorSummary), the newest incarnation's
    records only. One dict per (step, tensor, role), keys = TensorSummary columns but run_id, in
    (step, tensor, role) order.

    On SQLite in statements of about `_SQLITE_TENSOR_ROWS_PER_READ` rows: whole steps while a step
    is smaller than that (the first piece is one step, and the rows each piece aggregated, counted
    by the GROUP BY anyway, size the next), slices of one step's rowids when it is larger. No count
    before reading: counting the cycle's rows first read every index entry of the range once more."""
    if session.get_bind().dialect.name != "sqlite":
        with _hashed_aggregates(session):
            return _tensor_summaries(session, run_id=run_id, first=first, last=last)[0]
    out: list[dict[str, Any]] = []
    lo, span = first, 1
    while lo <= last:
        hi = min(last, lo + span - 1)
        if span == 1:
            piece, rows = _one_step_in_slices(session, run_id=run_id, step=lo)
        else:
            piece, rows = _tensor_summaries(session, run_id=run_id, first=lo, last=hi)
        out += piece
        lo, span = hi + 1, _next_span(span, rows)
    return out


def _next_span(span: int, rows: int) -> int:
    """The span (steps, or rowids of a slice) of the next piece, from the rows the last one of
    `span` held: about `_SQLITE_TENSOR_ROWS_PER_READ` rows, growing at most `_SQLITE_PIECE_GROWTH`x."""
    return max(1, min(span * _SQLITE_PIECE_GROWTH, span * _SQLITE_TENSOR_ROWS_PER_READ // max(1, rows)))


def _one_step_in_slices(session: Session, *, run_id: str, step: int) -> tuple[list[dict[str, Any]], int]:
    """One step's tensor summaries on SQLite, read in slices of the step's rowid range of about
    `_SQLITE_TENSOR_ROWS_PER_READ` rows each (a slice of N rowids holds at most N of the step's rows:
    fewer, as the other steps of each batch sit between them), merged. Each slice is a seek on the
    (run_id, step) index, whose entries are ordered by rowid within a step. A small step is one slice."""
    t = TensorStatRow
    where = (t.run_id == run_id, t.step == step)
    # Two statements: with min() and max() in one, SQLite reads the whole step's index range.
    lowest = session.scalar(select(func.min(t.id)).where(*where))
    if lowest is None:
        return [], 0
    highest = session.scalar(select(func.max(t.id)).where(*where))
    if highest is None:  # the step's rows went away between the two reads (retention)
        return [], 0
    slices: list[list[dict[str, Any]]] = []
    total, a, width = 0, int(lowest), _SQLITE_TENSOR_ROWS_PER_READ
    while a <= highest:
        b = min(int(highest), a + width - 1)
        piece, rows = _tensor_summaries(session, run_id=run_id, first=step, last=step, ids=(a, b))
        slices.append(piece)
        total += rows
        width = _next_span(width, rows)
        a = b + 1
    return (slices[0] if len(slices) == 1 else _merge_slices(slices)), total


def _tensor_summaries(
    session: Session, *, run_id: str, first: int, last: int, ids: tuple[int, int] | None = None
) -> tuple[list[dict[str, Any]], int]:
    """tensor_summaries in one statement (ids: of rows with rowids in that range only), and the
    number of raw rows it aggregated."""
    t = TensorStatRow
    # One step as an equality, so that SQLite seeks the index on (step, rowid) for a slice of ids.
    steps = (t.step == first,) if first == last else (t.step >= first, t.step <= last)
    stmt = (
        select(
            t.step,
            t.tensor,
            t.role,
            func.max(t.format),
            func.max(t.amax),
            func.min(t.headroom_bits),
            func.max(t.lag_bits),
            func.max(t.staleness_steps),
            func.max(t.sat_frac),
            func.max(t.underflow_frac),
            func.max(t.crest_bits),
            # As a float: an integer sum() overflows on SQLite ("integer overflow") and leaves
            # bigint on PostgreSQL; a float sum cannot fail, and is exact up to 2**53.
            func.sum(func.cast(t.nonfinite, Float)),
            func.min(func.cast(t.shadow, Integer)),
            func.count(),
        )
        .where(
            t.run_id == run_id,
            *steps,
            *(() if ids is None else (t.id.between(*ids),)),
            newest_incarnation_only(t, run_id=run_id, first=first, last=last),
        )
        .group_by(t.step, t.tensor, t.role)
    )
    rows = session.execute(stmt).all()
    out = []
    aggregated = 0
    for *r, count in rows:
        aggregated += count
        d = dict(zip(_TENSOR_KEYS, r, strict=True))
        d["shadow"] = bool(d["shadow"])
        if d["nonfinite"] is not None:
            d["nonfinite"] = saturated_count(d["nonfinite"])
        out.append(d)
    return out, aggregated


# How the slices' summaries of one (step, tensor, role) combine: as the statement's own aggregate
# would have over all their rows.
_MAX_KEYS = ("format", "amax", "lag_bits", "staleness_steps", "sat_frac", "underflow_frac", "crest_bits")


def _merge_slices(slices: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One summary per (step, tensor, role) from the slices' partial ones, in that order. max and
    min order values as SQL does here: NULL (None) ignored, NaN above every number (types.Real)."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for piece in slices:
        for d in piece:
            key = (d["step"], d["tensor"], d["role"])
            m = merged.get(key)
            if m is None:
                merged[key] = dict(d)
                continue
            for k in _MAX_KEYS:
                m[k] = _sql_extreme(max, m[k], d[k])
            m["headroom_bits"] = _sql_extreme(min, m["headroom_bits"], d["headroom_bits"])
            if d["nonfinite"] is not None:
                m["nonfinite"] = saturated_count((m["nonfinite"] or 0) + d["nonfinite"])
            m["shadow"] = m["shadow"] and d["shadow"]
    return [merged[key] for key in sorted(merged)]


def _sql_extreme(pick: Callable[..., Any], a: Any, b: Any) -> Any:
    """pick (max or min) of two aggregates as SQL would pick over their rows."""
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, float) or isinstance(b, float):
        return pick(a, b, key=lambda v: (v != v, v))  # NaN != NaN: NaN sorts above every number
    return pick(a, b)


def replace_summaries(
    session: Session,
    *,
    run_id: str,
    claimed: Progress,
    first: int,
    windows_from: int,
    last: int,
    steps: list[dict[str, Any]],
    grads: list[dict[str, Any]],
    tensors: list[dict[str, Any]],
    windows: list[dict[str, Any]],
    replayed: Collection[int] = (),
) -> None:
    """Replace the summaries of the steps of first..last that were rebuilt (rank windows: from window
    start windows_from), the others kept, and record first..last as reduced, in one transaction
    (committed). replayed: steps a restart ran again (store/incarnations.py), whose summaries of
    every table are replaced, by none where its newest incarnations sent no such records.
    claimed: what `claim_steps` returned before the rows were read; dirty_from is cleared only if
    no ingest re-dirtied a step since."""
    rid = run_id
    conn = session.connection()  # Core statements: the ORM bulk path costs ~3x more per row
    # Every row is built before the first DELETE. On SQLite that statement takes the database's one
    # write lock until the commit, and ingest's writer (another process) waits for it, polling on
    # the busy handler's growing sleeps: built inside, a 16,384-rank cycle held it 84-89 ms, and
    # ingest's p99 at 100k records/s was 99-103 ms while the analysis ran (docs/performance.md).
    inserts = [
        _rows_for(conn, table_of(model), rid, rows)
        for model, rows in ((StepSummary, steps), (GradSummary, grads), (TensorSummary, tensors), (RankWindow, windows))
        if rows
    ]
    # Only the steps rebuilt, each table on its own (rank windows: the (window, rank)s rebuilt): a
    # step whose raw rows retention dropped (docs/deployment.md) is not rebuilt, and its summaries
    # stay. A late row below that horizon rewrites from its step on, and a range delete there took
    # every summary of the steps above it. Read from the rows before the first DELETE, as above.
    deletes: list[tuple[Table, Any, int, list[int], tuple[Any, ...]]] = [
        (table_of(model), table_of(model).c.step, first, sorted({row["step"] for row in rows}.union(replayed)), ())
        for model, rows in ((StepSummary, steps), (GradSummary, grads), (TensorSummary, tensors))
    ]
    ranks_of: dict[int, set[int]] = {}
    for row in windows:
        ranks_of.setdefault(row["window_start"], set()).add(row["rank"])
    starts_of: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for start, ranks in sorted(ranks_of.items()):
        starts_of.setdefault(_spans(sorted(ranks)), []).append(start)
    w = table_of(RankWindow)
    for spans, starts in starts_of.items():  # one entry unless ranks miss windows: every rank's rows
        deletes.append((w, w.c.window_start, windows_from, starts, (or_(*(w.c.rank.between(a, b) for a, b in spans)),)))
    for table, col, lo, keys, where in deletes:
        _delete_keys(conn, table, rid, col, lo, keys, *where)
    for write in inserts:
        write()
    t = _STATE
    conn.execute(
        update(t)
        .where(t.c.run_id == rid)
        .values(
            reduced_upto=case((t.c.reduced_upto < last, last), else_=t.c.reduced_upto),
            dirty_from=case((t.c.dirty_marks == claimed.dirty_marks, None), else_=t.c.dirty_from),
        )
    )
    session.commit()
    state = session.get(ReductionState, rid)
    if state is not None:
        session.expire(state)  # written with Core above: an ORM reader reloads it


_DELETE_KEYS = 500
"""Steps per DELETE of replace_summaries: a late batch's rewrite can span a run's whole history."""


def _delete_keys(
    conn: Connection, table: Table, run_id: str, col: Any, lo: int, keys: list[int], *where: Any
) -> None:
    """Delete the run's rows whose `col` is one of `keys` (sorted), at least lo."""
    for i in range(0, len(keys), _DELETE_KEYS):  # within SQLite's bound parameters
        part = keys[i : i + _DELETE_KEYS]
        # The bounds keep the index's range scan; the keys say which steps in it go.
        bounds = (col >= max(lo, part[0]), col <= part[-1])
        conn.execute(delete(table).where(table.c.run_id == run_id, *bounds, col.in_(part), *where))


def _spans(values: list[int]) -> tuple[tuple[int, int], ...]:
    """Sorted distinct values as (first, last) runs of consecutive ones: a job's ranks, one run."""
    spans: list[tuple[int, int]] = []
    for v in values:
        if spans and spans[-1][1] == v - 1:
            spans[-1] = (spans[-1][0], v)
        else:
            spans.append((v, v))
    return tuple(spans)


def _rows_for(conn: Connection, table: Table, run_id: str, rows: list[dict[str, Any]]) -> Callable[[], object]:
    """The insert of `rows` (dicts of the table's columns but run_id) into `table`, its parameters
    built now, run when called. On SQLite, for a table of scalar columns whose rows have exactly
    its columns: multi-row INSERTs over flat parameters (store/batches.py `sqlite_multirow`, which
    writes NaN as Real does), bound in C. Else SQLAlchemy's executemany, which processes each
    value in Python as it runs."""
    copy_plan = _pg_copy(table) if conn.dialect.name == "postgresql" else None
    if copy_plan is not None and all(len(row) == len(copy_plan[0]) - 1 for row in rows):
        names, copy = copy_plan
        try:
            values = [tuple(run_id if name == "run_id" else row[name] for name in names) for row in rows]
        except KeyError:
            values = None
        if values is not None:
            return lambda: pg_copy_rows(conn.connection.driver_connection, copy, values)
    plan = _sqlite_insert(table) if conn.dialect.name == "sqlite" else None
    if plan is not None:
        names, insert_plan = plan
        try:
            flat = [run_id if name == "run_id" else row[name] for row in rows for name in names]
        except KeyError:
            flat = None
        if flat is not None and all(len(row) == len(names) - 1 for row in rows):  # no key beyond them
            dbapi = conn.connection.driver_connection
            return lambda: sqlite_multirow(dbapi, insert_plan, flat)
    params = [{"run_id": run_id, **row} for row in rows]
    statement = insert(table)
    return lambda: conn.execute(statement, params)


@functools.cache
def _pg_copy(table: Table) -> tuple[tuple[str, ...], PgCopy] | None:
    """The table's column names and a binary COPY into them; None when one has no binary type."""
    names = tuple(c.name for c in table.columns)
    plan = pg_copy(table, names)
    return None if plan is None else (names, plan)


@functools.cache
def _sqlite_insert(table: Table) -> tuple[tuple[str, ...], SqliteInsert] | None:
    """The table's column names and sqlite_multirow's arguments for them; None when a column is not
    one that sqlite3 binds as it is (with store/batches.py's adapters for None and bool), such as
    JSON."""
    if not all(isinstance(c.type, (Integer, String, Boolean, Real)) for c in table.columns):
        return None
    names = tuple(c.name for c in table.columns)
    return names, sqlite_insert(table, names)
