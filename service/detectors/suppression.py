"""Where baseline-driven detectors must not fire: warm-up, after a resume or rollback, at phase changes.

Two outputs, used together by every detector that compares a step with the run's own history:

- segments: baselines restart at each resume / restart / rollback / phase_change, so a new data
  mix or a reloaded optimizer is never judged against the statistics of the old one;
- a mask of suppressed steps: the first `warmup_steps` of the run (the run's own,
  `RunSeries.warmup_steps`, when it registered one) and a window after each boundary where
  transients are expected (Adam moments re-warming, the loss re-settling).

Non-finite values, failed checkpoints and stalls are never suppressed: they are facts, not
deviations from a baseline.

Usage::

    sup = suppression_for(series, SuppressionConfig())
    ok = ~sup.suppressed(series.steps.steps)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainvitals.wire.conventions import DEFAULT_DETECTOR_WARMUP_STEPS

from .series import RunSeries

RESUME_EVENTS = frozenset({"resume", "restart", "rollback"})
"""Events after which the run continues from restored state."""
PHASE_EVENTS = frozenset({"phase_change"})
"""Annotated changes of regime: data-mix switch, LR anneal start, batch-size change."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SuppressionConfig:
    """Windows in steps where baseline detectors stay quiet."""

    warmup_steps: int = DEFAULT_DETECTOR_WARMUP_STEPS
    """From the run's first step: LR warm-up and early loss drop make every baseline meaningless.
    A run that registered `detector_warmup_steps` (RunSeries.warmup_steps) has its own."""
    after_resume_steps: int = 150
    """After a resume/restart/rollback: re-warming optimizer state gives a short grad-norm transient."""
    after_phase_change_steps: int = 300
    """After an annotated phase change: loss and grad norm settle at a new level."""

    def __post_init__(self) -> None:
        if min(self.warmup_steps, self.after_resume_steps, self.after_phase_change_steps) < 0:
            raise ValueError("suppression windows must be >= 0")


@dataclass(kw_only=True, slots=True, frozen=True)
class Suppression:
    """Segment boundaries and suppressed windows of one run (all in step numbers)."""

    start_step: int
    warmup_end: int
    """First step after warm-up."""
    boundaries: tuple[int, ...]
    """Steps where a new segment begins (resumes and phase changes), ascending."""
    resumes: tuple[int, ...]
    """Steps the run resumed at, ascending."""
    windows: tuple[tuple[int, int], ...]
    """[start, end) step windows suppressed after boundaries."""

    def segment_ids(self, steps: np.ndarray) -> np.ndarray:
        """Segment index per step: 0 before the first boundary, then +1 at each."""
        return np.searchsorted(np.asarray(self.boundaries, dtype=np.int64), steps, side="right")

    def suppressed(self, steps: np.ndarray) -> np.ndarray:
        """True where a step is in warm-up or inside a window after a boundary."""
        out = steps < self.warmup_end
        for a, b in self.windows:
            out |= (steps >= a) & (steps < b)
        return out


def suppression_for(series: RunSeries, config: SuppressionConfig) -> Suppression:
    """Read the run's events (and first step) into a Suppression."""
    steps = series.steps.steps
    start = int(steps[0]) if len(steps) else 0
    resumes: set[int] = set()
    boundaries: set[int] = set()
    windows: list[tuple[int, int]] = []
    for ev in series.events:
        if ev.step is None:
            continue
        if ev.event in RESUME_EVENTS:
            resumes.add(ev.step)
            boundaries.add(ev.step)
            windows.append((ev.step, ev.step + config.after_resume_steps))
        elif ev.event in PHASE_EVENTS:
            boundaries.add(ev.step)
            windows.append((ev.step, ev.step + config.after_phase_change_steps))
    # The run knows its own LR schedule best: a warm-up it registered wins over the collector's.
    warmup = config.warmup_steps if series.warmup_steps is None else series.warmup_steps
    return Suppression(
        start_step=start,
        warmup_end=start + warmup,
        boundaries=tuple(sorted(b for b in boundaries if b > start)),
        resumes=tuple(sorted(resumes)),
        windows=tuple(sorted(windows)),
    )
