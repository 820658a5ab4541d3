"""Gradient-norm detectors: spikes (counted), recurring spikes (paged), slow drift (ticketed),
non-finite gradients (paged at once).

Why this shape (see docs/detectors.md): a single spike is common and benign (a bad batch, a burst
that recovers within a couple of hundred steps); what precedes a late divergence is spikes that keep
coming back and a norm that drifts up over hundreds to thousands of steps. So spikes are counted
(info), recurrence is paged with a Poisson tail test against the run's own spike rate, and drift
opens a ticket (a rising norm is also what the end of a healthy run looks like).

All statistics are in log space (norms are multiplicative) and causal.

Finding kinds and magnitudes:

- `grad_spike` (info): number of spikes so far.
- `grad_spikes_recurring` (page): spike episodes in the recent window.
- `grad_norm_drift` (ticket): ratio of the current block median to the reference level.
- `grad_nonfinite` (page): number of steps with a non-finite gradient.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
from scipy import stats

from ._stats import fmt_int, log_positive, runs_of_true, segment_apply, trailing_median, trailing_median_scale
from .baseline import aligned_log
from .findings import Finding, SubjectKind
from .series import RunSeries
from .suppression import Suppression


@dataclass(kw_only=True, slots=True, frozen=True)
class GradNormConfig:
    """Thresholds of the gradient-norm detectors (steps are optimizer steps)."""

    baseline_steps: int = 200
    """Trailing window of the robust baseline (median and MAD of log norm)."""
    min_history: int = 50
    """Finite steps needed in the window before a step can be called a spike."""
    spike_z: float = 6.0
    """Robust z in log space (OLMo-core and the skip-step optimizers use 6 sigma)."""
    spike_ratio: float = 2.0
    """And at least this multiple of the baseline median: z alone flags tiny moves on very smooth runs."""
    min_scale: float = 0.02
    """Floor on the robust scale (log units), for the same reason."""
    episode_gap_steps: int = 50
    """Spikes closer than this belong to one episode: a burst counts once."""
    recent_steps: int = 2000
    """Window over which recurring episodes are counted."""
    min_episodes: int = 5
    """Never page on fewer episodes than this in the window, whatever the reference rate."""
    poisson_alpha: float = 1e-4
    """Page when P(N >= k) under the run's own episode rate is below this."""
    prior_episodes: float = 1.0
    """Pseudo-count of the reference rate (with prior_steps): one episode per 2k steps a priori, so
    early in a run (little history) more episodes are needed; a quiet history lowers the rate."""
    prior_steps: float = 2_000.0
    """Pseudo-exposure of the reference rate."""
    drift_block_steps: int = 100
    """Drift works on block medians so single spikes do not move it."""
    drift_ref_blocks: int = 20
    """Blocks forming the drift reference level (median of their medians)."""
    drift_gap_blocks: int = 5
    """Blocks between the reference and the current block, so a slow rise is not absorbed at once."""
    drift_floor: float = math.log(1.1)
    """CUSUM allowance and minimum effect (ln 1.1): smaller low-frequency wander is not drift."""
    drift_threshold: float = 0.5
    """CUSUM level (summed log excess over the floor) that opens the ticket."""
    nonfinite_hold_steps: int = 500
    """A non-finite finding stays active this many steps after the last non-finite step."""
    skipped_run_steps: int = 32
    """Steps whose non-finite gradients the optimizer skipped (a loss scaler: routine with fp16)
    page only this many in a row: 32 halvings take torch.amp.GradScaler's initial 2**16 to 2**-16,
    far below any scale still being calibrated, so the run has stopped learning."""

    def __post_init__(self) -> None:
        if self.spike_ratio <= 1 or self.spike_z <= 0:
            raise ValueError("spike_ratio must be > 1 and spike_z > 0")
        if self.min_episodes < 2:
            raise ValueError("min_episodes must be >= 2: one episode is not a recurrence")
        if self.skipped_run_steps < 1:
            raise ValueError("skipped_run_steps must be >= 1")


def spike_mask(series: RunSeries, sup: Suppression, cfg: GradNormConfig) -> tuple[np.ndarray, np.ndarray]:
    """(spike per step, log residual vs the trailing median) over `series.steps`."""
    s = series.steps
    x = log_positive(s.grad_norm)
    if s.skipped is not None:  # gradients the optimizer never applied are not the run's trajectory
        x = np.where(s.skipped, np.nan, x)
    seg = sup.segment_ids(s.steps)
    med, scale = segment_apply(
        seg, lambda xs: trailing_median_scale(xs, cfg.baseline_steps, min_count=cfg.min_history), x
    )
    resid = x - med
    z = resid / np.maximum(scale, cfg.min_scale)
    spike = np.isfinite(z) & (z > cfg.spike_z) & (resid > math.log(cfg.spike_ratio))
    spike &= ~sup.suppressed(s.steps)
    return spike, resid


def _episode_starts(spike_steps: np.ndarray, gap: int) -> np.ndarray:
    if len(spike_steps) == 0:
        return spike_steps
    new = np.concatenate([[True], np.diff(spike_steps) > gap])
    return spike_steps[new]


def _blame_group(series: RunSeries, at_steps: np.ndarray, cfg: GradNormConfig) -> str | None:
    """The parameter group that most often carried the largest excess at the given steps."""
    g = series.groups
    if g is None or len(g.groups) == 0 or len(at_steps) == 0:
        return None
    rows = np.searchsorted(g.steps, at_steps)
    ok = rows < len(g.steps)
    ok[ok] = g.steps[rows[ok]] == at_steps[ok]
    idx = rows[ok]
    if len(idx) == 0:
        return None
    excess = np.full((len(idx), len(g.groups)), -np.inf)
    for j in range(len(g.groups)):
        lg = log_positive(g.norms[:, j])
        med = trailing_median(
            lg, cfg.baseline_steps, min_count=cfg.min_history, stride=max(cfg.baseline_steps // 20, 1)
        )
        e = (lg - med)[idx]
        excess[:, j] = np.where(np.isfinite(e), e, -np.inf)
    winners = Counter(int(k) for k in np.argmax(excess, axis=1))
    return g.groups[winners.most_common(1)[0][0]]


def _poisson_p(k: int, lam: float) -> float:
    return float(stats.poisson.sf(k - 1, lam))


def detect_spikes(series: RunSeries, sup: Suppression, cfg: GradNormConfig) -> list[Finding]:
    """`grad_spike` (info, counted) and `grad_spikes_recurring` (page)."""
    s = series.steps
    if len(s.steps) == 0:
        return []
    spike, resid = spike_mask(series, sup, cfg)
    spike_steps = s.steps[spike]
    if len(spike_steps) == 0:
        return []
    last = int(s.steps[-1])
    ratios = np.exp(resid[spike])
    out = [
        Finding(
            kind="grad_spike",
            severity="info",
            run=series.run,
            subject_kind="run",
            subject="",
            onset_step=int(spike_steps[0]),
            last_step=int(spike_steps[-1]),
            magnitude=float(len(spike_steps)),
            summary=(
                f"{len(spike_steps)} gradient-norm spikes (largest {ratios.max():.1f}x the running "
                f"median), first at step {spike_steps[0]}, last at {spike_steps[-1]}"
            ),
            active=int(spike_steps[-1]) > last - cfg.recent_steps,
            detected_step=int(spike_steps[0]),
        )
    ]

    starts = _episode_starts(spike_steps, cfg.episode_gap_steps)
    quiet = sup.suppressed(s.steps)
    # Exposure in steps that could have produced a spike (not suppressed), cumulative by step.
    open_steps = np.concatenate([[0], np.cumsum(~quiet)])

    def exposure(lo: float, hi: float) -> int:
        """Non-suppressed steps with lo < step <= hi."""
        a = np.searchsorted(s.steps, lo, side="right")
        b = np.searchsorted(s.steps, hi, side="right")
        return int(open_steps[b] - open_steps[a])

    def test(at: int) -> tuple[bool, int, float, float]:
        """Is recurrence significant at step `at`? (fires, k, expected, p)."""
        cut = at - cfg.recent_steps
        k = int(np.sum((starts > cut) & (starts <= at)))
        n_ref = int(np.sum(starts <= cut))
        rate = (n_ref + cfg.prior_episodes) / (exposure(-math.inf, cut) + cfg.prior_steps)
        lam = rate * max(exposure(cut, at), 1)
        p = _poisson_p(k, lam)
        return k >= cfg.min_episodes and p < cfg.poisson_alpha, k, lam, p

    # The count only rises when an episode starts, so testing there finds the first firing step.
    fired_at: int | None = None
    for st in starts:
        fires, k, lam, p = test(int(st))
        if fires:
            fired_at = int(st)
            break
    if fired_at is None:
        return out
    in_window = starts[(starts > fired_at - cfg.recent_steps) & (starts <= fired_at)]
    onset = int(in_window[0])
    active_now, k_now, lam_now, p_now = test(last)
    k_report, lam_report, p_report = (k_now, lam_now, p_now) if active_now else test(fired_at)[1:]
    later = spike_steps[spike_steps >= onset]
    blame = _blame_group(series, later, cfg)
    where = f", mostly in {blame}" if blame else ""
    out.append(
        Finding(
            kind="grad_spikes_recurring",
            severity="page",
            run=series.run,
            subject_kind="run",
            subject="",
            onset_step=onset,
            last_step=int(later[-1]),
            magnitude=float(k_report),
            summary=(
                f"gradient-norm spikes recur: {k_report} episodes in {fmt_int(cfg.recent_steps)} steps "
                f"(expected {lam_report:.2f}, p={p_report:.1e}){where}, since step {onset}; "
                "late-divergence precursor"
            ),
            active=active_now,
            detected_step=fired_at,
        )
    )
    return out


def detect_drift(
    series: RunSeries, sup: Suppression, cfg: GradNormConfig, *, baseline: RunSeries | None = None
) -> list[Finding]:
    """`grad_norm_drift` (ticket): CUSUM over block medians of log norm against a lagged reference;
    with a baseline run, of the log ratio to the baseline's norm at equal steps (detectors/baseline.py),
    so an end-of-training rise both runs share cancels."""
    s = series.steps
    if len(s.steps) == 0:
        return []
    x = log_positive(s.grad_norm)
    what, note = "gradient norm", "benign near the end of training"
    # The reference needs half its blocks, as below; fewer aligned steps: judged against itself.
    xb = aligned_log(series, baseline, "grad_norm", min_steps=cfg.drift_ref_blocks // 2 * cfg.drift_block_steps)
    if xb is not None and baseline is not None:
        x = x - xb
        what, note = f"gradient norm relative to baseline run {baseline.run}", "a rise the baseline did not have"
    x[sup.suppressed(s.steps)] = np.nan
    seg = sup.segment_ids(s.steps)
    bsz = cfg.drift_block_steps
    block = s.steps // bsz
    last = int(s.steps[-1])
    # A block is complete once its last step is in: only complete blocks are judged (causality).
    first_hit: tuple[int, int, float] | None = None  # (onset, detected, ratio)
    latest: tuple[bool, float, int] = (False, 0.0, last)
    for sid in np.unique(seg):
        in_seg = seg == sid
        keys = np.unique(block[in_seg])
        med = np.full(len(keys), np.nan)
        for i, key in enumerate(keys):
            v = x[in_seg & (block == key)]
            v = v[np.isfinite(v)]
            if len(v) >= bsz // 2:
                med[i] = np.median(v)
        cusum = 0.0
        run_start: int | None = None
        for i, key in enumerate(keys):
            if (key + 1) * bsz - 1 > last:
                break  # incomplete
            lo, hi = i - cfg.drift_gap_blocks - cfg.drift_ref_blocks, i - cfg.drift_gap_blocks
            ref_vals = med[max(lo, 0) : max(hi, 0)]
            ref_vals = ref_vals[np.isfinite(ref_vals)]
            if len(ref_vals) < cfg.drift_ref_blocks // 2 or not np.isfinite(med[i]):
                continue
            d = float(med[i] - np.median(ref_vals))
            prev = cusum
            cusum = max(0.0, cusum + d - cfg.drift_floor)
            if prev == 0.0 and cusum > 0.0:
                run_start = int(key * bsz)
            elif cusum == 0.0:
                run_start = None
            firing = cusum > cfg.drift_threshold and d > cfg.drift_floor
            end_step = int((key + 1) * bsz - 1)
            if firing and first_hit is None:
                first_hit = (run_start if run_start is not None else int(key * bsz), end_step, math.exp(d))
            # Still open while the excursion that fired has not returned to zero.
            latest = (first_hit is not None and cusum > 0.0 and d > cfg.drift_floor, math.exp(d), end_step)
    if first_hit is None:
        return []
    onset, detected, ratio = first_hit
    active, ratio_now, last_block_end = latest
    mag = ratio_now if active else ratio
    return [
        Finding(
            kind="grad_norm_drift",
            severity="ticket",
            run=series.run,
            subject_kind="run",
            subject="",
            onset_step=onset,
            last_step=last_block_end if active else detected,
            magnitude=mag,
            summary=(
                f"{what} drifting up: block median {mag:.2f}x its level "
                f"{(cfg.drift_gap_blocks + cfg.drift_ref_blocks // 2) * cfg.drift_block_steps} "
                "steps earlier, "
                f"since step {onset} ({note}; worrying with recurring spikes)"
            ),
            active=active,
            detected_step=detected,
        )
    ]


def detect_nonfinite(series: RunSeries, cfg: GradNormConfig) -> list[Finding]:
    """`grad_nonfinite` (page): never suppressed. A step whose update the optimizer skipped (a loss
    scaler's inf/NaN skip, routine with fp16) is not one on its own: skipped steps page only
    `skipped_run_steps` in a row, when the scaler has collapsed and nothing is learned."""
    s = series.steps
    # NaN alone means "not reported"; it counts when the job or a group norm says it was real.
    bad = np.isinf(s.grad_norm) | (np.nan_to_num(s.grad_nonfinite, nan=0) > 0) | _reported_nan(series)
    if not bad.any():
        return []
    skipped = s.skipped if s.skipped is not None else np.zeros(len(bad), dtype=bool)
    applied = bad & ~skipped
    collapsed = _in_runs_of(bad & skipped, cfg.skipped_run_steps)
    paged = applied | collapsed
    if not paged.any():
        return []
    at = s.steps[paged]
    first = int(at[0])
    subject_kind: SubjectKind = "run"
    subject = ""
    g = series.groups
    if g is not None and len(g.groups):
        row = np.searchsorted(g.steps, first)
        if row < len(g.steps) and g.steps[row] == first:
            cols = np.flatnonzero(~np.isfinite(g.norms[row]))
            if len(cols):
                subject_kind, subject = "layer", g.groups[int(cols[0])]
    where = f" first in {subject}" if subject else ""
    summary = f"non-finite gradients on {len(at)} steps since step {first}{where}"
    if not applied.any():
        summary = (
            f"the optimizer skipped {len(at)} steps on non-finite gradients since step {first}{where}, "
            f"{cfg.skipped_run_steps} or more in a row: the loss scale is collapsing and the run is not learning"
        )
    elif routine := int((bad & skipped & ~collapsed).sum()):
        summary += f" (and {routine} skipped by the loss scaler, not counted)"
    return [
        Finding(
            kind="grad_nonfinite",
            severity="page",
            run=series.run,
            subject_kind=subject_kind,
            subject=subject,
            onset_step=first,
            last_step=int(at[-1]),
            magnitude=float(len(at)),
            summary=summary,
            active=int(at[-1]) > int(s.steps[-1]) - cfg.nonfinite_hold_steps,
            detected_step=first,
        )
    ]


def _in_runs_of(mask: np.ndarray, length: int) -> np.ndarray:
    """The True entries of `mask` that belong to a run of at least `length` consecutive ones."""
    out = np.zeros(len(mask), dtype=bool)
    for a, b in runs_of_true(mask):
        if b - a >= length:
            out[a:b] = True
    return out


def _reported_nan(series: RunSeries) -> np.ndarray:
    """Steps where the group norms show the NaN was real (a group norm is non-finite)."""
    s = series.steps
    g = series.groups
    out = np.zeros(len(s.steps), dtype=bool)
    if g is None or len(g.groups) == 0:
        return out
    rows = np.searchsorted(g.steps, s.steps)
    ok = rows < len(g.steps)
    ok[ok] = g.steps[rows[ok]] == s.steps[ok]
    out[ok] = (~np.isfinite(g.norms[rows[ok]])).any(axis=1)
    return out


def detect_grad_norm(
    series: RunSeries, sup: Suppression, cfg: GradNormConfig, *, baseline: RunSeries | None = None
) -> list[Finding]:
    """All gradient-norm findings of one run. A baseline run changes only the drift test: spikes are
    judged against the run's own recent norm, which a baseline would not sharpen."""
    return (
        detect_nonfinite(series, cfg)
        + detect_spikes(series, sup, cfg)
        + detect_drift(series, sup, cfg, baseline=baseline)
    )
