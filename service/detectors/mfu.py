"""MFU gap: measured model-FLOPs utilisation against the expected one (advisor prediction or a
configured value), sustained over several windows.

MFU per step = model FLOPs of the step / (job step time x summed peak FLOP/s). Per window the median
is taken, gap = 1 - measured / expected. Two tests, either fires (after `persist_windows`):
- absolute: the measured MFU is below what the prediction can explain. With an advisor prediction
  that is the low end of its band (held-out error of the config's regime, widened outside the
  calibrated domain), so an uncertain prediction needs a larger gap and a prediction far outside
  the domain effectively never fires; with a configured MFU (no band), a gap above `gap` (0.2).
- own: the gap exceeds the run's own healthy gap by 0.1 (the reference's second test: a run that got
  worse fires whatever the prediction's bias).

Finding kind `mfu_gap` (ticket); magnitude: the gap (0-1).

And `mfu_impossible` (ticket; magnitude: the measured MFU): a window's median MFU above 100% of
peak, with or without an expectation (200% for a run that trains in FP8: its MFU is quoted against
the dense bf16 peak, and FP8's is twice that on every FP8 GPU). No hardware does that, so the FLOPs
counted or the peak is wrong, most often a job's `flops=` counting the whole tensor/pipeline group
on every rank, which the collector then sums tp x pp times (docs/agent.md). Such an MFU hides any
real gap: said apart, as a configuration to fix, not a slowdown.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._stats import nanmedian, runs_of_true
from .findings import Finding, current_episode
from .series import RunSeries
from .suppression import Suppression


@dataclass(kw_only=True, slots=True, frozen=True)
class MfuConfig:
    """Thresholds of the MFU-gap detector."""

    window_steps: int = 200
    """Steps per window (median MFU); windows are judged once complete."""
    gap: float = 0.2
    """Absolute gap that counts when the expectation has no band (a configured MFU)."""
    own_gap_excess: float = 0.1
    """Or the gap exceeding the run's own early gap (median of its first windows) by this much."""
    own_windows: int = 5
    """Windows after warm-up that set the run's own gap."""
    persist_windows: int = 3
    """Consecutive windows (a checkpoint stall or one slow window is not a gap)."""
    impossible_mfu: float = 1.0
    """A window's median MFU above this is miscounted FLOPs or peak (`mfu_impossible`): one window
    says it, a median of 200 steps that no stall or burst can raise above the hardware's peak."""
    fp8_peak_ratio: float = 2.0
    """FP8's dense peak over bf16's (H100, H200, B200, GB200): an FP8 run's MFU, quoted against the
    bf16 peak, is impossible only above impossible_mfu times this."""

    def __post_init__(self) -> None:
        if not 0 < self.gap < 1:
            raise ValueError("gap must be in (0, 1)")


def _windows(series: RunSeries, sup: Suppression, cfg: MfuConfig) -> np.ndarray | None:
    """The median MFU of each complete window (NaN: no step of it counted); None without MFU."""
    s = series.steps
    if s.mfu is None or len(s.steps) < cfg.window_steps:
        return None
    mfu = np.array(s.mfu, dtype=float)  # as the reduction stored it: MFU is computed in one place
    mfu[sup.suppressed(s.steps) | ~np.isfinite(mfu)] = np.nan
    w = cfg.window_steps
    n_win = len(s.steps) // w
    return nanmedian(mfu[: n_win * w].reshape(n_win, w), axis=1)


def detect_mfu_impossible(series: RunSeries, sup: Suppression, cfg: MfuConfig) -> list[Finding]:
    """`mfu_impossible`: the newest episode of windows whose median MFU exceeds the peak."""
    win = _windows(series, sup, cfg)
    if win is None:
        return []
    s, w = series.steps, cfg.window_steps
    ceiling = cfg.impossible_mfu * (cfg.fp8_peak_ratio if series.fp8_training else 1.0)
    flag = np.nan_to_num(win, nan=-np.inf) > ceiling
    runs = runs_of_true(flag)
    if not runs:
        return []
    a, b = runs[-1]
    worst = float(np.max(win[a:b]))
    onset = int(s.steps[a * w])
    return [
        Finding(
            kind="mfu_impossible",
            severity="ticket",
            run=series.run,
            subject_kind="run",
            subject="",
            onset_step=onset,
            last_step=int(s.steps[b * w - 1]),
            magnitude=worst,
            summary=(
                f"measured MFU {worst:.0%} of peak since step {onset}: above {ceiling:.0%}"
                f"{' (FP8: twice the bf16 peak)' if series.fp8_training else ''} cannot be, so the FLOPs counted or "
                "the peak is wrong, and a real MFU gap would not show. Usual causes: flops= passed for the whole "
                "tensor/pipeline group on every rank (pass the rank's part), parallelism.tp / pp not registered, or "
                "hardware.peak_flops / gpu_count below the devices' (docs/agent.md, What feeds MFU)"
            ),
            active=b == len(flag),
            detected_step=int(s.steps[(a + 1) * w - 1]),
        )
    ]


def detect_mfu_gap(series: RunSeries, sup: Suppression, cfg: MfuConfig) -> list[Finding]:
    """`mfu_gap` findings of one run (silent without expected MFU or peak FLOP/s)."""
    expected = series.expected_mfu
    if not expected:
        return []
    win = _windows(series, sup, cfg)
    if win is None:
        return []
    s, w, n_win = series.steps, cfg.window_steps, len(win)
    gap = 1 - win / expected
    # The prediction's band sets the absolute threshold: below its low end the model cannot explain it.
    low = series.expected_mfu_low
    threshold = 1 - low / expected if low is not None and 0 < low < expected else cfg.gap
    valid = np.flatnonzero(np.isfinite(gap))
    own = float(np.median(gap[valid[: cfg.own_windows]])) if len(valid) >= cfg.own_windows else np.inf
    # The own-gap test uses only windows before the one judged: windows after the first own_windows.
    own_test = np.zeros(n_win, dtype=bool)
    if len(valid) >= cfg.own_windows:
        after = np.arange(n_win) > valid[cfg.own_windows - 1]
        own_test = after & (np.nan_to_num(gap, nan=-np.inf) > own + cfg.own_gap_excess)
    flag = (np.nan_to_num(gap, nan=-np.inf) > threshold) | own_test
    episodes: list[Finding] = []
    for a, b in runs_of_true(flag):
        if b - a < cfg.persist_windows:
            continue
        fired = a + cfg.persist_windows - 1
        active = b == n_win
        mag = float(gap[b - 1])
        onset = int(s.steps[a * w])
        measured = float(win[b - 1])
        band = f", band floor {low:.1%}" if low is not None else ""
        convention = f"; FLOPs as {series.mfu_convention}" if series.mfu_convention else ""
        episodes.append(
            Finding(
                kind="mfu_gap",
                severity="ticket",
                run=series.run,
                subject_kind="run",
                subject="",
                onset_step=onset,
                last_step=int(s.steps[b * w - 1]),
                magnitude=mag,
                summary=(
                    f"MFU {measured:.1%} vs expected {expected:.1%}{band} (gap {mag:.0%}) "
                    f"since step {onset}{convention}"
                ),
                active=active,
                detected_step=int(s.steps[(fired + 1) * w - 1]),
            )
        )
    return current_episode(episodes)  # the gap open now (or the latest), not the run's first
