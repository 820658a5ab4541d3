"""Loss divergence: the loss rising above its own recent level (or above a named baseline run at
the same steps), sustained; and non-finite loss, paged at once.

Own baseline: the trailing short median of log loss against the median of an older window (a gap
back, so a slow rise is not absorbed). With a baseline run: the same test on the difference of log
losses at equal steps, whose usual offset is learnt from the run's own history, so warm-up and
end-of-training shapes shared by both runs cancel.

Finding kinds and magnitudes:

- `loss_divergence` (page): loss / reference level (ratio).
- `loss_nonfinite` (page): number of steps with a non-finite loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ._stats import segment_apply, trailing_median, trailing_median_scale
from .findings import Finding
from .series import RunSeries
from .suppression import Suppression


@dataclass(kw_only=True, slots=True, frozen=True)
class LossConfig:
    """Thresholds of the loss detectors."""

    short_steps: int = 25
    """Trailing median that smooths per-step loss noise (single-batch blips never count)."""
    baseline_steps: int = 300
    """Window of the reference level."""
    gap_steps: int = 100
    """The reference window ends this many steps back."""
    min_history: int = 150
    """Finite steps needed in the reference window."""
    rise_floor: float = math.log(1.05)
    """Minimum effect: the smoothed loss must exceed the reference by 5%."""
    rise_z: float = 8.0
    """And by this many standard errors of the short median (robust scale of per-step noise)."""
    sustain_steps: int = 20
    """Consecutive steps the condition must hold."""
    nonfinite_hold_steps: int = 500
    """A non-finite loss stays active this many steps after the last one."""

    def __post_init__(self) -> None:
        if self.short_steps < 1 or self.sustain_steps < 1 or self.rise_floor <= 0:
            raise ValueError("short_steps, sustain_steps must be >= 1 and rise_floor > 0")


def _log(values: np.ndarray) -> np.ndarray:
    ok = np.isfinite(values) & (values > 0)
    return np.log(np.where(ok, values, 1.0)) + np.where(ok, 0.0, np.nan)


def _aligned_baseline(series: RunSeries, baseline: RunSeries) -> np.ndarray:
    """Baseline log loss at the run's steps (NaN where the baseline has no such step)."""
    b = baseline.steps
    out = np.full(len(series.steps.steps), np.nan)
    rows = np.searchsorted(b.steps, series.steps.steps)
    ok = rows < len(b.steps)
    ok[ok] = b.steps[rows[ok]] == series.steps.steps[ok]
    out[ok] = _log(b.loss[rows[ok]])
    return out


def detect_divergence(
    series: RunSeries, sup: Suppression, cfg: LossConfig, *, baseline: RunSeries | None = None
) -> list[Finding]:
    """`loss_divergence` (page) against the run's own history or a baseline run."""
    s = series.steps
    if len(s.steps) == 0:
        return []
    y = _log(s.loss)
    against = "its own level"
    if baseline is not None and len(baseline.steps.steps):
        yb = _aligned_baseline(series, baseline)
        if np.isfinite(yb).sum() >= cfg.min_history:
            y = y - yb
            against = f"baseline run {baseline.run}"
    quiet = sup.suppressed(s.steps)
    y_ref = np.where(quiet, np.nan, y)
    seg = sup.segment_ids(s.steps)

    def per_segment(yy: np.ndarray, yr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        short = trailing_median(
            yy, cfg.short_steps, min_count=max(cfg.short_steps // 2, 1), include_current=True
        )
        # Reference ends gap_steps back: shift the trailing window by padding the front.
        shifted = np.concatenate([np.full(cfg.gap_steps, np.nan), yr])[: len(yr)]
        ref, _ = trailing_median_scale(shifted, cfg.baseline_steps, min_count=cfg.min_history)
        # Per-step noise from first differences: immune to the trend inside the window.
        diffs = np.concatenate([[np.nan], np.diff(yr)])
        diffs = np.concatenate([np.full(cfg.gap_steps, np.nan), diffs])[: len(yr)]
        _, dscale = trailing_median_scale(diffs, cfg.baseline_steps, min_count=cfg.min_history)
        return short, ref, dscale

    short, ref, dscale = segment_apply(seg, per_segment, y, y_ref)
    # Std of one step from its differences is dscale / sqrt(2); a median of n has ~1.25 sigma / sqrt(n).
    se = dscale / math.sqrt(2) * 1.2533 / math.sqrt(cfg.short_steps)
    excess = short - ref
    threshold = np.maximum(cfg.rise_floor, cfg.rise_z * np.nan_to_num(se, nan=np.inf))
    cond = np.isfinite(excess) & (excess > threshold) & ~quiet

    first_fire: int | None = None
    run_len = 0
    for i in range(len(cond)):
        run_len = run_len + 1 if cond[i] else 0
        if run_len >= cfg.sustain_steps:
            first_fire = i
            break
    if first_fire is None:
        return []
    # Onset: walk back over the contiguous stretch where the smoothed loss was already above half
    # the threshold, then back half a short window (the median lags the raw loss by that much).
    i = first_fire
    while (
        i > 0 and np.isfinite(excess[i - 1]) and excess[i - 1] > threshold[i - 1] / 2 and seg[i - 1] == seg[i]
    ):
        i -= 1
    onset_idx = max(i - cfg.short_steps // 2, int(np.searchsorted(seg, seg[i])))
    # Once fired, the reference is frozen at its value then: a loss that stays up is still diverged
    # (a rolling reference would absorb the new level and close the finding).
    frozen = ref[first_fire]
    still = np.isfinite(short) & (short - frozen > threshold[first_fire] / 2)
    still[: first_fire + 1] = True
    active = bool(still[-1])
    last_idx = len(still) - 1 if active else first_fire + int(np.argmin(still[first_fire:]))
    mag = math.exp(float(short[last_idx] - frozen)) if np.isfinite(short[last_idx]) else math.nan
    onset = int(s.steps[onset_idx])
    return [
        Finding(
            kind="loss_divergence",
            severity="page",
            run=series.run,
            subject_kind="run",
            subject="",
            onset_step=onset,
            last_step=int(s.steps[last_idx]),
            magnitude=mag,
            summary=f"loss diverging: {mag:.2f}x {against} since step {onset}",
            active=active,
            detected_step=int(s.steps[first_fire]),
        )
    ]


def detect_nonfinite_loss(series: RunSeries, cfg: LossConfig) -> list[Finding]:
    """`loss_nonfinite` (page). NaN in `loss` means 'not reported', so a NaN counts only where
    `loss_nonfinite` says a rank reported one; +-inf always counts."""
    s = series.steps
    bad = np.isinf(s.loss)
    if s.loss_nonfinite is not None:
        bad |= np.nan_to_num(s.loss_nonfinite, nan=0) > 0
    if not bad.any():
        return []
    at = s.steps[bad]
    return [
        Finding(
            kind="loss_nonfinite",
            severity="page",
            run=series.run,
            subject_kind="run",
            subject="",
            onset_step=int(at[0]),
            last_step=int(at[-1]),
            magnitude=float(len(at)),
            summary=f"non-finite loss on {len(at)} steps since step {at[0]}",
            active=int(at[-1]) > int(s.steps[-1]) - cfg.nonfinite_hold_steps,
            detected_step=int(at[0]),
        )
    ]


def detect_loss(
    series: RunSeries, sup: Suppression, cfg: LossConfig, *, baseline: RunSeries | None = None
) -> list[Finding]:
    """All loss findings of one run."""
    return detect_nonfinite_loss(series, cfg) + detect_divergence(series, sup, cfg, baseline=baseline)
