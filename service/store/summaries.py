"""The reduction's storage: how far each run is reduced, the raw rows a cycle reduces, and the
summaries it writes.

A cycle (service/analysis/pipeline.py) reads the raw rows of the steps it reduces, the cross-rank
reductions are done in memory (service/analysis/reduction.py) except the FP8 tensor summary, which
is a GROUP BY here (hundreds of tensors x every rank: the rows never leave the database). The
summaries of those steps are then replaced in one transaction with the reduction state that says
how far they go. Every read of raw rows goes through the newest-incarnation rule
(store/incarnations.py): in SQL here, or in memory for the step rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Float, Integer, Row, delete, func, insert, select
from sqlalchemy.orm import Session

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
from trainvitals.wire.v1 import INT64_MAX


def saturated_count(total: float) -> int:
    """A count summed over ranks, as its 64-bit column holds it: each rank's count is in range (the
    wire checks it), their sum need not be, and one run's numbers must not stop its reduction."""
    return min(int(total), INT64_MAX)


def reduction_state(session: Session, *, run_id: str) -> ReductionState:
    """The run's reduction state, created (flushed, not committed) on its first cycle."""
    state = session.get(ReductionState, run_id)
    if state is None:
        state = ReductionState(run_id=run_id, reduced_upto=-1, dirty_from=None)
        session.add(state)
        session.flush()
    return state


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


def grad_rows(session: Session, *, run_id: str, first: int, last: int) -> Sequence[Row[int, str, float, float, int]]:
    """(step, group, owned_sq, local_sq, nonfinite) of every rank for steps first..last, the
    newest incarnation's only."""
    g = GradStatRow
    stmt = select(g.step, g.group_name, g.owned_sq, g.local_sq, g.nonfinite).where(
        g.run_id == run_id,
        g.step >= first,
        g.step <= last,
        newest_incarnation_only(g, run_id=run_id, first=first, last=last),
    )
    return session.execute(stmt).all()


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


def tensor_summaries(session: Session, *, run_id: str, first: int, last: int) -> list[dict[str, Any]]:
    """FP8 tensor statistics of steps first..last reduced over ranks and TP shards of the same
    tensor (amax max, headroom min, non-finite summed: see TensorSummary), the newest incarnation's
    records only. One dict per (step, tensor, role), keys = TensorSummary columns but run_id."""
    t = TensorStatRow
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
        )
        .where(
            t.run_id == run_id,
            t.step >= first,
            t.step <= last,
            newest_incarnation_only(t, run_id=run_id, first=first, last=last),
        )
        .group_by(t.step, t.tensor, t.role)
    )
    rows = session.execute(stmt).all()
    out = []
    for r in rows:
        d = dict(zip(_TENSOR_KEYS, r, strict=True))
        d["shadow"] = bool(d["shadow"])
        if d["nonfinite"] is not None:
            d["nonfinite"] = saturated_count(d["nonfinite"])
        out.append(d)
    return out


def replace_summaries(
    session: Session,
    *,
    state: ReductionState,
    first: int,
    windows_from: int,
    last: int,
    steps: list[dict[str, Any]],
    grads: list[dict[str, Any]],
    tensors: list[dict[str, Any]],
    windows: list[dict[str, Any]],
) -> None:
    """Replace the summaries of steps first..last (rank windows: from window start windows_from)
    and record them as reduced, in one transaction (committed)."""
    rid = state.run_id
    conn = session.connection()  # Core statements: the ORM bulk path costs ~3x more per row
    for model, lo in ((StepSummary, first), (GradSummary, first), (TensorSummary, first), (RankWindow, windows_from)):
        table = table_of(model)
        col = table.c.window_start if model is RankWindow else table.c.step
        conn.execute(delete(table).where(table.c.run_id == rid, col >= lo, col <= last))
    for model, batch in ((StepSummary, steps), (GradSummary, grads), (TensorSummary, tensors), (RankWindow, windows)):
        if batch:
            conn.execute(insert(table_of(model)), [{"run_id": rid, **row} for row in batch])
    state.reduced_upto = max(state.reduced_upto, last)
    state.dirty_from = None
    session.commit()
