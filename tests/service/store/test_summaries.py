"""The reduction's SQLite-specific care, with the same answers as PostgreSQL: replace_summaries
writes every value as the Core path would and builds its rows before it takes the database's one
write lock (ingest's writer, in another process, waits for that lock); tensor_summaries reads a
long aggregation in pieces of whole steps or slices of one step."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select
from sqlalchemy.orm import Session

from trainvitals.service.store import batches, db, summaries
from trainvitals.service.store.models import GradSummary, RankWindow, Run, StepSummary, TensorSummary
from trainvitals.wire import Batch, RunRegistration
from trainvitals.wire.v1 import INT64_MAX

RUN = "sums"
NAN, INF = float("nan"), float("inf")


def _tensor(step: int, tensor: str, **values: Any) -> dict[str, Any]:
    row = dict(
        step=step, tensor=tensor, role="input", format="e4m3", amax=1.0, headroom_bits=2.0, lag_bits=None,
        staleness_steps=None, sat_frac=None, underflow_frac=None, crest_bits=None, nonfinite=None, shadow=False,
    )  # fmt: skip
    return {**row, **values}


def _window(rank: int, **values: Any) -> dict[str, Any]:
    row = dict(
        window_start=0, rank=rank, steps=4, pp_stage=None, step_seconds_mean=1.0, step_seconds_p50=1.0,
        step_seconds_max=1.5, compute_seconds_mean=None, wait_seconds_mean=None,
    )  # fmt: skip
    return {**row, **values}


def _step(step: int) -> dict[str, Any]:
    return dict(
        step=step, ranks=2, ts=100.0 + step, step_seconds_min=1.0, step_seconds_p50=1.0, step_seconds_p90=1.0,
        step_seconds_p99=1.0, step_seconds_max=1.0, slowest_rank=1, compute_seconds_p50=None, wait_seconds_p50=None,
        data_seconds_p50=None, loss=NAN, loss_nonfinite=1, grad_norm=None, agent_grad_norm=None, grad_nonfinite=0,
        tokens=None, flops=None, mfu=None, peak_flops_total=None, stage_step_seconds_p50={"0": 1.0},
    )  # fmt: skip


def _replace(session: Session, *, tensors: list[dict[str, Any]], windows: list[dict[str, Any]]) -> None:
    batches.register_run(session, RunRegistration(run=RUN))
    claimed = summaries.claim_steps(session, run_id=RUN, upto=3)
    grads = [{"step": 0, "group_name": "__global__", "norm": NAN, "nonfinite": 3, "replica_spread": None}]
    summaries.replace_summaries(
        session, run_id=RUN, claimed=claimed, first=0, windows_from=0, last=3,
        steps=[_step(0)], grads=grads, tensors=tensors, windows=windows,
    )  # fmt: skip


def _same(a: Any, b: Any) -> bool:
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or a == b


def _columns(obj: Any, names: list[str]) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in names}


def test_every_value_reads_back_as_written(session: Session, monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN (text on SQLite), infinities, None in every optional column, booleans and a JSON column:
    the same values read back on both backends, however each writes them (on PostgreSQL the
    tables of scalar columns by binary COPY)."""
    copied: list[str] = []
    copy_rows = summaries.pg_copy_rows
    monkeypatch.setattr(
        summaries,
        "pg_copy_rows",
        lambda dbapi, plan, rows: (copied.append(plan.sql.split()[1]), copy_rows(dbapi, plan, rows)),
    )
    tensors = [
        _tensor(0, "a", amax=NAN, headroom_bits=-INF, shadow=True, nonfinite=7, sat_frac=0.25),
        _tensor(0, "b", amax=INF, headroom_bits=NAN, lag_bits=0.5, staleness_steps=2, crest_bits=3.0),
        *(_tensor(1, f"t{i}", amax=float(i)) for i in range(40)),
    ]
    windows = [_window(0, step_seconds_max=NAN, pp_stage=3, wait_seconds_mean=0.1), _window(1, step_seconds_mean=INF)]
    _replace(session, tensors=tensors, windows=windows)

    stored_tensors = {(t.step, t.tensor): t for t in session.scalars(select(TensorSummary))}
    assert len(stored_tensors) == len(tensors)
    for row in tensors:
        got = _columns(stored_tensors[(row["step"], row["tensor"])], list(row))
        assert all(_same(got[k], v) for k, v in row.items()), (row, got)
        assert type(got["shadow"]) is bool
    stored_windows = {w.rank: w for w in session.scalars(select(RankWindow))}
    for row in windows:
        got = _columns(stored_windows[row["rank"]], list(row))
        assert all(_same(got[k], v) for k, v in row.items()), (row, got)
    step = session.scalars(select(StepSummary)).one()
    assert math.isnan(step.loss) and step.stage_step_seconds_p50 == {"0": 1.0}
    grad = session.scalars(select(GradSummary)).one()
    assert math.isnan(grad.norm) and grad.nonfinite == 3 and grad.replica_spread is None
    postgres = session.get_bind().dialect.name == "postgresql"
    assert sorted(copied) == (["grad_summaries", "rank_windows", "tensor_summaries"] if postgres else [])


class _ProbingRow(dict[str, Any]):
    """A summary row that, when its values are read, checks whether another connection could
    take the database's write lock at that moment. Iteration is overridden so that `{**row}` reads
    through __getitem__ too."""

    def __init__(self, values: dict[str, Any], probe: Any) -> None:
        super().__init__(values)
        self._probe = probe

    def __iter__(self) -> Iterator[str]:
        return iter(list(dict.keys(self)))

    def __getitem__(self, key: str) -> Any:
        self._probe()
        return dict.__getitem__(self, key)


def test_sqlite_rows_are_built_before_the_write_lock_is_taken(tmp_path: Path, write_lock_probe: Any) -> None:
    """On SQLite ingest's writer (another process) waits for the one write lock, polling on the
    busy handler's sleeps; built under it, a 16,384-rank cycle's rows held it for 84-89 ms. Here a
    second connection tries to take the lock each time a row's values are read: it always can."""
    url = f"sqlite:///{tmp_path}/tv.db"
    db.upgrade(url)
    engine = db.make_engine(url)
    probe = write_lock_probe(tmp_path / "tv.db")
    try:
        with db.make_sessionmaker(engine)() as session:
            windows: list[dict[str, Any]] = [_ProbingRow(_window(rank), probe) for rank in range(3)]
            tensors: list[dict[str, Any]] = [_ProbingRow(_tensor(0, f"t{i}"), probe) for i in range(3)]
            _replace(session, tensors=tensors, windows=windows)
            assert len(session.scalars(select(RankWindow)).all()) == 3
    finally:
        engine.dispose()
    locked = probe.locked
    assert locked and not any(locked), f"{sum(locked)} of {len(locked)} reads found the write lock taken"


def _tensor_batch(rank: int, incarnation: int, seq: int, steps: range, amax: float) -> Batch:
    records: list[dict[str, Any]] = []
    for step in steps:
        records.append({"kind": "step", "step": step, "ts": 100.0 + step, "step_seconds": 1.0})
        for tensor in ("layers.0.fc1", "layers.0.fc2"):
            for role, fmt in (("input", "e4m3"), ("grad_output", "e5m2")):
                value = NAN if (rank, step, tensor) == (2, 1, "layers.0.fc1") else amax + rank + step
                headroom = NAN if (rank, step) == (0, 2) else 3.0 - rank  # the min of a NaN and numbers: a number
                headroom = None if (rank, step) == (2, 5) else headroom  # the min of a NULL and numbers: a number
                records.append(
                    {"kind": "tensor", "step": step, "tensor": tensor, "role": role, "format": fmt, "amax": value,
                     "scale": 1.0, "headroom_bits": headroom, "lag_bits": 0.1 * step, "staleness_steps": rank,
                     "nonfinite": 2 if rank == 1 else None, "crest_bits": 4.0 + step if rank == 2 else None}
                )  # fmt: skip
    return Batch.model_validate({"run": RUN, "rank": rank, "incarnation": incarnation, "seq": seq, "records": records})


def test_sqlite_aggregates_the_tensors_in_pieces_with_the_same_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On SQLite a long aggregation is read in statements of whole steps, or of slices of one step's
    rowids when a step is larger than a statement should read (a long read holds the WAL's
    checkpoint back): the same summaries as one statement, including the newest-incarnation rule
    for a rank that restarted and replayed steps inside the range, NaN and NULL."""
    url = f"sqlite:///{tmp_path}/tv.db"
    db.upgrade(url)
    engine = db.make_engine(url)
    statements: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    try:
        with db.make_sessionmaker(engine)() as session:
            batches.register_run(session, RunRegistration(run=RUN, parallelism={"world_size": 3}))
            for rank in range(3):
                batches.store_batch(session, _tensor_batch(rank, 1, 0, range(6), amax=1.0))
            batches.store_batch(session, _tensor_batch(1, 2, 0, range(3, 6), amax=50.0))  # restarted, replayed 3..5

            whole, rows = summaries._tensor_summaries(session, run_id=RUN, first=0, last=5)  # one statement
            statements.clear()
            default = summaries.tensor_summaries(session, run_id=RUN, first=0, last=5)
            small_run_reads = len(statements)
            statements.clear()
            # No FP8 records before step 0: each empty piece spans at most 16x the one before.
            leading_empty = summaries.tensor_summaries(session, run_id=RUN, first=-40, last=5)
            empty_run_reads = len(statements)
            statements.clear()
            monkeypatch.setattr(summaries, "_SQLITE_TENSOR_ROWS_PER_READ", 20)  # 12 rows a step, in 2 slices
            slices = summaries.tensor_summaries(session, run_id=RUN, first=0, last=5)
            grouped = [s for s in statements if "GROUP BY" in s]
            sliced = [s for s in grouped if "BETWEEN" in s]
    finally:
        engine.dispose()
    assert rows == 6 * 3 * 4  # the replaced incarnation's rows are not aggregated, so not counted
    assert small_run_reads == 2 + 2  # the first step's rowid bounds and its one slice size the pieces, then the rest
    assert empty_run_reads == 3  # step -40 (no rows: its bounds only), steps -39..-24, then the rest
    # Each step's rows span rowids of 3 ranks' batches with the other steps between them: a slice
    # of 20 rowids holds 4 of them, and the next slice, grown from that count, the other 8.
    assert len(sliced) == len(grouped) == 6 * 2
    # No count first: besides the aggregations, only each step's two rowid bounds (index seeks).
    bounds = [s for s in statements if s.startswith(("SELECT min(tensor_stats.id)", "SELECT max(tensor_stats.id)"))]
    assert len(bounds) == 6 * 2 and len(statements) == len(bounds) + len(grouped)
    assert len(slices) == len(default) == len(leading_empty) == len(whole) == 6 * 4
    for a, b, c, d in zip(slices, default, leading_empty, whole, strict=True):
        for got in (a, b, c):
            assert got.keys() == d.keys() and all(_same(got[k], d[k]) for k in d), (got, d)
    by_key = {(r["step"], r["tensor"], r["role"]): r for r in whole}
    assert by_key[(4, "layers.0.fc1", "input")]["amax"] == 50.0 + 1 + 4  # the replay's rank 1, not its first life
    assert by_key[(2, "layers.0.fc1", "input")]["amax"] == 1.0 + 2 + 2  # before the restart: every rank
    assert math.isnan(by_key[(1, "layers.0.fc1", "input")]["amax"])  # NaN is the max, as on PostgreSQL
    assert by_key[(2, "layers.0.fc1", "input")]["headroom_bits"] == 3.0 - 2  # rank 0's NaN is not the min
    assert by_key[(2, "layers.0.fc1", "input")]["nonfinite"] == 2  # rank 1's; the others sent none
    assert by_key[(2, "layers.0.fc1", "input")]["crest_bits"] == 4.0 + 2  # rank 2's; the others sent none
    assert by_key[(5, "layers.0.fc1", "input")]["headroom_bits"] == 3.0 - 1  # rank 2 sent none; rank 1's replay
    assert by_key[(2, "layers.0.fc1", "input")]["sat_frac"] is None  # no rank sent one


# (step, group, rank) -> (owned_sq, local_sq, nonfinite) of the first incarnation where not
# (1.0 + rank, 2.0 + rank, 0); rank 1 restarts and replays steps 2..3 with owned_sq 100.
_GRAD_VALUES = {
    (0, "__global__", 1): (2.0, 3.0, INT64_MAX),
    (0, "__global__", 2): (3.0, 4.0, INT64_MAX),  # summed past int64: saturated
    (0, "layers.0", 0): (NAN, 2.0, 0),  # a NaN sum of squares: the norm is NaN
    (1, "layers.0", 1): (-INF, 3.0, 0),
    (1, "layers.0", 2): (INF, 4.0, 0),  # inf + -inf: NaN
    (1, "__global__", 1): (2.0, NAN, 0),  # a NaN local_sq is left out of the spread
    (2, "__global__", 1): (NAN, 3.0, 0),  # replaced by the replay: not NaN
    (2, "layers.0", 0): (INF, NAN, 0),
    (2, "layers.0", 1): (2.0, NAN, 0),
    (2, "layers.0", 2): (3.0, NAN, 0),  # every local_sq NaN (incl. the replay's): no spread
    (3, "layers.0", 0): (1.0, 0.0, 0),  # min 0: no spread
    (3, "__global__", 2): (3.0, INF, 0),
}


def _grad_batch(rank: int, incarnation: int, steps: range) -> Batch:
    records: list[dict[str, Any]] = []
    for step in steps:
        records.append({"kind": "step", "step": step, "ts": 100.0 + step, "step_seconds": 1.0})
        for group in ("__global__", "layers.0"):
            owned, local, nonfinite = _GRAD_VALUES.get((step, group, rank), (1.0 + rank, 2.0 + rank, 0))
            if incarnation == 2:
                owned, local = 100.0, (NAN if (step, group) == (2, "layers.0") else local)
            records.append(
                {"kind": "grad", "step": step, "group": group, "owned_sq": owned, "local_sq": local,
                 "nonfinite": nonfinite}
            )  # fmt: skip
    return Batch.model_validate({"run": RUN, "rank": rank, "incarnation": incarnation, "seq": 0, "records": records})


def test_gradients_reduce_in_sql_with_nan_inf_and_a_replay(session: Session) -> None:
    """grad_summaries reduces the gradient rows in the database on both backends, as the rule says:
    a NaN or inf + -inf sum of squares makes the norm NaN (SQLite's sum() alone would skip NaN), NaN
    local_sq values stay out of the replicas' spread, counts saturate, and a restarted rank's
    replayed steps replace its first life's records."""
    batches.register_run(session, RunRegistration(run=RUN, parallelism={"world_size": 3}))
    for rank in range(3):
        batches.store_batch(session, _grad_batch(rank, 1, range(4)))
    batches.store_batch(session, _grad_batch(1, 2, range(2, 4)))
    got = summaries.grad_summaries(session, run_id=RUN, first=0, last=3)
    assert [(g["step"], g["group_name"]) for g in got] == [(s, g) for s in range(4) for g in ("__global__", "layers.0")]
    by = {(g["step"], g["group_name"]): g for g in got}
    expected = {  # (norm, nonfinite, replica_spread)
        (0, "__global__"): (math.sqrt(6.0), INT64_MAX, 2.0),
        (0, "layers.0"): (NAN, 0, 2.0),
        (1, "__global__"): (math.sqrt(6.0), 0, 2.0),  # locals 2, NaN, 4
        (1, "layers.0"): (NAN, 0, 2.0),
        (2, "__global__"): (math.sqrt(1.0 + 100.0 + 3.0), 0, 2.0),
        (2, "layers.0"): (INF, 0, None),
        (3, "__global__"): (math.sqrt(104.0), 0, INF),  # locals 2, 3, inf
        (3, "layers.0"): (math.sqrt(104.0), 0, None),
    }
    for key, (norm, nonfinite, spread) in expected.items():
        g = by[key]
        assert _same(g["norm"], norm) and g["nonfinite"] == nonfinite and _same(g["replica_spread"], spread), (key, g)
    assert summaries.grad_summaries(session, run_id=RUN, first=4, last=9) == []


def test_sqlite_reads_gradient_rows_through_the_run_and_step_index(tmp_path: Path) -> None:
    """The gradient reduction finds a step range's rows through ix_grad_stats_run_step (revision
    0021), not by scanning grad_stats: that index replaced (run_id, step, group_name), which ingest
    paid a leaf page per gradient group of every batch for (docs/performance.md, "Session 54")."""
    url = f"sqlite:///{tmp_path}/tv.db"
    db.upgrade(url)
    engine = db.make_engine(url)
    grouped: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "GROUP BY" in statement and "grad_stats" in statement:
            grouped.append((statement, parameters))

    try:
        with db.make_sessionmaker(engine)() as session:
            batches.register_run(session, RunRegistration(run=RUN, parallelism={"world_size": 2}))
            for rank in range(2):
                batches.store_batch(session, _grad_batch(rank, 1, range(4)))
            event.listen(engine, "before_cursor_execute", capture)
            got = summaries.grad_summaries(session, run_id=RUN, first=1, last=2)
            event.remove(engine, "before_cursor_execute", capture)
            assert len(grouped) == 1
            statement, parameters = grouped[0]
            explained = session.connection().exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)
            plan = [row[3] for row in explained]
    finally:
        engine.dispose()
    assert [(g["step"], g["group_name"]) for g in got] == [(s, g) for s in (1, 2) for g in ("__global__", "layers.0")]
    reads = [line for line in plan if "grad_stats" in line]
    by_index = "USING INDEX ix_grad_stats_run_step (run_id=? AND step>? AND step<?)"
    assert reads and all(by_index in line for line in reads), plan


def test_sqlite_finds_the_reducible_step_from_the_step_index_alone(tmp_path: Path) -> None:
    """Every analysis cycle asks how far every rank has reported and which is the newest step with a
    row older than the settle time. Both are read from ix_steps_run_step_rank_ts (revision 0022)
    without a row lookup: the settle test looked up every unreduced step row for its ts, 41-57 ms a
    cycle at 65k rows of a 16,384-rank run on SQLite (docs/performance.md, "Session 64")."""
    url = f"sqlite:///{tmp_path}/tv.db"
    db.upgrade(url)
    engine = db.make_engine(url)
    statements: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "FROM steps" in statement:
            statements.append((statement, parameters))

    def steps(rank: int, upto: int) -> Batch:
        records = [{"kind": "step", "step": step, "ts": 100.0 + step, "step_seconds": 1.0} for step in range(upto + 1)]
        return Batch.model_validate({"run": RUN, "rank": rank, "incarnation": 1, "seq": 0, "records": records})

    try:
        with db.make_sessionmaker(engine)() as session:
            batches.register_run(session, RunRegistration(run=RUN, parallelism={"world_size": 3}))
            for rank, upto in ((0, 5), (1, 5), (2, 2)):  # rank 2 is behind: every rank has sent steps 0-2
                batches.store_batch(session, steps(rank, upto))
            run = session.get(Run, RUN)
            assert run is not None
            event.listen(engine, "before_cursor_execute", capture)
            complete = summaries.reducible_upto(session, run=run, start=0, now=150.0, settle_seconds=60.0)
            settled = summaries.reducible_upto(session, run=run, start=0, now=104.5, settle_seconds=0.0)
            event.remove(engine, "before_cursor_execute", capture)
            plans = [
                [row[3] for row in session.connection().exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params)]
                for sql, params in statements
            ]
    finally:
        engine.dispose()
    # Steps 3-5 wait for rank 2 or for their settle time, which step 4's rows (ts 104) passed at 104.5.
    assert (complete, settled) == (2, 4)
    reads = [line for plan in plans for line in plan if "steps" in line]
    assert len(statements) == 4 and reads, statements
    assert all("USING COVERING INDEX ix_steps_run_step_rank_ts (run_id=? AND step>?)" in line for line in reads), plans


def test_postgresql_aggregates_by_hashing_without_statistics(empty_pg_url: str) -> None:
    """A fresh database has no statistics on the raw tables until its first ANALYZE (autovacuum
    off, or a young run), and the planner then sorts the reduction's rows for the GROUP BY: at
    16,384 ranks an external merge sort through temporary files, twice the time of hashing the
    few groups. The reduction's aggregations hash, and the settings are back afterwards."""
    db.upgrade(empty_pg_url)
    engine = db.make_engine(empty_pg_url)
    grouped: list[tuple[str, Any]] = []
    sorting: list[str] = []  # enable_sort as each aggregation ran

    def capture(_conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "GROUP BY" in statement and not statement.startswith("EXPLAIN"):
            grouped.append((statement, parameters))
            sorting.append(cursor.connection.execute("SHOW enable_sort").fetchone()[0])

    try:
        with db.make_sessionmaker(engine)() as session:
            batches.register_run(session, RunRegistration(run=RUN, parallelism={"world_size": 3}))
            for rank in range(3):
                batches.store_batch(session, _tensor_batch(rank, 1, 0, range(4), amax=1.0))
                batches.store_batch(session, _grad_batch(rank, 1, range(4)))
            event.listen(engine, "before_cursor_execute", capture)
            summaries.tensor_summaries(session, run_id=RUN, first=0, last=3)
            summaries.grad_summaries(session, run_id=RUN, first=0, last=3)
            event.remove(engine, "before_cursor_execute", capture)
            conn = session.connection()

            def plan(statement: str, parameters: Any) -> str:
                return "\n".join(r[0] for r in conn.exec_driver_sql("EXPLAIN " + statement, parameters))

            assert len(grouped) == 2
            unhinted = plan(*grouped[0])
            with summaries._hashed_aggregates(session):
                hinted = [plan(*g) for g in grouped]
            settings = [conn.exec_driver_sql(f"SHOW {s}").scalar() for s in summaries._SORTS]
    finally:
        engine.dispose()
    assert sorting == ["off", "off"]  # both aggregations ran hashed
    assert "Sort" in unhinted, unhinted  # what the planner does without statistics
    for p in hinted:
        assert "HashAggregate" in p and "Sort" not in p, p
    assert settings == ["on", "on"]
