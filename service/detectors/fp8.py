"""FP8 numerics detectors, per monitored tensor (module fqn + role).

Definitions follow docs/reference fp8.md (Transformer Engine / torchao conventions):
headroom H = log2(fp8_max / (amax * s)) (H < 0: the largest values clip), lag_bits =
log2(amax_t / A_{t-1}) (how far the current amax outran the scale's history).

Finding kinds (subject: tensor 'fqn:role') and magnitudes:

- `fp8_clipping` (page): H < -0.09 bit (more than E4M3's rounding) with a measured saturation
  > 1e-5 on one step of an E4M3 tensor (measured only on the agent's expensive steps, every 200 by
  default: the measurement is the evidence), or H < 0 with saturation > 1e-5 or H < -1 bit on
  >= 3 of 100 steps. Magnitude: worst headroom in bits (negative).
- `fp8_jump` (ticket): one jump of >= 2.5 bits (an ~6x amax step), or a rising rate of > 1 bit jumps.
  Magnitude: largest lag in bits.
- `fp8_headroom_trend` (ticket; page when zero headroom is forecast within 2,000 steps at a
  confident trend): block-minimum headroom falling, forecast to reach the clipping level (-1 bit)
  within the horizon. Magnitude: forecast steps until then.
- `fp8_saturation_rate` (ticket): saturated steps scattered thinly (never three within 100, so not
  clipping) in far more 100-step blocks of the last 3,000 steps than the tensor's own history
  predicts (Poisson). Magnitude: fraction of blocks with saturation in the window.
- `fp8_stale_scale` (ticket): headroom > 3 bits above its own level for >= 100 steps (after a spike
  a 'max' history holds the scale low). Magnitude: excess bits.
- `fp8_underflow_rise` (ticket): underflow fraction > 2x its own level, sustained. Magnitude: ratio.
- `fp8_precision_crest` (ticket): an E4M3 tensor's crest (log2 of amax over the median |x|,
  measured on expensive steps) above 12 bits, sustained: scaled so that amax fits, its median value
  sits within 3 bits of E4M3's subnormals (they start 14.8 bits below the largest value), so
  typical values keep few significant bits. E5M2 (gradients) has 15 bits more range below: not
  judged. Magnitude: worst crest in bits.
- `fp8_nonfinite` (page): any inf/NaN element (E5M2 overflows to inf, it does not saturate):
  counted on expensive steps, or a non-finite amax on any step. Magnitude: non-finite elements at
  the worst counted step (0 when only amax showed it).
- `fp8_resume_bad_step` (ticket): the first step after a resume clips or is > 3 bits above the
  pre-resume headroom (a stale amax history, TE PR #567). Magnitude: headroom bits at that step.

A shadow tensor (`TensorRecord.shadow`: what delayed scaling would see in a bf16/fp32 run) gives
only `info` findings, each saying the run does not train in FP8: a what-if for someone deciding to
enable FP8, never a ticket or a page, and (info being neither) never the onset a rollback target is
chosen before (store/queries.rollback_target, checkpoints.detect_no_rollback_target).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

from ._stats import fmt_int, nanmedian, runs_of_true, trailing_count, trailing_median
from .findings import Finding, Severity
from .series import TensorSeries
from .suppression import Suppression


@dataclass(kw_only=True, slots=True, frozen=True)
class Fp8Config:
    """Thresholds of the FP8 detectors (bits are log2 units)."""

    clip_sat_frac: float = 1e-5
    """Saturated fraction that makes H < 0 a real clip (TE overflows%); below it only the top few values."""
    clip_sat_bits: float = -0.09
    """One step with a measured saturation pages only below this headroom: the largest value clipped
    by more than E4M3's own rounding (half an ulp, 2^-4 relative: log2(1 + 1/16) = 0.087 bits).
    Delayed scaling under a slowly growing amax (weights) clips by a hair on most steps (fp8.md:
    about -0.03 bits), and one element of a small tensor is already above clip_sat_frac."""
    clip_hard_bits: float = -1.0
    """Headroom below this clips whether or not the saturation fraction was measured that step."""
    clip_window_steps: int = 100
    """Window of the clip count."""
    clip_min_steps: int = 3
    """Clipped steps within the window that page (one clipped step is a jump, not a regime), unless
    one of them measured a saturated fraction above clip_sat_frac: that alone pages."""
    jump_bits: float = 1.0
    """lag_bits above this is a jump (amax doubled against the history)."""
    jump_big_bits: float = 2.5
    """A single jump this large (~6x) opens a ticket on its own."""
    jump_window_steps: int = 1000
    """Window of the jump rate."""
    jump_min: int = 3
    """Jumps in the window (and more than in the window before) that open a ticket."""
    trend_block_steps: int = 100
    """Trend works on the minimum headroom per block."""
    trend_blocks: int = 20
    """Blocks in the least-squares fit."""
    trend_z: float = 3.0
    """Mann-Kendall z of the (falling) block minima required; block minima are noisy and correlated."""
    trend_persist: int = 3
    """Consecutive block evaluations that must agree."""
    trend_ref_blocks: int = 10
    """Blocks before the fit window whose lowest minimum the trend must break (a new low)."""
    trend_new_low_bits: float = 0.2
    """... by at least this much."""
    trend_min_bits_per_10k: float = 0.5
    """Ignore slopes flatter than this (reference: 0.5 bit per 10k steps)."""
    trend_horizon_steps: int = 20_000
    """Ticket when the forecast reaches the clipping level within this many steps."""
    trend_page_horizon_steps: int = 2_000
    """The trend pages when the forecast reaches zero headroom (the largest values start to clip)
    within this many steps: time to act (raise the margin, lower the LR, roll back) before it does."""
    trend_page_z: float = 4.0
    """... at a confident trend: Mann-Kendall z below minus this (20 falling blocks give 6.1)."""
    sat_block_steps: int = 100
    """Sporadic-saturation test (`fp8_saturation_rate`): counts blocks of this many steps holding at
    least one saturated step (same definition as clipping), so a burst of clips counts once."""
    sat_window_blocks: int = 30
    """Window of the rate: 3,000 steps, long enough that dozens of scattered saturated steps add up."""
    sat_min_blocks: int = 8
    """Never report fewer saturated blocks than this in the window."""
    sat_p: float = 1e-6
    """Poisson P(N >= k) under the tensor's own saturated-block rate (its history before the window)
    below which the rate is abnormal."""
    sat_prior_blocks: float = 1.0
    """Pseudo-count of the reference rate (with sat_prior_span_blocks): one saturated block per 50 a
    priori, so a short history asks for more evidence; a clean long history lowers the rate."""
    sat_prior_span_blocks: float = 50.0
    """See sat_prior_blocks."""
    sat_min_history_blocks: int = 30
    """Blocks of the tensor's own history needed before the window (a rate is only abnormal
    against a history; a tensor that saturates like this from the start is its own normal)."""
    sat_persist_blocks: int = 2
    """Consecutive block ends at which the test must hold."""
    stale_bits: float = 3.0
    """Headroom this far above its own level is a stale (too small) scale."""
    stale_steps: int = 100
    """... for this many consecutive steps."""
    baseline_steps: int = 500
    """Trailing window of the tensor's own headroom and underflow level."""
    underflow_ratio: float = 2.0
    """Underflow above this multiple of its own level."""
    underflow_floor: float = 5e-4
    """... and above this absolute fraction."""
    underflow_sustain_steps: int = 100
    """... sustained this many steps."""
    crest_bits: float = 12.0
    """E4M3 crest above which the median value nears the subnormals (fp8.md: warning precision)."""
    crest_sustain_steps: int = 100
    """... sustained this many steps (the 5-sample median of the measured crest above it)."""
    resume_bits: float = 3.0
    """First step after a resume more than this above the pre-resume headroom: stale history."""
    resume_lookahead_steps: int = 10
    """How far after the resume step the first tensor step may be."""
    nonfinite_hold_steps: int = 500
    """A non-finite finding stays active this many steps after the last one."""


def subject_of(ts: TensorSeries) -> str:
    return f"{ts.tensor}:{ts.role}"


def _finding(
    ts: TensorSeries,
    run: str,
    *,
    kind: str,
    severity: Severity,
    onset: int,
    last: int,
    magnitude: float,
    summary: str,
    active: bool,
    detected: int,
    paged: int | None = None,
) -> Finding:
    if ts.shadow:
        # Nothing of this happened to the run's numerics: it computes the tensor in bf16/fp32.
        severity, paged = "info", None
        if kind == "fp8_nonfinite":  # the high-precision values themselves: a fact, not a what-if
            summary += " (this run does not train in FP8: these are its own bf16/fp32 values)"
        else:
            summary = f"this run does not train in FP8; if FP8 (delayed scaling) were enabled here: {summary}"
    return Finding(
        kind=kind,
        severity=severity,
        run=run,
        subject_kind="tensor",
        subject=subject_of(ts),
        onset_step=onset,
        last_step=last,
        magnitude=magnitude,
        summary=summary,
        active=active,
        detected_step=detected,
        paged_step=paged,
    )


def detect_clipping(ts: TensorSeries, run: str, quiet: np.ndarray, cfg: Fp8Config) -> list[Finding]:
    h = ts.headroom_bits
    clip = _saturated(ts, quiet, cfg)
    if not clip.any():
        return []
    at = ts.steps[clip]
    window = _clip_window(ts, cfg)
    counts = trailing_count(at, at, window)
    # A measured saturated fraction exists only on the agent's expensive steps (every 200 by
    # default), so it can never be seen on 3 steps within 100: on an E4M3 tensor one such step is
    # the evidence (fp8.md). E5M2 does not saturate, it overflows to inf: fp8_nonfinite pages that.
    measured = (np.nan_to_num(ts.sat_frac, nan=0.0) > cfg.clip_sat_frac) & (ts.headroom_bits < cfg.clip_sat_bits)
    measured = measured[clip] & (ts.format == "e4m3")
    hits = np.flatnonzero((counts >= cfg.clip_min_steps) | measured)
    if len(hits) == 0:
        return []
    fired = int(at[hits[0]])
    onset = int(at[np.searchsorted(at, fired - window, side="right")])
    since = clip & (ts.steps >= onset)
    worst = float(np.min(h[since]))
    last = int(ts.steps[-1])
    n = int(since.sum())
    return [
        _finding(
            ts,
            run,
            kind="fp8_clipping",
            severity="page",
            onset=onset,
            last=int(at[-1]),
            magnitude=worst,
            summary=(
                f"FP8 clipping on {subject_of(ts)} ({ts.format}): {n} clipped steps since step {onset}, "
                f"worst headroom {worst:.1f} bits"
            ),
            active=int(at[-1]) > last - window,
            detected=fired,
        )
    ]


def _clip_window(ts: TensorSeries, cfg: Fp8Config) -> int:
    """clip_window_steps, or wide enough for clip_min_steps + 2 samples of a sparsely sampled shadow
    tensor: at the default every 20 steps the rule is 3 clipped of 5 samples, and an agent that
    samples every 40 or 80 steps where a sample is dear (agent/_fp8_cadence.py) keeps it (with
    100 steps, 80 apart, no tensor could ever collect 3)."""
    if len(ts.steps) < 2:
        return cfg.clip_window_steps
    spacing = int(np.median(np.diff(ts.steps[-32:])))
    return max(cfg.clip_window_steps, spacing * (cfg.clip_min_steps + 2))


def detect_jumps(ts: TensorSeries, run: str, quiet: np.ndarray, cfg: Fp8Config) -> list[Finding]:
    lag = ts.lag_bits
    jump = np.isfinite(lag) & (lag > cfg.jump_bits) & ~quiet
    if not jump.any():
        return []
    at = ts.steps[jump]
    sizes = lag[jump]
    w = cfg.jump_window_steps
    now_n = trailing_count(at, at, w)
    before_n = trailing_count(at - w, at, w)
    fires = (sizes >= cfg.jump_big_bits) | ((now_n >= cfg.jump_min) & (now_n > before_n))
    hits = np.flatnonzero(fires)
    if len(hits) == 0:
        return []
    i = int(hits[0])
    fired = int(at[i])
    onset = fired if sizes[i] >= cfg.jump_big_bits else int(at[np.searchsorted(at, fired - w, side="right")])
    recent = at > int(ts.steps[-1]) - w
    biggest = float(sizes[at >= onset].max())
    return [
        _finding(
            ts,
            run,
            kind="fp8_jump",
            severity="ticket",
            onset=onset,
            last=int(at[-1]),
            magnitude=biggest,
            summary=(
                f"FP8 amax jumps on {subject_of(ts)}: {int((at >= onset).sum())} jumps > "
                f"{cfg.jump_bits:g} bit "
                f"since step {onset}, largest {biggest:.1f} bits ({2**biggest:.0f}x)"
            ),
            active=bool(recent.any()),
            detected=fired,
        )
    ]


def _block_minima(
    ts: TensorSeries, quiet: np.ndarray, seg: np.ndarray, cfg: Fp8Config
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block index, minimum headroom, segment) per complete block with enough samples."""
    h = np.where(quiet, np.nan, ts.headroom_bits).astype(float)
    bsz = cfg.trend_block_steps
    block = ts.steps // bsz
    starts = np.concatenate([[0], np.flatnonzero(np.diff(block)) + 1])
    keys = block[starts]
    sizes = np.diff(np.concatenate([starts, [len(block)]]))
    finite = np.add.reduceat(np.isfinite(h).astype(np.int64), starts)
    mins = np.fmin.reduceat(h, starts)  # fmin ignores NaN
    seg_lo, seg_hi = seg[starts], seg[np.concatenate([starts[1:], [len(seg)]]) - 1]
    complete = (keys + 1) * bsz - 1 <= int(ts.steps[-1])
    ok = complete & (finite >= np.maximum(sizes // 2, 1)) & (seg_lo == seg_hi)
    return keys[ok].astype(np.int64), mins[ok], seg_lo[ok].astype(np.int64)


def _sliding_fits(
    keys: np.ndarray, mins: np.ndarray, segs: np.ndarray, cfg: Fp8Config
) -> tuple[np.ndarray, ...]:
    """Robust trend through the block minima of the last `trend_blocks` blocks (same segment), at
    every block: (count, Theil-Sen slope per step, Mann-Kendall z, fitted value at the block's end,
    first block of the window). Theil-Sen and Mann-Kendall use pairwise orderings, so one block made
    low by a burst cannot fake a trend the way it drags a least-squares line."""
    span = cfg.trend_blocks
    bsz = cfg.trend_block_steps
    lo_key = int(keys.min())
    dense_len = int(keys.max()) - lo_key + 1
    y = np.full(dense_len + span - 1, np.nan)
    sg = np.full(dense_len + span - 1, -1, dtype=np.int64)
    y[keys - lo_key + span - 1] = mins
    sg[keys - lo_key + span - 1] = segs
    yw = np.lib.stride_tricks.sliding_window_view(y, span)[keys - lo_key]
    sw = np.lib.stride_tricks.sliding_window_view(sg, span)[keys - lo_key]
    use = np.isfinite(yw) & (sw == segs[:, None])
    yw = np.where(use, yw, np.nan)
    i, j = np.triu_indices(span, k=1)
    dy = yw[:, j] - yw[:, i]  # NaN where either block is missing
    slope = nanmedian(dy / ((j - i) * bsz)[None, :], axis=1)
    n = use.sum(axis=1).astype(float)
    s_stat = np.nansum(np.sign(dy), axis=1)
    var = n * (n - 1) * (2 * n + 5) / 18
    mk_z = (s_stat - np.sign(s_stat)) / np.sqrt(np.maximum(var, 1e-12))
    x = (np.arange(span, dtype=float) - (span - 1)) * bsz  # steps back; 0 = the current block
    intercept = nanmedian(yw - slope[:, None] * x[None, :], axis=1)
    fitted_end = intercept + slope * 0.5 * bsz
    first = np.argmax(use, axis=1)
    return n, slope, mk_z, fitted_end, keys - (span - 1) + first


def _reference_lows(
    keys: np.ndarray, mins: np.ndarray, segs: np.ndarray, first_key: np.ndarray, ref: int
) -> np.ndarray:
    """Per block j: the lowest minimum of the blocks in [first_key[j] - ref, first_key[j]) of j's
    segment, NaN where fewer than ref // 2 of them are present. Windows over the blocks laid out
    densely, for every block at once (a loop over 384 tensors x every block cost ~0.3 s a cycle)."""
    lo = int(first_key.min()) - ref  # the layout starts at the lowest window's first block
    size = int(keys.max()) - lo + 1
    y = np.full(size, np.inf)
    sg = np.full(size, 0, dtype=np.int64)
    present = np.zeros(size, dtype=bool)
    at = keys - lo
    y[at], sg[at], present[at] = mins, segs, True
    start = first_key - ref - lo
    windows = np.lib.stride_tricks.sliding_window_view
    ours = windows(present, ref)[start] & (windows(sg, ref)[start] == segs[:, None])
    low = np.where(ours, windows(y, ref)[start], np.inf).min(axis=1)
    return np.where(ours.sum(axis=1) >= ref // 2, low, np.nan)


def detect_headroom_trend(
    ts: TensorSeries, run: str, quiet: np.ndarray, seg: np.ndarray, cfg: Fp8Config
) -> list[Finding]:
    if len(ts.steps) == 0:
        return []
    keys, mins, segs = _block_minima(ts, quiet, seg, cfg)
    if len(keys) == 0:
        return []
    bsz = cfg.trend_block_steps
    n, slope, mk_z, fitted_end, first_key = _sliding_fits(keys, mins, segs, cfg)
    # The level must be a new low for this tensor: below every block minimum of the reference
    # blocks before the fit window (headroom settling back after warm-up is not a trend).
    ref_low = _reference_lows(keys, mins, segs, first_key, cfg.trend_ref_blocks)
    with np.errstate(divide="ignore", invalid="ignore"):
        to_floor = np.where(slope < 0, np.maximum(fitted_end - cfg.clip_hard_bits, 0.0) / -slope, np.inf)
        cond = (
            (n >= cfg.trend_blocks // 2 + 1)
            & (mk_z < -cfg.trend_z)
            & (-slope * 1e4 >= cfg.trend_min_bits_per_10k)
            & (to_floor <= cfg.trend_horizon_steps)
            & (fitted_end < ref_low - cfg.trend_new_low_bits)
        )
        to_zero = np.where(slope < 0, np.maximum(fitted_end, 0.0) / -slope, np.inf)
    fired_idx = None
    for a, b in runs_of_true(cond):
        if b - a >= cfg.trend_persist:
            fired_idx, first_cond = a + cfg.trend_persist - 1, a
            break
    if fired_idx is None:
        return []
    end_step = (keys + 1) * bsz - 1
    active = bool(cond[-1])
    k = len(keys) - 1 if active else fired_idx
    # Page once the confirmed trend forecasts zero headroom within the short horizon.
    imminent = cond & (to_zero <= cfg.trend_page_horizon_steps) & (mk_z < -cfg.trend_page_z)
    imminent[:fired_idx] = False
    page_at = np.flatnonzero(imminent[: k + 1])
    paged = int(end_step[page_at[0]]) if len(page_at) else None
    # Onset: the first block in the window that broke clearly below the tensor's earlier range.
    window = (keys >= first_key[first_cond]) & (keys <= keys[first_cond])
    window &= mins < ref_low[first_cond] - cfg.trend_new_low_bits
    onset = int(keys[np.argmax(window)] * bsz) if window.any() else int(first_key[first_cond] * bsz)
    return [
        _finding(
            ts,
            run,
            kind="fp8_headroom_trend",
            severity="ticket" if paged is None else "page",
            onset=onset,
            last=int(end_step[k]),
            magnitude=float(to_floor[k]),
            summary=(
                f"FP8 headroom of {subject_of(ts)} falling {-slope[k] * 1e3:.2f} bits per 1k steps "
                f"since ~step "
                f"{onset}, now {fitted_end[k]:.1f} bits; reaches 0 in ~{fmt_int(min(to_zero[k], 1e9))} steps, "
                f"{cfg.clip_hard_bits:g} bit (clipping) in ~{fmt_int(to_floor[k])} steps"
                + (f"; paged at step {paged}" if paged is not None else "")
            ),
            active=active,
            detected=int(end_step[fired_idx]),
            paged=paged,
        )
    ]


def _saturated(ts: TensorSeries, quiet: np.ndarray, cfg: Fp8Config) -> np.ndarray:
    """Steps whose largest values saturated: H < 0 with a measured saturated fraction above the
    floor, or H below the hard limit (saturation unmeasured on cheap-tier steps)."""
    h = ts.headroom_bits
    sat = np.nan_to_num(ts.sat_frac, nan=0.0)
    return np.isfinite(h) & (((h < 0) & (sat > cfg.clip_sat_frac)) | (h < cfg.clip_hard_bits)) & ~quiet


def detect_saturation_rate(
    ts: TensorSeries, run: str, quiet: np.ndarray, seg: np.ndarray, cfg: Fp8Config
) -> list[Finding]:
    """`fp8_saturation_rate` (ticket): saturated steps scattered thinly (never 3 within 100 steps, so
    never clipping) but far more often than in the tensor's own history: saturation has become
    routine. Judged on blocks with at least one saturated step over a 3,000-step window."""
    sat_step = _saturated(ts, quiet, cfg)
    if sat_step.sum() < cfg.sat_min_blocks:
        return []
    bsz = cfg.sat_block_steps
    block = ts.steps // bsz
    starts = np.concatenate([[0], np.flatnonzero(np.diff(block)) + 1])
    keys = block[starts]
    hit = np.add.reduceat(sat_step.astype(np.int64), starts) > 0
    usable = np.add.reduceat((~quiet).astype(np.int64), starts) >= np.diff(np.append(starts, len(block))) // 2
    complete = (keys + 1) * bsz - 1 <= int(ts.steps[-1])
    ok = complete & usable & (seg[starts] == seg[np.append(starts[1:], len(seg)) - 1])
    keys, hit, bseg = keys[ok], hit[ok], seg[starts][ok]
    if len(keys) <= cfg.sat_window_blocks:
        return []
    w = cfg.sat_window_blocks
    c_hit = np.concatenate([[0], np.cumsum(hit)])
    idx = np.arange(len(keys))
    lo = np.maximum(idx - w + 1, 0)
    n_win = c_hit[idx + 1] - c_hit[lo]
    # Reference: the same segment's blocks before the window.
    seg_start = np.searchsorted(bseg, bseg, side="left")  # bseg is non-decreasing
    ref_lo = seg_start
    ref_hi = np.maximum(lo, seg_start)
    n_ref = c_hit[ref_hi] - c_hit[ref_lo]
    span_ref = ref_hi - ref_lo
    rate = (n_ref + cfg.sat_prior_blocks) / (span_ref + cfg.sat_prior_span_blocks)
    lam = rate * (idx + 1 - np.maximum(lo, seg_start))
    p = stats.poisson.sf(n_win - 1, lam)
    cond = (n_win >= cfg.sat_min_blocks) & (p < cfg.sat_p) & (span_ref >= cfg.sat_min_history_blocks)
    for a, b in runs_of_true(cond):
        if b - a < cfg.sat_persist_blocks:
            continue
        fired = a + cfg.sat_persist_blocks - 1
        active = b == len(cond)
        k = len(cond) - 1 if active else b - 1
        first_block = int(keys[lo[fired] + int(np.argmax(hit[lo[fired] : fired + 1]))])
        onset = int(ts.steps[np.searchsorted(ts.steps, first_block * bsz)])
        onset = int(ts.steps[np.argmax(sat_step & (ts.steps >= onset))])
        end_step = int(keys[k] + 1) * bsz - 1
        n_steps = int((sat_step & (ts.steps >= onset) & (ts.steps <= end_step)).sum())
        return [
            _finding(
                ts,
                run,
                kind="fp8_saturation_rate",
                severity="ticket",
                onset=onset,
                last=end_step,
                magnitude=float(n_win[k]) / w,
                summary=(
                    f"FP8 saturation on {subject_of(ts)} ({ts.format}) has become routine: {n_steps} "
                    f"saturated steps since step {onset}, in {int(n_win[k])} of the last {w} blocks of "
                    f"{bsz} steps (its own history: {rate[k] * w:.1f})"
                ),
                active=active,
                detected=int(keys[fired] + 1) * bsz - 1,
            )
        ]
    return []


def detect_stale_scale(ts: TensorSeries, run: str, quiet: np.ndarray, cfg: Fp8Config) -> list[Finding]:
    h = ts.headroom_bits
    usable = h[np.isfinite(h) & ~quiet]
    if len(usable) == 0 or usable.max() - usable.min() <= cfg.stale_bits:
        return []  # exact shortcut: a median of these values is never below their minimum
    # The reference ends stale_steps back so a stale stretch never becomes its own baseline.
    shifted = np.concatenate([np.full(cfg.stale_steps, np.nan), np.where(quiet, np.nan, h)])[: len(h)]
    ref = trailing_median(
        shifted,
        cfg.baseline_steps,
        min_count=cfg.baseline_steps // 4,
        stride=max(cfg.baseline_steps // 20, 1),
    )
    excess = h - ref
    cond = np.isfinite(excess) & (excess > cfg.stale_bits) & ~quiet
    for a, b in runs_of_true(cond):
        if b - a >= cfg.stale_steps:
            fired = a + cfg.stale_steps - 1
            worst = float(np.max(excess[a:b]))
            return [
                _finding(
                    ts,
                    run,
                    kind="fp8_stale_scale",
                    severity="ticket",
                    onset=int(ts.steps[a]),
                    last=int(ts.steps[b - 1]),
                    magnitude=worst,
                    summary=(
                        f"FP8 scale of {subject_of(ts)} stale: headroom {worst:.1f} bits above its level for "
                        f"{b - a} steps since step {ts.steps[a]} (small values flush to zero)"
                    ),
                    active=b == len(cond),
                    detected=int(ts.steps[fired]),
                )
            ]
    return []


def _first_raw_above(raw: np.ndarray, a: int, line: float) -> int:
    """The onset of an episode whose 5-sample median first crossed `line` at index `a`: the median
    lags the raw values by up to 4 samples, so the first of raw[a-4 .. a] above the line (else a)."""
    lo = max(a - 4, 0)
    above = np.flatnonzero(raw[lo : a + 1] > line)
    return lo + int(above[0]) if len(above) else a


def detect_underflow_rise(ts: TensorSeries, run: str, quiet: np.ndarray, cfg: Fp8Config) -> list[Finding]:
    measured = np.isfinite(ts.underflow_frac) & ~quiet
    if measured.sum() < 10:
        return []
    steps = ts.steps[measured]
    u = ts.underflow_frac[measured]
    short = trailing_median(u, 5, min_count=3, include_current=True)
    shifted = np.concatenate([np.full(5, np.nan), u])[: len(u)]
    ref = trailing_median(shifted, 50, min_count=10)
    ratio = short / np.maximum(ref, 1e-12)
    cond = np.isfinite(ratio) & (ratio > cfg.underflow_ratio) & (short > cfg.underflow_floor)
    for a, b in runs_of_true(cond):
        span = steps[a:b] - steps[a]
        ok = np.flatnonzero(span >= cfg.underflow_sustain_steps)
        if len(ok):
            fired = a + int(ok[0])
            worst = float(np.max(ratio[a:b]))
            first = _first_raw_above(u, a, cfg.underflow_ratio * ref[a])
            return [
                _finding(
                    ts,
                    run,
                    kind="fp8_underflow_rise",
                    severity="ticket",
                    onset=int(steps[first]),
                    last=int(steps[b - 1]),
                    magnitude=worst,
                    summary=(
                        f"FP8 underflow on {subject_of(ts)} up {worst:.1f}x its level since step {steps[a]} "
                        f"(now {short[b - 1]:.1e} of elements)"
                    ),
                    active=b == len(cond),
                    detected=int(steps[fired]),
                )
            ]
    return []


def detect_precision_crest(ts: TensorSeries, run: str, quiet: np.ndarray, cfg: Fp8Config) -> list[Finding]:
    """The newest sustained episode of an E4M3 tensor's crest above `cfg.crest_bits`. The level is
    absolute (fp8.md), not the tensor's own: E4M3's range is the same for every tensor."""
    if ts.crest_bits is None or ts.format != "e4m3":
        return []
    measured = np.isfinite(ts.crest_bits) & ~quiet
    if measured.sum() < 3:
        return []
    steps = ts.steps[measured]
    crest = ts.crest_bits[measured]
    # A 5-sample median: one outlier batch's crest is not a tensor whose values live near the floor.
    short = trailing_median(crest, 5, min_count=3, include_current=True)
    cond = np.isfinite(short) & (short > cfg.crest_bits)
    for a, b in reversed(runs_of_true(cond)):
        ok = np.flatnonzero(steps[a:b] - steps[a] >= cfg.crest_sustain_steps)
        if not len(ok):
            continue
        worst = float(np.max(crest[a:b]))
        first = _first_raw_above(crest, a, cfg.crest_bits)
        return [
            _finding(
                ts,
                run,
                kind="fp8_precision_crest",
                severity="ticket",
                onset=int(steps[first]),
                last=int(steps[b - 1]),
                magnitude=worst,
                summary=(
                    f"FP8 precision of {subject_of(ts)} ({ts.format}): its median value is {worst:.1f} bits below "
                    f"its amax since step {steps[first]} (crest above {cfg.crest_bits:g} bits; E4M3's subnormals "
                    "start 14.8 bits down), so most values keep few significant bits"
                ),
                active=b == len(cond),
                detected=int(steps[a + int(ok[0])]),
            )
        ]
    return []


def detect_nonfinite(ts: TensorSeries, run: str, cfg: Fp8Config) -> list[Finding]:
    """Non-finite elements counted on the agent's expensive steps, or a non-finite amax on any step
    (a recipe tensor reports its amax every step, and max |x| is NaN or inf exactly when some
    element is; it arrives as a JSON NaN/Infinity and is stored as such, never as NULL)."""
    nf = np.nan_to_num(ts.nonfinite, nan=0.0)
    bad = (nf > 0) | ~np.isfinite(ts.amax)
    if not bad.any():
        return []
    at = ts.steps[bad]
    return [
        _finding(
            ts,
            run,
            kind="fp8_nonfinite",
            severity="page",
            onset=int(at[0]),
            last=int(at[-1]),
            magnitude=float(nf.max()),  # 0 when only the amax said so: no count that step
            summary=(
                f"non-finite values in {subject_of(ts)} ({ts.format}) on {len(at)} steps since step {at[0]}"
                + (" (E5M2 overflow gives inf)" if ts.format == "e5m2" else "")
            ),
            active=int(at[-1]) > int(ts.steps[-1]) - cfg.nonfinite_hold_steps,
            detected=int(at[0]),
        )
    ]


def detect_resume_step(ts: TensorSeries, run: str, sup: Suppression, cfg: Fp8Config) -> list[Finding]:
    h = ts.headroom_bits
    for r in reversed(sup.resumes):  # the newest resume is the one that matters now
        i = int(np.searchsorted(ts.steps, r))
        if i >= len(ts.steps) or ts.steps[i] >= r + cfg.resume_lookahead_steps or not np.isfinite(h[i]):
            continue
        before = h[(ts.steps < r) & (ts.steps >= r - cfg.baseline_steps)]
        before = before[np.isfinite(before)]
        ref = float(np.median(before)) if len(before) else 0.0
        clipped = h[i] < cfg.clip_hard_bits
        flushed = h[i] > ref + cfg.resume_bits
        if not (clipped or flushed):
            continue
        what = "clipped" if clipped else f"{h[i] - ref:.1f} bits above the pre-resume level (values flushed)"
        return [
            _finding(
                ts,
                run,
                kind="fp8_resume_bad_step",
                severity="ticket",
                onset=int(ts.steps[i]),
                last=int(ts.steps[i]),
                magnitude=float(h[i]),
                summary=(
                    f"first FP8 step of {subject_of(ts)} after the resume at step {r} {what}: headroom "
                    f"{h[i]:.1f} bits (stale amax history restored?)"
                ),
                active=True,
                detected=int(ts.steps[i]),
            )
        ]
    return []


def detect_fp8(tensors: list[TensorSeries], run: str, sup: Suppression, cfg: Fp8Config) -> list[Finding]:
    """All FP8 findings of one run."""
    out: list[Finding] = []
    for ts in tensors:
        if len(ts.steps) == 0:
            continue
        quiet = sup.suppressed(ts.steps)
        seg = sup.segment_ids(ts.steps)
        # Baselines also wait until the amax history no longer holds warm-up values.
        settling = quiet | (ts.steps < sup.start_step + (ts.history_len or 0))
        out += detect_nonfinite(ts, run, cfg)
        out += detect_clipping(ts, run, quiet, cfg)
        out += detect_jumps(ts, run, quiet, cfg)
        out += detect_headroom_trend(ts, run, settling, seg, cfg)
        out += detect_saturation_rate(ts, run, settling, seg, cfg)
        out += detect_stale_scale(ts, run, settling, cfg)
        out += detect_underflow_rise(ts, run, settling, cfg)
        out += detect_precision_crest(ts, run, quiet, cfg)
        out += detect_resume_step(ts, run, sup, cfg)
    return out
