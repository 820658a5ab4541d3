"""Turn validated wire messages into rows, atomically and idempotently.

The HTTP route and `trainvitals replay` both call `store_batch`: one transaction inserts the
batch's idempotency row and all its records, so a batch is stored whole or not at all, and a
retried batch (same run, rank, incarnation, seq) is acknowledged without storing anything.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from trainvitals.service.store.models import RECORD_TABLES, DeliveredBatch, ReductionState, Run
from trainvitals.wire import Batch, BatchAck, RunRegistration


class UnknownRunError(LookupError):
    """A batch arrived for a run that was never registered."""


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


def batch_rows(batch: Batch) -> dict[str, list[dict[str, Any]]]:
    """Group a batch's records into row dicts per record kind (pure; shared with benchmarks)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    common = {"run_id": batch.run, "rank": batch.rank, "incarnation": batch.incarnation}
    for record in batch.records:
        row = record.model_dump(exclude={"kind"})
        row.update(common)
        if record.kind == "grad":
            row["group_name"] = row.pop("group")
        rows.setdefault(record.kind, []).append(row)
    return rows


def _mark_late_data(session: Session, run_id: str, grouped: dict[str, list[dict[str, Any]]]) -> None:
    """Records for steps already reduced (a spool replayed after an outage) re-dirty them."""
    steps = [r["step"] for kind in ("step", "tensor", "grad") for r in grouped.get(kind, ())]
    if not steps:
        return
    state = session.get(ReductionState, run_id)
    low = min(steps)
    if state is not None and low <= state.reduced_upto:
        state.dirty_from = low if state.dirty_from is None else min(state.dirty_from, low)


def store_batch(session: Session, batch: Batch, *, now: float | None = None) -> BatchAck:
    """Store one batch atomically; a duplicate is acknowledged and stores nothing."""
    now = time.time() if now is None else now
    run = session.execute(select(Run.status).where(Run.run_id == batch.run)).first()
    if run is None:
        raise UnknownRunError(f"run {batch.run!r} is not registered: POST /v1/runs first")
    session.add(
        DeliveredBatch(
            run_id=batch.run,
            rank=batch.rank,
            incarnation=batch.incarnation,
            seq=batch.seq,
            received_at=now,
            records=len(batch.records),
        )
    )
    try:
        session.flush()
    except IntegrityError:
        session.rollback()
        return BatchAck(accepted=0, duplicate=True)
    grouped = batch_rows(batch)
    for kind, rows in grouped.items():
        session.execute(insert(RECORD_TABLES[kind]), rows)
    _mark_late_data(session, batch.run, grouped)
    values: dict[Any, Any] = {Run.last_seen_at: now}
    if batch.rank == 0 and any(r.kind == "event" and r.event == "stop" for r in batch.records):
        values[Run.status] = "finished"  # rank 0 closing its agent ends the run
    session.query(Run).filter(Run.run_id == batch.run).update(values)
    session.commit()
    return BatchAck(accepted=len(batch.records), duplicate=False)
