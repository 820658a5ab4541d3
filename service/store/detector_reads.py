"""The detectors' input as stored: the summary tables and the per-rank timing of raw steps, read
as numpy columns (service/analysis/detector_inputs.py keeps them between analysis cycles).

Reads of long step ranges (the first read of a run: 600 steps x 16,384 ranks of timing, 20,000
steps x 384 tensors) stream in chunks; a cycle's few new steps are read whole.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from trainvitals.service.store.incarnations import newest_incarnation_only
from trainvitals.service.store.models import (
    CheckpointRow,
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

STEP_DTYPES = (I64, F64, F64, I64, F64, F64, F64, F64, I64, F64)
"""step_columns: step, loss, grad_norm, grad_nonfinite, step_seconds_max, ts, tokens, flops,
loss_nonfinite, mfu."""
GROUP_DTYPES = (I64, object, F64)
"""group_norm_columns: step, group name, norm."""
TENSOR_DTYPES = (I64, F64, F64, F64, F64, F64, F64)
"""TensorChunk.columns: step, amax, headroom_bits, lag_bits, sat_frac, underflow_frac, nonfinite."""
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
            s.loss_nonfinite, s.mfu,
        )
        .where(s.run_id == run_id, s.step > after, s.step <= upto)
        .order_by(s.step)
    )
    return _read_columns(session, stmt, STEP_DTYPES, upto - after)


def group_norm_columns(session: Session, *, run_id: str, after: int, upto: int) -> list[np.ndarray]:
    """Per parameter group norms (not the global one) of steps after < step <= upto, ascending by
    step (columns: GROUP_DTYPES)."""
    g = GradSummary
    stmt = (
        select(g.step, g.group_name, g.norm)
        .where(g.run_id == run_id, g.step > after, g.step <= upto, g.group_name != GLOBAL_GROUP)
        .order_by(g.step)
    )
    return _read_columns(session, stmt, GROUP_DTYPES, upto - after)


@dataclass(frozen=True, slots=True)
class TensorChunk:
    """Rows of tensor summaries ordered by (tensor, role, step): one tensor's rows are contiguous
    and may continue into the next chunk."""

    keys: list[tuple[str, str]]
    """(tensor, role) per row."""
    formats: Sequence[str]
    shadows: Sequence[bool]
    columns: list[np.ndarray]
    """TENSOR_DTYPES."""


def tensor_chunks(session: Session, *, run_id: str, after: int, upto: int) -> Iterator[TensorChunk]:
    """Tensor summaries of steps after < step <= upto, in chunks."""
    t = TensorSummary
    stmt = (
        select(
            t.tensor,
            t.role,
            t.format,
            t.shadow,
            t.step,
            t.amax,
            t.headroom_bits,
            t.lag_bits,
            t.sat_frac,
            t.underflow_frac,
            t.nonfinite,
        )
        .where(t.run_id == run_id, t.step > after, t.step <= upto)
        .order_by(t.tensor, t.role, t.step)
    )
    for rows in _partitions(session, stmt, upto - after):
        cols = list(zip(*rows, strict=True))
        yield TensorChunk(
            keys=list(zip(cols[0], cols[1], strict=True)),
            formats=cols[2],
            shadows=cols[3],
            columns=[_column(v, d) for v, d in zip(cols[4:], TENSOR_DTYPES, strict=True)],
        )


def rank_timing_columns(session: Session, *, run_id: str, after: int, upto: int) -> list[np.ndarray]:
    """Per (step, rank) timing of raw steps after < step <= upto: one row per cell, the newest
    incarnation's (columns: RANK_DTYPES). Ordered by step (the (run_id, step, rank) index order),
    so a rank's pipeline stage is the one of its newest step wherever it changed."""
    s = StepRow
    stmt = (
        select(s.step, s.rank, s.step_seconds, s.compute_seconds, s.wait_seconds, s.pp_stage)
        .where(
            s.run_id == run_id,
            s.step > after,
            s.step <= upto,
            newest_incarnation_only(s, run_id=run_id, first=after + 1, last=upto),
        )
        .order_by(s.step, s.rank)
    )
    return _read_columns(session, stmt, RANK_DTYPES, upto - after)


def checkpoints(session: Session, *, run_id: str) -> Sequence[CheckpointRow]:
    """Every checkpoint record of the run, by time."""
    return session.scalars(select(CheckpointRow).where(CheckpointRow.run_id == run_id).order_by(CheckpointRow.ts)).all()


def events(session: Session, *, run_id: str) -> Sequence[EventRow]:
    """Every run event, by time."""
    return session.scalars(select(EventRow).where(EventRow.run_id == run_id).order_by(EventRow.ts)).all()
