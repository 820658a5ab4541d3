"""Checkpoint and liveness detectors: failed saves, overdue saves, no usable rollback target, and a
run that stopped making steps.

These depend on wall time, so they take `series.now` (passed in by the caller, never read from a
clock) and stay silent without it.

Finding kinds and magnitudes:

- `checkpoint_failed` (subject: generation; page after 2 consecutive failed saves, else ticket):
  consecutive failures ending at this generation.
- `checkpoint_overdue` (ticket; page beyond 4 intervals): training time since the newest good save
  (up to the last step) / interval.
- `no_rollback_target` (ticket; page when a divergence-type page is open and nothing good predates
  its onset): steps since the newest good generation (or since the start).
- `run_stalled` (page): seconds since the last step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .findings import Finding, Severity
from .series import CheckpointEvent, RunSeries

GOOD_STATUSES = frozenset({"persisted", "verified"})
DIVERGENCE_KINDS = frozenset(
    {
        "grad_spikes_recurring",
        "loss_divergence",
        "loss_nonfinite",
        "grad_nonfinite",
        "fp8_clipping",
        "fp8_nonfinite",
    }
)
"""Page kinds after which someone will want to roll back to a generation saved before the onset."""


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointConfig:
    """Thresholds of the checkpoint and liveness detectors."""

    failed_page_after: int = 2
    """Consecutive failed saves that page (one failure with the next save due soon is a ticket)."""
    overdue_factor: float = 1.5
    """Newest good save older than this many intervals: overdue (ticket)."""
    overdue_page_factor: float = 4.0
    """... older than this many: page."""
    require_verified: bool = False
    """Only 'verified' generations count as rollback targets (else 'persisted' is enough)."""
    no_target_after_intervals: float = 2.0
    """Without any good generation after this many intervals of run time: ticket."""
    no_target_after_steps: int = 5000
    """... or after this many steps when no interval is known."""
    stall_factor: float = 10.0
    """No step for this many typical step times: stalled."""
    min_stall_seconds: float = 120.0
    """... and at least this long (short steps would otherwise page on a GC pause)."""
    typical_steps: int = 100
    """Recent steps whose median step time is 'typical'."""


def _good(ev: CheckpointEvent, cfg: CheckpointConfig) -> bool:
    return ev.status == "verified" if cfg.require_verified else ev.status in GOOD_STATUSES


def _by_generation(events: Sequence[CheckpointEvent]) -> list[tuple[int, list[CheckpointEvent]]]:
    gens: dict[int, list[CheckpointEvent]] = {}
    for ev in sorted(events, key=lambda e: (e.ts, e.generation)):
        gens.setdefault(ev.generation, []).append(ev)
    return sorted(gens.items(), key=lambda kv: (kv[1][0].ts, kv[0]))


def rollback_target(series: RunSeries, before_step: int, cfg: CheckpointConfig) -> CheckpointEvent | None:
    """The newest good generation saved strictly before `before_step` whose files are still there
    (no rank recorded it deleted since: the job's retention), or None."""
    deleted = {(ev.generation, ev.incarnation) for ev in series.checkpoints if ev.status == "deleted"}
    good = [
        ev
        for ev in series.checkpoints
        if _good(ev, cfg) and ev.step < before_step and (ev.generation, ev.incarnation) not in deleted
    ]
    return max(good, key=lambda e: (e.step, e.ts)) if good else None


def detect_failed(series: RunSeries, cfg: CheckpointConfig) -> list[Finding]:
    out: list[Finding] = []
    consecutive = 0
    gens = _by_generation(series.checkpoints)
    for i, (gen, evs) in enumerate(gens):
        statuses = {e.status for e in evs}
        if "failed" in statuses and not statuses & GOOD_STATUSES:
            consecutive += 1
        elif statuses & GOOD_STATUSES:
            consecutive = 0
            continue
        else:
            continue  # started, not finished yet
        failed = next(e for e in evs if e.status == "failed")
        recovered = any({e.status for e in later} & GOOD_STATUSES for _, later in gens[i + 1 :])
        sev: Severity = "page" if consecutive >= cfg.failed_page_after else "ticket"
        out.append(
            Finding(
                kind="checkpoint_failed",
                severity=sev,
                run=series.run,
                subject_kind="checkpoint",
                subject=str(gen),
                onset_step=failed.step,
                last_step=failed.step,
                magnitude=float(consecutive),
                summary=(
                    f"checkpoint generation {gen} (step {failed.step}) failed to save"
                    + (f"; {consecutive} failed saves in a row" if consecutive > 1 else "")
                ),
                active=not recovered,
                detected_step=failed.step,
            )
        )
    return out


def _stopped(series: RunSeries) -> bool:
    stops = [e.ts for e in series.events if e.event == "stop"]
    return bool(stops) and max(stops) >= float(series.steps.ts[-1]) - 1e-9


def detect_overdue(series: RunSeries, cfg: CheckpointConfig) -> list[Finding]:
    s = series.steps
    interval = series.checkpoint_interval_seconds
    if series.now is None or not interval or len(s.steps) == 0 or _stopped(series):
        return []
    good_ts = [e.ts for e in series.checkpoints if _good(e, cfg)]
    since = max(good_ts) if good_ts else float(s.ts[0])
    # What is at risk is training done since the newest good save: up to the last step, not up to
    # now (a stalled run accumulates no unsaved work; run_stalled covers it).
    age = float(s.ts[-1]) - since
    if age <= cfg.overdue_factor * interval:
        return []
    due = since + cfg.overdue_factor * interval
    i = int(np.searchsorted(s.ts, due, side="right"))
    onset = int(s.steps[min(i, len(s.steps) - 1)])
    ratio = age / interval
    what = "the newest good checkpoint" if good_ts else "the run start (no good checkpoint yet)"
    return [
        Finding(
            kind="checkpoint_overdue",
            severity="page" if ratio >= cfg.overdue_page_factor else "ticket",
            run=series.run,
            subject_kind="run",
            subject="",
            onset_step=onset,
            last_step=int(s.steps[-1]),
            magnitude=ratio,
            summary=(
                f"checkpoint overdue: {age / 60:.0f} min since {what}, {ratio:.1f}x the "
                f"{interval / 60:.0f} min interval"
            ),
            active=True,
            detected_step=onset,
        )
    ]


def detect_no_rollback_target(
    series: RunSeries, cfg: CheckpointConfig, *, open_pages: Sequence[Finding] = ()
) -> list[Finding]:
    """No good generation at all after a while (ticket), or none before an open divergence (page)."""
    s = series.steps
    if len(s.steps) == 0:
        return []
    first, last = int(s.steps[0]), int(s.steps[-1])
    onsets = [f for f in open_pages if f.kind in DIVERGENCE_KINDS and f.severity == "page" and f.active]
    if onsets:
        earliest = min(onsets, key=lambda f: f.onset_step)
        if rollback_target(series, earliest.onset_step, cfg) is None:
            # Saves recorded deleted since (a deletion alone, of a save never stored, is not counted).
            saved = {(ev.generation, ev.incarnation) for ev in series.checkpoints if ev.status in GOOD_STATUSES}
            retired = {(ev.generation, ev.incarnation) for ev in series.checkpoints
                       if ev.status == "deleted" and ev.step < earliest.onset_step} & saved  # fmt: skip
            deleted = (
                f"; the {len(retired)} saved before it were deleted since (the job's retention, or a later save "
                "to the same path); a retention of more generations (save_total_limit, save_top_k, keep_last) "
                "keeps one from before an onset until it is paged"
                if retired
                else ""
            )
            return [
                Finding(
                    kind="no_rollback_target",
                    severity="page",
                    run=series.run,
                    subject_kind="run",
                    subject="",
                    onset_step=earliest.onset_step,
                    last_step=last,
                    magnitude=float(last - first),
                    summary=(
                        f"no good checkpoint saved before step {earliest.onset_step}, where "
                        f"{earliest.kind} began: rolling back means restarting from scratch or from a "
                        f"generation that already carries the problem{deleted}"
                    ),
                    active=True,
                    detected_step=earliest.detected_step or last,
                )
            ]
    target = rollback_target(series, last + 1, cfg)
    if target is not None:
        return []
    interval = series.checkpoint_interval_seconds
    if interval:
        due_ts = float(s.ts[0]) + cfg.no_target_after_intervals * interval
        now = series.now if series.now is not None else float(s.ts[-1])
        if now <= due_ts:
            return []
        i = int(np.searchsorted(s.ts, due_ts, side="right"))
    else:
        if last - first < cfg.no_target_after_steps:
            return []
        i = int(np.searchsorted(s.steps, first + cfg.no_target_after_steps))
    onset = int(s.steps[min(i, len(s.steps) - 1)])
    what = "verified" if cfg.require_verified else "persisted or verified"
    return [
        Finding(
            kind="no_rollback_target",
            severity="ticket",
            run=series.run,
            subject_kind="run",
            subject="",
            onset_step=onset,
            last_step=last,
            magnitude=float(last - first),
            summary=f"no {what} checkpoint generation after {last - first:,} steps: nothing to roll back to",
            active=True,
            detected_step=onset,
        )
    ]


def detect_stalled(series: RunSeries, cfg: CheckpointConfig) -> list[Finding]:
    s = series.steps
    if series.now is None or len(s.steps) == 0 or _stopped(series):
        return []
    recent = s.step_seconds[-cfg.typical_steps :]
    recent = recent[np.isfinite(recent)]
    typical = float(np.median(recent)) if len(recent) else 0.0
    # A checkpoint save blocks training for its stall: allow twice the longest stall seen.
    stalls = [e.stall_seconds for e in series.checkpoints if e.stall_seconds is not None]
    allowance = max(cfg.stall_factor * typical, cfg.min_stall_seconds, 2 * max(stalls, default=0.0))
    since = series.now - float(s.ts[-1])
    if since <= allowance:
        return []
    last = int(s.steps[-1])
    return [
        Finding(
            kind="run_stalled",
            severity="page",
            run=series.run,
            subject_kind="run",
            subject="",
            onset_step=last,
            last_step=last,
            magnitude=since,
            summary=(
                f"no step for {since / 60:.1f} min after step {last} (typical step {typical:.2f} s): "
                "hung collective, dead rank or stuck I/O"
            ),
            active=True,
            detected_step=last,
        )
    ]


def detect_checkpoints(series: RunSeries, cfg: CheckpointConfig) -> list[Finding]:
    """Failed and overdue saves, stalls. The rollback check needs the other findings: see run_all."""
    return detect_failed(series, cfg) + detect_overdue(series, cfg) + detect_stalled(series, cfg)
