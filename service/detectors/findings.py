"""What every detector returns: findings (stored, served by the query API, exported as metrics)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Severity = Literal["page", "ticket", "info"]
SubjectKind = Literal["run", "tensor", "layer", "rank", "node", "stage", "checkpoint"]


@dataclass(kw_only=True, slots=True, frozen=True)
class Finding:
    """One problem in one run, with where it is and since when.

    Usage::

        Finding(kind="straggler", severity="page", run="r1", subject_kind="rank", subject="17",
                onset_step=1200, last_step=1500, magnitude=1.31,
                summary="rank 17 is 31% slower than its pipeline stage since step 1200")
    """

    kind: str
    """Detector-specific kind, e.g. fp8_clipping, grad_spikes_recurring, straggler, mfu_gap."""
    severity: Severity
    """page: wake someone; ticket: look during working hours; info: recorded only."""
    run: str
    subject_kind: SubjectKind
    """What `subject` names."""
    subject: str
    """The tensor ('layers.3.fc:input'), layer, rank ('17'), node, stage ('2') or '' for the run."""
    onset_step: int
    """First step where the evidence starts (not when the detector became sure)."""
    last_step: int
    """Latest step still showing it."""
    magnitude: float
    """Detector-specific size: bits, ratio, z-score, seconds; documented per kind."""
    summary: str
    """One line a person reads at 3 a.m."""
    active: bool = True
    """True while the condition still holds at the newest step: the collector exports only active
    findings; a post-mortem over a stored run also sees the resolved ones."""
    detected_step: int | None = None
    """First step at which the detector, seeing only data up to that step, would have raised this
    finding (detectors are causal, so a live collector raises it there too). None: not step-based."""
    paged_step: int | None = None
    """First step at which it was a page (later than `detected_step` when a ticket escalated: a loss
    bump that did not recover, an FP8 forecast that became imminent). None: never paged. `detect()`
    fills it with `detected_step` for findings that page from the start."""

    @property
    def key(self) -> tuple[str, str, str, str]:
        """Identity of a finding across detector runs: the same problem updates one row."""
        return (self.run, self.kind, self.subject_kind, self.subject)


def current_episode(episodes: list[Finding]) -> list[Finding]:
    """One finding per subject from its episodes in step order: the one open now, else the latest
    that paged (a post-mortem must see the page), else the latest. Earlier episodes were this
    finding live; the first one may have resolved long ago."""
    if not episodes:
        return []
    if episodes[-1].active:
        return [episodes[-1]]
    paged = [f for f in episodes if f.severity == "page"]
    return [paged[-1] if paged else episodes[-1]]
