"""The analysis worker's counters in the database (models.AnalysisStatus): written by whichever
process analyses, exported by every process that serves /metrics."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from trainvitals.service.store.models import AnalysisStatus

_ROW = 1


def record_cycle(session: Session, *, seconds: float, errors: int, now: float, holder: str) -> None:
    """Add one finished cycle (committed). Only the lease holder writes, so the row is not contended."""
    values = {
        "cycles": AnalysisStatus.cycles + 1,
        "cycle_seconds_total": AnalysisStatus.cycle_seconds_total + seconds,
        "errors": AnalysisStatus.errors + errors,
        "last_cycle_seconds": seconds,
        "last_cycle_at": now,
        "holder": holder,
    }
    if session.execute(update(AnalysisStatus).where(AnalysisStatus.id == _ROW).values(values)).rowcount == 0:  # type: ignore[attr-defined]
        session.add(
            AnalysisStatus(
                id=_ROW, cycles=1, cycle_seconds_total=seconds, errors=errors, last_cycle_seconds=seconds,
                last_cycle_at=now, holder=holder,
            )  # fmt: skip
        )
    session.commit()


def record_errors(session: Session, *, errors: int) -> None:
    """Count errors of a cycle that did not finish (committed); its time is not a cycle's."""
    added = update(AnalysisStatus).where(AnalysisStatus.id == _ROW).values(errors=AnalysisStatus.errors + errors)
    if session.execute(added).rowcount == 0:  # type: ignore[attr-defined]
        session.add(AnalysisStatus(id=_ROW, cycles=0, cycle_seconds_total=0.0, errors=errors))
    session.commit()


def read(session: Session) -> AnalysisStatus | None:
    """The counters, or None before the first cycle."""
    return session.scalar(select(AnalysisStatus).where(AnalysisStatus.id == _ROW))
