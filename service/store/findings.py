"""Findings storage: one row per (run, kind, subject), upserted by every analysis cycle.

The detectors return their whole current view each cycle (service/detectors: pure functions); this
module turns it into rows: new findings are inserted, known ones updated in place (onset, last
step, magnitude, active), and findings the detectors no longer report become inactive.

Onsets are stable (the rule lives here, in `fold_findings`, so the live worker, replay and the
analysis on request all get it): each cycle recomputes a finding over the detectors' lookback,
which slides forward, so a recomputed onset can move later although nothing changed (a straggler
paged "since step 600" would read "since step 900"). While a stored finding is open, its onset may
move earlier (new evidence backdates it) but never later, `detected_step` stays the step it was
first raised at and `paged_step` the first step it was a page (the detectors recompute both over
the lookback, where they too would move later). A closed finding reported open again is a new
episode: onset, detected and paged step start afresh.

A run whose analysis raises (service/analysis/worker.py) gets one finding of its own,
`analysis_failed` (`record_analysis_failure`), open while it keeps failing; the first cycle that
analyses the run again stores the detectors' view, which does not report it, so it closes.

Usage::

    store_findings(session, run_id=run, findings=detect(series), now=now)   # one cycle, stored
    held = fold_findings(held, detect(series))                            # one cycle, in memory
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from trainvitals.service.store.models import FindingRow

Key = tuple[str, str, str]
"""A finding's identity within its run: (kind, subject_kind, subject)."""


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
    @property
    def paged_step(self) -> int | None: ...


@dataclass(kw_only=True, slots=True, frozen=True)
class HeldFinding:
    """A finding as kept between cycles: a stored row's columns, or what the analysis on request
    holds in memory while it walks a run."""

    kind: str
    severity: str
    subject_kind: str
    subject: str
    onset_step: int
    detected_step: int | None
    """None: a row stored before revision 0009."""
    last_step: int
    magnitude: float
    summary: str
    active: bool
    paged_step: int | None = None
    """The first step this episode was a page, kept like detected_step; None: it never paged (or a
    row stored before revision 0020)."""


def fold_findings(held: Mapping[Key, HeldFinding], findings: Sequence[FindingLike]) -> dict[Key, HeldFinding]:
    """The held findings after a cycle that reported `findings` (pure: `held` is not changed).

    Each reported finding replaces the held one of its key, keeping the held onset (unless the new
    one is earlier), detected and paged step while it is the same episode: the held one open, or
    closed and reported closed again having been raised before it ended. Otherwise (new, reopened,
    a later episode seen only closed) it starts afresh. Held findings not reported become inactive."""
    out = dict(held)
    for f in findings:
        key = (f.kind, f.subject_kind, f.subject)
        # A detector without a step-based detection (None) raised it at its newest step at the latest.
        raised = f.detected_step if f.detected_step is not None else f.last_step
        onset: int = f.onset_step
        detected: int | None = raised
        paged = f.paged_step
        prev = out.get(key)
        if prev is not None and (prev.active or (not f.active and raised <= prev.last_step)):
            onset, detected = min(prev.onset_step, onset), prev.detected_step
            paged = min((s for s in (prev.paged_step, paged) if s is not None), default=None)
        out[key] = HeldFinding(
            kind=f.kind,
            severity=f.severity,
            subject_kind=f.subject_kind,
            subject=f.subject,
            onset_step=onset,
            detected_step=detected,
            last_step=f.last_step,
            magnitude=float(f.magnitude),
            summary=_since(f.summary, reported=f.onset_step, kept=onset),
            active=bool(f.active),
            paged_step=paged,
        )
    reported = {(f.kind, f.subject_kind, f.subject) for f in findings}
    for key, h in held.items():
        if key not in reported and h.active:
            out[key] = dataclasses.replace(h, active=False)
    return out


def store_findings(session: Session, *, run_id: str, findings: Sequence[FindingLike], now: float) -> None:
    """Upsert by (run, kind, subject) with `fold_findings`'s rules: reported findings are written
    (updated_at now), findings it no longer reports at all become inactive. Committed."""
    rows = {
        (r.kind, r.subject_kind, r.subject): r
        for r in session.scalars(select(FindingRow).where(FindingRow.run_id == run_id))
    }
    held = {key: _held(r) for key, r in rows.items()}
    reported = {(f.kind, f.subject_kind, f.subject) for f in findings}
    for key, h in fold_findings(held, findings).items():
        if key not in reported and h == held[key]:
            continue  # neither reported nor closed now: untouched
        row = rows.get(key)
        if row is None:
            row = FindingRow(
                run_id=run_id, kind=h.kind, subject_kind=h.subject_kind, subject=h.subject, first_seen_at=now
            )
            session.add(row)
        row.severity, row.onset_step, row.detected_step = h.severity, h.onset_step, h.detected_step
        row.paged_step = h.paged_step
        row.last_step, row.magnitude, row.summary, row.active = h.last_step, h.magnitude, h.summary, h.active
        row.updated_at = now
    session.commit()


def _held(row: FindingRow) -> HeldFinding:
    return HeldFinding(
        kind=row.kind,
        severity=row.severity,
        subject_kind=row.subject_kind,
        subject=row.subject,
        onset_step=row.onset_step,
        detected_step=row.detected_step,
        last_step=row.last_step,
        magnitude=row.magnitude,
        summary=row.summary,
        active=row.active,
        paged_step=row.paged_step,
    )


def _since(summary: str, *, reported: int, kept: int) -> str:
    """The summary with the kept onset: detectors write "since step N" with the onset they computed,
    and the line a person reads must not contradict `onset_step` beside it."""
    return summary if reported == kept else summary.replace(f"since step {reported}", f"since step {kept}")


ANALYSIS_FAILED = "analysis_failed"
"""The finding kind of a run whose analysis raised: its other findings are as of its last good cycle."""


def record_analysis_failure(session: Session, *, run_id: str, step: int, error: str, now: float) -> int:
    """Open the run's `analysis_failed` finding, or count one more failure on the open one; returns
    the failures in a row (its magnitude). Touches no other finding of the run. Committed.

    step: the first step the analysis has not judged (the onset of a new episode; the last step of
    every failure)."""
    row = session.scalar(
        select(FindingRow).where(
            FindingRow.run_id == run_id,
            FindingRow.kind == ANALYSIS_FAILED,
            FindingRow.subject_kind == "run",
            FindingRow.subject == "",
        )
    )
    if row is None:
        row = FindingRow(run_id=run_id, kind=ANALYSIS_FAILED, subject_kind="run", subject="", first_seen_at=now)
        session.add(row)
    if not row.active or row.magnitude is None:  # a new episode
        row.onset_step, row.detected_step, row.magnitude = step, step, 0.0
    row.magnitude += 1
    row.severity, row.last_step, row.active, row.updated_at = "ticket", step, True, now
    row.summary = (
        f"the collector failed to analyse this run {int(row.magnitude)} cycle(s) in a row since step "
        f"{row.onset_step}; its other findings are as of its last good cycle (retried every cycle; the "
        f"collector's log names the run): {error}"
    )[:2000]
    session.commit()
    return int(row.magnitude)
