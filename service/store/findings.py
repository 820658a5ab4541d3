"""Findings storage: one row per (run, kind, subject), upserted by every analysis cycle.

The detectors return their whole current view each cycle (service/detectors: pure functions); this
module turns it into rows: new findings are inserted, known ones updated in place (onset, last
step, magnitude, active), and findings the detectors no longer report become inactive.

Onsets are stable (the rule lives here, so the live worker and replay both get it): each cycle
recomputes a finding over the detectors' lookback, which slides forward, so a recomputed onset can
move later although nothing changed (a straggler paged "since step 600" would read "since step
900"). While a stored finding is open, its onset may move earlier (new evidence backdates it) but
never later, and `detected_step` stays the step it was first raised at. A closed finding reported
open again is a new episode: onset and detected step start afresh.
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
    @property
    def detected_step(self) -> int | None: ...


def store_findings(session: Session, *, run_id: str, findings: Sequence[FindingLike], now: float) -> None:
    """Upsert by (run, kind, subject); the detector says which are active; findings it no longer
    reports at all become inactive. Onsets and detected steps as in the module docstring. Committed."""
    existing = {
        (f.kind, f.subject_kind, f.subject): f
        for f in session.scalars(select(FindingRow).where(FindingRow.run_id == run_id))
    }
    seen = set()
    for f in findings:
        key = (f.kind, f.subject_kind, f.subject)
        seen.add(key)
        # A detector without a step-based detection (None) raised it at its newest step at the latest.
        raised: int = f.detected_step if f.detected_step is not None else f.last_step
        detected: int | None
        onset, detected = f.onset_step, raised
        row = existing.get(key)
        if row is None:
            row = FindingRow(
                run_id=run_id, kind=f.kind, subject_kind=f.subject_kind, subject=f.subject, first_seen_at=now
            )
            session.add(row)
        elif row.active or (not f.active and raised <= row.last_step):
            # The same episode: open, or closed and reported closed again (raised before it ended).
            onset, detected = min(row.onset_step, onset), row.detected_step  # None: stored before 0009
        row.severity, row.onset_step, row.detected_step, row.last_step = f.severity, onset, detected, f.last_step
        row.magnitude, row.summary, row.active, row.updated_at = (
            float(f.magnitude),
            _since(f.summary, reported=f.onset_step, kept=onset),
            bool(f.active),
            now,
        )
    for key, row in existing.items():
        if key not in seen and row.active:
            row.active = False
            row.updated_at = now
    session.commit()


def _since(summary: str, *, reported: int, kept: int) -> str:
    """The summary with the kept onset: detectors write "since step N" with the onset they computed,
    and the line a person reads must not contradict `onset_step` beside it."""
    return summary if reported == kept else summary.replace(f"since step {reported}", f"since step {kept}")
