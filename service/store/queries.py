"""Read queries: keyword-only functions over a Session. Route handlers, the CLI, the exposition
collector and the demo call these; none of them writes SQL of its own."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from trainvitals.service.store.models import (
    CheckpointRow,
    DeliveredBatch,
    EventRow,
    GradStatRow,
    Run,
    StepRow,
    TensorStatRow,
)

GLOBAL_GROUP = "__global__"


def list_runs(session: Session, *, project: str | None = None) -> list[Run]:
    query = select(Run).order_by(Run.created_at)
    if project is not None:
        query = query.where(Run.project == project)
    return list(session.scalars(query))


def live_runs(
    session: Session, *, now: float, finished_grace_seconds: float, idle_seconds: float
) -> list[Run]:
    """Runs that belong in /metrics: running and seen recently, or finished within the grace."""
    horizon_running = now - idle_seconds
    horizon_finished = now - finished_grace_seconds
    query = select(Run).where(
        ((Run.status == "running") & (Run.last_seen_at >= horizon_running))
        | ((Run.status == "finished") & (Run.last_seen_at >= horizon_finished))
    )
    return list(session.scalars(query))


def global_grad_norm(session: Session, *, run_id: str, step: int) -> float | None:
    """sqrt of the sum over ranks of owned sums of squares (shards once, replicas once)."""
    total = session.scalar(
        select(func.sum(GradStatRow.owned_sq)).where(
            GradStatRow.run_id == run_id, GradStatRow.step == step, GradStatRow.group_name == GLOBAL_GROUP
        )
    )
    return None if total is None else math.sqrt(total)


@dataclass(kw_only=True, slots=True)
class RunOverview:
    """What the demo prints and `trainvitals query runs` shows."""

    run_id: str
    project: str
    status: str
    world_size: int
    ranks: int
    steps: int
    step_records: int
    first_step: int | None
    last_step: int | None
    step_seconds_p50: float | None
    step_seconds_min_rank_mean: float | None
    step_seconds_max_rank_mean: float | None
    slowest_rank: int | None
    tensor_records: int
    grad_records: int
    checkpoint_records: int
    events: int


def run_overview(session: Session, *, run_id: str) -> RunOverview | None:
    run = session.get(Run, run_id)
    if run is None:
        return None
    agg = session.execute(
        select(
            func.count(),
            func.count(func.distinct(StepRow.rank)),
            func.count(func.distinct(StepRow.step)),
            func.min(StepRow.step),
            func.max(StepRow.step),
        ).where(StepRow.run_id == run_id)
    ).one()
    per_rank = session.execute(
        select(StepRow.rank, func.avg(StepRow.step_seconds))
        .where(StepRow.run_id == run_id)
        .group_by(StepRow.rank)
        .order_by(StepRow.rank)
    ).all()
    times = sorted(session.scalars(select(StepRow.step_seconds).where(StepRow.run_id == run_id)).all())
    slowest = max(per_rank, key=lambda r: r[1]) if per_rank else None

    def _count(model: type) -> int:
        return int(session.scalar(select(func.count()).select_from(model).where(model.run_id == run_id)) or 0)

    return RunOverview(
        run_id=run.run_id,
        project=run.project,
        status=run.status,
        world_size=run.world_size,
        ranks=agg[1],
        steps=agg[2],
        step_records=agg[0],
        first_step=agg[3],
        last_step=agg[4],
        step_seconds_p50=times[len(times) // 2] if times else None,
        step_seconds_min_rank_mean=min(r[1] for r in per_rank) if per_rank else None,
        step_seconds_max_rank_mean=max(r[1] for r in per_rank) if per_rank else None,
        slowest_rank=slowest[0] if slowest else None,
        tensor_records=_count(TensorStatRow),
        grad_records=_count(GradStatRow),
        checkpoint_records=_count(CheckpointRow),
        events=_count(EventRow),
    )


def step_keys(session: Session, *, run_id: str) -> set[tuple[int, int, int]]:
    """(rank, incarnation, step) of every stored step record; used by exactly-once checks."""
    rows = session.execute(
        select(StepRow.rank, StepRow.incarnation, StepRow.step).where(StepRow.run_id == run_id)
    ).all()
    return {(r[0], r[1], r[2]) for r in rows}


def count_step_rows(session: Session, *, run_id: str) -> int:
    return int(session.scalar(select(func.count()).select_from(StepRow).where(StepRow.run_id == run_id)) or 0)


def mark_finished(session: Session, *, run_id: str, now: float) -> None:
    run = session.get(Run, run_id)
    if run is not None:
        run.status = "finished"
        run.last_seen_at = now
        session.commit()


def delete_run(session: Session, *, run_id: str) -> bool:
    """Delete a run and every record of it; returns False when there was no such run."""
    if session.get(Run, run_id) is None:
        return False
    for model in (StepRow, TensorStatRow, GradStatRow, CheckpointRow, EventRow, DeliveredBatch):
        session.execute(delete(model).where(model.run_id == run_id))
    session.execute(delete(Run).where(Run.run_id == run_id))
    session.commit()
    return True


def rank_step_seconds(session: Session, *, run_id: str) -> list[tuple[int, float, float, float]]:
    """Per rank: (rank, mean, p50, p99) step seconds over the whole run."""
    rows = session.execute(
        select(StepRow.rank, StepRow.step_seconds).where(StepRow.run_id == run_id).order_by(StepRow.rank)
    ).all()
    by_rank: dict[int, list[float]] = {}
    for rank, seconds in rows:
        by_rank.setdefault(rank, []).append(seconds)
    out = []
    for rank, values in sorted(by_rank.items()):
        values.sort()
        out.append(
            (
                rank,
                sum(values) / len(values),
                values[len(values) // 2],
                values[min(len(values) - 1, int(0.99 * len(values)))],
            )
        )
    return out


def get_run(session: Session, *, run_id: str) -> Run | None:
    return session.get(Run, run_id)
