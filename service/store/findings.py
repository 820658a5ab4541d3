"""Findings storage: one row per (run, kind, subject), upserted by every analysis cycle.

The detectors return their whole current view each cycle (service/detectors: pure functions); this
module turns it into rows: new findings are inserted, known ones updated in place (onset, last
step, magnitude, active), and findings the detectors no longer report become inactive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from trainvitals.service.store.models import FindingRow


class FindingLike(Protocol):
    """What is stored of a finding (service/detectors/findings.py `Finding` has it)."""

    @property
    def kind(self) -> str: ...
    @property
    def severity(self) -> str: ...
    @property
    def subject_kind(self) -> str: ...
    @property
    def subject(self) -> str: ...
    @property
    def onset_step(self) -> int: ...
    @property
    def last_step(self) -> int: ...
    @property
    def magnitude(self) -> float: ...
    @property
    def summary(self) -> str: ...
    @property
    def active(self) -> bool: ...


def store_findings(session: Session, *, run_id: str, findings: Sequence[FindingLike], now: float) -> None:
    """Upsert by (run, kind, subject); the detector says which are active; findings it no longer
    reports at all become inactive. Committed."""
    existing = {
        (f.kind, f.subject_kind, f.subject): f
        for f in session.scalars(select(FindingRow).where(FindingRow.run_id == run_id))
    }
    seen = set()
    for f in findings:
        key = (f.kind, f.subject_kind, f.subject)
        seen.add(key)
        active = bool(f.active)
        row = existing.get(key)
        if row is None:
            session.add(
                FindingRow(
                    run_id=run_id,
                    kind=f.kind,
                    severity=f.severity,
                    subject_kind=f.subject_kind,
                    subject=f.subject,
                    onset_step=f.onset_step,
                    last_step=f.last_step,
                    magnitude=float(f.magnitude),
                    summary=f.summary,
                    active=active,
                    first_seen_at=now,
                    updated_at=now,
                )
            )
        else:
            row.severity, row.onset_step, row.last_step = f.severity, f.onset_step, f.last_step
            row.magnitude, row.summary, row.active, row.updated_at = (
                float(f.magnitude),
                f.summary,
                active,
                now,
            )
    for key, row in existing.items():
        if key not in seen and row.active:
            row.active = False
            row.updated_at = now
    session.commit()
