"""Straggler detectors: a slow rank among the ranks doing the same work, intermittent slowness, and a
whole pipeline stage being slower (stage imbalance, not a rank fault).

Cohort = ranks of the same pipeline stage. Per window of steps, each rank's median own time (step
less collective wait: compute plus data loading) is compared with its cohort: r = t / median(cohort),
robust z = (t - median) / (1.4826 MAD) with the MAD floored at 1% of the median (near-identical
ranks must not give infinite z). Own time is used rather than step time because in synchronous
training every rank's step lasts as long as the slowest one's: the slow rank (a slow GPU or a slow
data loader) shows high own time and low wait, the ranks waiting on it the reverse. Without a wait
the compute time is used (a slow loader then goes unseen); without a compute/wait split the step
time, and a single slow rank cannot be singled out. A stage with fewer than `min_cohort` (3) ranks
has no robust median to compare with: its ranks are not judged, nor is the stage in imbalance,
and the run says so (`stragglers_unjudged`) rather than skip them silently.

Finding kinds (subject: rank, or stage) and magnitudes:

- `straggler` (ticket; page once the rank cost the job >= 5% of its step time over the last 1,000
  steps, `Finding.paged_step`): r of the rank (e.g. 1.31). Onsets reach back into the warm-up.
- `straggler_intermittent` (same severity rule): fraction of the rank's steps that were slow.
- `stage_imbalance` (ticket): the stage's median time / median of the other stages.
- `stragglers_unjudged` (info): the number of ranks in stages too small to judge.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

from ._stats import MAD_TO_SIGMA, nanmedian, runs_of_true
from .findings import Finding, Severity, current_episode
from .series import RankSteps, RunSeries
from .suppression import Suppression


@dataclass(kw_only=True, slots=True, frozen=True)
class StragglerConfig:
    """Thresholds of the straggler detectors."""

    window_steps: int = 50
    """Steps per window; windows are judged once complete."""
    ratio: float = 1.10
    """A straggler's window median is at least this multiple of its cohort's."""
    z: float = 4.0
    """... and this many robust standard deviations above it."""
    mad_floor_frac: float = 0.01
    """Floor on the cohort's robust scale, as a fraction of its median."""
    persist_windows: int = 3
    """Consecutive flagged windows before a straggler is reported."""
    min_cohort: int = 3
    """Smaller cohorts have no meaningful median: their ranks are not judged (said as
    `stragglers_unjudged`, never with statistics made up for two ranks)."""
    tail_ratio: float = 1.3
    """A step is 'slow' for the intermittent test when it takes this multiple of the cohort median."""
    tail_windows: int = 6
    """Windows pooled by the intermittent test."""
    tail_min_frac: float = 0.05
    """Minimum fraction of slow steps (effect-size floor)."""
    tail_base_floor: float = 0.01
    """Floor on the cohort's own slow-step fraction used as the null rate."""
    tail_p: float = 1e-6
    """Binomial tail probability that flags a pooled window."""
    tail_persist_windows: int = 2
    """Consecutive flagged window ends before an intermittent straggler is reported."""
    stage_ratio: float = 1.08
    """A stage this much slower than the median of the other stages is imbalance. A whole stage
    10% slower matters (the pipeline runs at its slowest stage's pace); stage medians over 50 steps x
    all the stage's ranks are precise to well under 1%, so 1.08 leaves room for the few percent
    stages differ by on healthy runs (the scenarios draw them within 3%)."""
    page_slowdown: float = 0.05
    """A straggler pages once the time it costs the job over the last `page_window_steps` steps is
    at least this fraction of the job's step time (lost / (job time - lost)); below it, or when the
    slowness is sporadic (a few short stretches, as on a shared host), it is a ticket. 5% of a
    large job is material; 3% paged on OS-scheduling noise when ranks share cores."""
    page_window_steps: int = 1000
    """Trailing window over which the cost is summed: long enough that a burst of slow steps
    (a contention stretch of a few hundred steps) stays below the page line, short enough that a
    1.2x straggler pages within about 300 steps of its onset."""
    onset_lookback_steps: int = 9
    """Onsets are backdated (into the warm-up too) over the steps where the median of this many
    per-step ratios was still above `ratio`: detection waits for warm-up to end, evidence need not."""


def _work_time(rs: RankSteps) -> tuple[np.ndarray, str]:
    """Each rank's own time: its step less the time it waited on its peers in collectives, i.e.
    compute plus data loading (the agent's compute is step - data - wait). A rank held up by its
    data loader is as much a straggler as a slow GPU: its peers wait on it in the next collective."""
    if rs.compute_seconds.size and np.isfinite(rs.compute_seconds).mean() > 0.5:
        if rs.wait_seconds.size and np.isfinite(rs.wait_seconds).mean() > 0.5:
            # One [steps, ranks] array per cycle (78 MB at 16,384 ranks x 600 steps); NaN where a
            # rank's wait is unknown, as a missing compute was.
            return np.subtract(rs.step_seconds, rs.wait_seconds, dtype=float), "own (compute + data loading)"
        # The array itself, not a copy: nothing here writes into it, and the worker's is read-only.
        return np.asarray(rs.compute_seconds, dtype=float), "compute"
    return np.asarray(rs.step_seconds, dtype=float), "step"


def _window_medians(t: np.ndarray, rows_of: list[np.ndarray]) -> np.ndarray:
    """Each rank's median over each window's rows: [windows, ranks]."""
    return np.stack([nanmedian(t[r], axis=0) for r in rows_of])


def _cohort_medians(t: np.ndarray, cohorts: dict[int, np.ndarray]) -> np.ndarray:
    """Each step's median over each rank's cohort, per rank (NaN for ranks in no cohort)."""
    out = np.full_like(t, np.nan)
    for cols in cohorts.values():
        out[:, cols] = nanmedian(t[:, cols], axis=1)[:, None]
    return out


def _cohorts(rs: RankSteps, min_cohort: int) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for stage in np.unique(rs.pp_stage):
        cols = np.flatnonzero(rs.pp_stage == stage)
        if len(cols) >= min_cohort:
            out[int(stage)] = cols
    return out


def _rank_name(rs: RankSteps, col: int) -> str:
    node = f" on {rs.node[col]}" if col < len(rs.node) and rs.node[col] else ""
    return f"rank {int(rs.ranks[col])}{node}"


def _paged_row(
    rs: RankSteps, t: np.ndarray, cohort_med: np.ndarray, col: int, lo: int, hi: int, cfg: StragglerConfig
) -> int | None:
    """First row in [lo, hi) where the time this rank cost the job over the trailing
    `page_window_steps` rows reached `page_slowdown` of the job's time (None: never)."""
    lost = np.clip(np.nan_to_num(t[:, col] - cohort_med, nan=0.0), 0, None)
    job = np.nanmax(rs.step_seconds, axis=1)
    job = np.where(np.isfinite(job), job, 0.0)
    c_lost = np.concatenate([[0.0], np.cumsum(lost)])
    c_job = np.concatenate([[0.0], np.cumsum(job)])
    rows = np.arange(lo, hi)
    start = np.maximum(rows + 1 - cfg.page_window_steps, 0)
    lost_w = c_lost[rows + 1] - c_lost[start]
    denom = c_job[rows + 1] - c_job[start] - lost_w
    with np.errstate(divide="ignore", invalid="ignore"):
        slow = np.where(denom > 0, lost_w / denom, 0.0)
    hits = np.flatnonzero(slow >= cfg.page_slowdown)
    return int(rows[hits[0]]) if len(hits) else None


def _severity(paged_row: int | None) -> Severity:
    return "ticket" if paged_row is None else "page"


def _backdate(step_r: np.ndarray, first: int, cfg: StragglerConfig) -> int:
    """Walk the onset back while the median of the `onset_lookback_steps` ratios before it is still
    above `ratio` (warm-up steps included: the cohort comparison needs no baseline)."""
    k = cfg.onset_lookback_steps
    i = first
    # Near the run's start the lookback is what there is: a rank slow from step 0 reads "since 0".
    while i > 0 and np.nanmedian(step_r[max(0, i - k) : i]) > cfg.ratio:
        i -= 1
    return i


def _impact(
    rs: RankSteps, t: np.ndarray, cohort_med: np.ndarray, col: int, rows: np.ndarray
) -> tuple[float, float]:
    """(job slowdown fraction, GPU-hours lost) over `rows`: the job waits for its slowest rank, so
    each step loses what this rank took beyond its cohort's median."""
    lost = np.clip(np.nan_to_num(t[rows, col] - cohort_med[rows], nan=0.0), 0, None)
    job = np.nanmax(rs.step_seconds[rows], axis=1)
    job = np.where(np.isfinite(job), job, 0.0)
    denom = float(np.sum(job - lost))
    slowdown = float(lost.sum()) / denom if denom > 0 else 0.0
    return slowdown, float(lost.sum()) * len(rs.ranks) / 3600.0


def detect_stragglers(series: RunSeries, sup: Suppression, cfg: StragglerConfig) -> list[Finding]:
    """`straggler`, `straggler_intermittent` and `stage_imbalance` findings of one run."""
    rs = series.ranks
    if rs is None or len(rs.steps) < cfg.window_steps or len(rs.ranks) == 0:
        return []
    t_all, basis = _work_time(rs)
    suppressed = sup.suppressed(rs.steps)
    # Decisions wait for warm-up; onsets and cost use t_all. Past warm-up (nearly every cycle) the
    # two are the same, and so are their medians, computed once (sorts of 600 x 16,384 values).
    t = t_all
    if suppressed.any():
        t = t_all.copy()
        t[suppressed] = np.nan
    wait = np.asarray(rs.wait_seconds, dtype=float) if rs.wait_seconds.size else np.full_like(t, np.nan)
    w = cfg.window_steps
    n_win = len(rs.steps) // w
    rows_of = [np.arange(i * w, (i + 1) * w) for i in range(n_win)]
    win_med = _window_medians(t, rows_of)  # [n_win, R]
    win_wait = _window_medians(wait, rows_of)
    cohorts = _cohorts(rs, cfg.min_cohort)
    step_cohort_med = _cohort_medians(t, cohorts)
    all_cohort_med = step_cohort_med if t is t_all else _cohort_medians(t_all, cohorts)
    out: list[Finding] = []
    persistent: set[int] = set()
    last_step = int(rs.steps[-1])

    # The same window test on unsuppressed times, only to backdate onsets into the warm-up.
    win_all = win_med if t is t_all else _window_medians(t_all, rows_of)
    raw_flag = np.zeros_like(win_all, dtype=bool)
    for cols in cohorts.values():
        cm_all = nanmedian(win_all[:, cols], axis=1)
        mad_all = nanmedian(np.abs(win_all[:, cols] - cm_all[:, None]), axis=1)
        scale_all = np.maximum(MAD_TO_SIGMA * mad_all, cfg.mad_floor_frac * cm_all)
        r_all = win_all[:, cols] / cm_all[:, None]
        z_all = (win_all[:, cols] - cm_all[:, None]) / scale_all[:, None]
        raw_flag[:, cols] = (np.nan_to_num(r_all) > cfg.ratio) & (np.nan_to_num(z_all) > cfg.z)

    for stage, cols in cohorts.items():
        cm = nanmedian(win_med[:, cols], axis=1)
        mad = nanmedian(np.abs(win_med[:, cols] - cm[:, None]), axis=1)
        scale = np.maximum(MAD_TO_SIGMA * mad, cfg.mad_floor_frac * cm)
        wait_cm = nanmedian(win_wait[:, cols], axis=1)
        # The window test for the whole cohort at once (per rank in Python it was most of a
        # cycle's detectors at 16,384 ranks); only ranks it flags at all are looked at further.
        ratios = win_med[:, cols] / cm[:, None]
        flags = np.nan_to_num(ratios) > cfg.ratio
        flags &= np.nan_to_num((win_med[:, cols] - cm[:, None]) / scale[:, None]) > cfg.z
        # The slow rank waits least; a rank that waits more than its peers is a victim.
        flags &= ~(np.nan_to_num(win_wait[:, cols], nan=-np.inf) > np.nan_to_num(wait_cm, nan=np.inf)[:, None])
        for j in np.flatnonzero(flags.any(axis=0)):
            col, r, flag = cols[j], ratios[:, j], flags[:, j]
            episodes: list[Finding] = []
            for a, b in runs_of_true(flag):
                if b - a < cfg.persist_windows:
                    continue
                persistent.add(int(col))
                fired_w = a + cfg.persist_windows - 1
                rows = np.arange(a * w, b * w)
                step_r_all = t_all[:, col] / all_cohort_med[:, col]
                # Backdate over the earlier windows (warm-up included) where the rank was already
                # slow by the same test, then step by step into the window before them.
                a0 = a
                while a0 > 0 and raw_flag[a0 - 1, col]:
                    a0 -= 1
                # From the end of the earliest slow window, back while the steps before are slow
                # (a median over several steps: one noisy early step must not become the onset).
                first = _backdate(step_r_all, (a0 + 1) * w, cfg)
                active = b == n_win
                end = len(rs.steps) if active else b * w
                span = np.arange(first, end)
                slowdown, gpu_h = _impact(rs, t_all, all_cohort_med[:, col], int(col), span)
                detected_row = int(rows_of[fired_w][-1])
                paged = _paged_row(rs, t_all, all_cohort_med[:, col], int(col), detected_row, end, cfg)
                mag = float(r[b - 1])
                others = np.setdiff1d(np.arange(len(rs.ranks)), [col])
                vw = nanmedian(wait[np.ix_(rows, others)], axis=0)
                own_wait = float(np.nan_to_num(nanmedian(wait[rows, col], axis=0), nan=0.0))
                victims = int(np.sum(np.nan_to_num(vw) > 2 * own_wait + 0.01))
                onset = int(rs.steps[first])
                wait_note = f"; {victims} ranks wait on it" if victims else ""
                episodes.append(
                    Finding(
                        kind="straggler",
                        severity=_severity(paged),
                        run=series.run,
                        subject_kind="rank",
                        subject=str(int(rs.ranks[col])),
                        onset_step=onset,
                        last_step=int(rs.steps[span[-1]]),
                        magnitude=mag,
                        summary=(
                            f"{_rank_name(rs, int(col))} {basis} time {mag:.2f}x its pipeline stage {stage} "
                            f"since step {onset}{wait_note}; job ~{slowdown:.1%} slower, "
                            f"{gpu_h:.1f} GPU-hours lost{_page_note(rs, paged, cfg)}"
                        ),
                        active=active,
                        detected_step=int(rs.steps[detected_row]),
                        paged_step=None if paged is None else int(rs.steps[paged]),
                    )
                )
            out += current_episode(episodes)  # one finding per rank

    out += _intermittent(series, rs, t, t_all, step_cohort_med, all_cohort_med, cohorts, persistent, basis, cfg)
    out += _stage_imbalance(series, rs, win_med, cohorts, rows_of, last_step, cfg)
    out += _unjudged(series, rs, cohorts, cfg)
    return out


def _unjudged(series: RunSeries, rs: RankSteps, cohorts: dict[int, np.ndarray], cfg: StragglerConfig) -> list[Finding]:
    """`stragglers_unjudged` (info): the stages too small for a cohort, whose ranks the detectors
    above never compare, said once per run instead of silently. A one-rank job has no peers at all."""
    if len(rs.ranks) < 2:
        return []
    small = {int(st): int(np.sum(rs.pp_stage == st)) for st in np.unique(rs.pp_stage) if int(st) not in cohorts}
    if not small:
        return []
    named = [f"{n} rank{'s' if n > 1 else ''}" + ("" if st < 0 else f" in pipeline stage {st}")
             for st, n in list(small.items())[:4]]  # fmt: skip
    more = len(small) - len(named)
    where = ", ".join(named) + (f" and {sum(list(small.values())[4:])} in {more} more stages" if more else "")
    return [
        Finding(
            kind="stragglers_unjudged",
            severity="info",
            run=series.run,
            subject_kind="run",
            subject="",
            onset_step=int(rs.steps[0]),
            last_step=int(rs.steps[-1]),
            magnitude=float(sum(small.values())),
            summary=(
                f"not checked for stragglers: {where} (fewer than {cfg.min_cohort} ranks doing the same "
                "work have no robust median to compare a rank with)"
            ),
            active=True,
            detected_step=int(rs.steps[min(cfg.window_steps, len(rs.steps)) - 1]),
        )
    ]


def _page_note(rs: RankSteps, paged: int | None, cfg: StragglerConfig) -> str:
    if paged is None:
        return f" (ticket: costs the job < {cfg.page_slowdown:.0%} over {cfg.page_window_steps:,} steps)"
    return f" (paged at step {int(rs.steps[paged])}: >= {cfg.page_slowdown:.0%} over {cfg.page_window_steps:,} steps)"


def _intermittent(
    series: RunSeries,
    rs: RankSteps,
    t: np.ndarray,
    t_all: np.ndarray,
    step_cohort_med: np.ndarray,
    all_cohort_med: np.ndarray,
    cohorts: dict[int, np.ndarray],
    persistent: set[int],
    basis: str,
    cfg: StragglerConfig,
) -> list[Finding]:
    w = cfg.window_steps
    n_win = len(rs.steps) // w
    k = cfg.tail_windows
    if n_win < k:
        return []
    ratio = t / step_cohort_med
    valid = np.isfinite(ratio)
    slow = valid & (np.nan_to_num(ratio) > cfg.tail_ratio)
    n_slow = slow[: n_win * w].reshape(n_win, w, -1).sum(axis=1)  # [n_win, R]
    n_valid = valid[: n_win * w].reshape(n_win, w, -1).sum(axis=1)
    pooled_slow, pooled_valid = _sums_of_k(n_slow, k), _sums_of_k(n_valid, k)
    frac = pooled_slow / np.maximum(pooled_valid, 1)
    out: list[Finding] = []
    for stage, cols in cohorts.items():
        base = np.maximum(np.median(frac[:, cols], axis=1), cfg.tail_base_floor)
        tested = cols[~np.isin(cols, list(persistent))]
        # The binomial test for the cohort's ranks at once, as the window test above.
        p = stats.binom.sf(pooled_slow[:, tested] - 1, pooled_valid[:, tested], base[:, None])
        flags = (p < cfg.tail_p) & (frac[:, tested] >= cfg.tail_min_frac)
        for j in np.flatnonzero(flags.any(axis=0)):
            col, flag = tested[j], flags[:, j]
            episodes: list[Finding] = []
            for a, b in runs_of_true(flag):
                if b - a < cfg.tail_persist_windows:
                    continue
                fired_w = a + cfg.tail_persist_windows - 1 + (k - 1)  # pooled index -> window index
                # Onset: pooled window a covers windows a .. a+k-1; the first of them with more slow
                # steps than a stray hiccup, and its first slow step.
                busy = np.flatnonzero(n_slow[a : fired_w + 1, col] >= 2)
                first_win = a + (int(busy[0]) if len(busy) else 0)
                slow_rows = np.flatnonzero(slow[first_win * w : (fired_w + 1) * w, col]) + first_win * w
                first = int(slow_rows[0]) if len(slow_rows) else first_win * w
                active = b == len(flag)
                end = len(rs.steps) if active else (b + k - 1) * w
                span = np.arange(first, end)
                slowdown, gpu_h = _impact(rs, t_all, all_cohort_med[:, col], int(col), span)
                detected_row = (fired_w + 1) * w - 1
                paged = _paged_row(rs, t_all, all_cohort_med[:, col], int(col), detected_row, end, cfg)
                f = float(frac[b - 1, col])
                onset = int(rs.steps[first])
                episodes.append(
                    Finding(
                        kind="straggler_intermittent",
                        severity=_severity(paged),
                        run=series.run,
                        subject_kind="rank",
                        subject=str(int(rs.ranks[col])),
                        onset_step=onset,
                        last_step=int(rs.steps[end - 1]),
                        magnitude=f,
                        summary=(
                            f"{_rank_name(rs, int(col))} intermittently slow: {f:.0%} of its steps take "
                            f">{cfg.tail_ratio:g}x its pipeline stage {stage} "
                            f"(peers {base[b - 1]:.0%}) since "
                            f"step {onset}; job ~{slowdown:.1%} slower, {gpu_h:.1f} GPU-hours lost"
                            f"{_page_note(rs, paged, cfg)}"
                        ),
                        active=active,
                        detected_step=int(rs.steps[detected_row]),
                        paged_step=None if paged is None else int(rs.steps[paged]),
                    )
                )
            out += current_episode(episodes)  # one finding per rank
    return out


def _sums_of_k(counts: np.ndarray, k: int) -> np.ndarray:
    """Sums of k consecutive rows (windows) per column: row i sums rows i..i+k-1 (exact integers)."""
    c = np.concatenate([np.zeros((1, counts.shape[1]), dtype=counts.dtype), np.cumsum(counts, axis=0)])
    return c[k:] - c[:-k]


def _stage_imbalance(
    series: RunSeries,
    rs: RankSteps,
    win_med: np.ndarray,
    cohorts: dict[int, np.ndarray],
    rows_of: list[np.ndarray],
    last_step: int,
    cfg: StragglerConfig,
) -> list[Finding]:
    if len(cohorts) < 2:
        return []
    stages = sorted(cohorts)
    sm = np.stack([nanmedian(win_med[:, cohorts[s]], axis=1) for s in stages], axis=1)  # [n_win, S]
    out: list[Finding] = []
    for i, stage in enumerate(stages):
        others = nanmedian(np.delete(sm, i, axis=1), axis=1)
        ratio = sm[:, i] / others
        flag = np.nan_to_num(ratio) > cfg.stage_ratio
        episodes: list[Finding] = []
        for a, b in runs_of_true(flag):
            if b - a < cfg.persist_windows:
                continue
            fired_w = a + cfg.persist_windows - 1
            active = b == len(flag)
            mag = float(ratio[b - 1])
            span_rows = np.concatenate(rows_of[a:b])
            job = np.nanmax(rs.step_seconds[span_rows], axis=1)
            # The pipeline runs at its slowest stage's pace: balanced, this time would shrink by 1 - 1/r.
            gpu_h = float(np.nansum(job)) * (1 - 1 / mag) * len(rs.ranks) / 3600.0
            onset = int(rs.steps[rows_of[a][0]])
            episodes.append(
                Finding(
                    kind="stage_imbalance",
                    severity="ticket",
                    run=series.run,
                    subject_kind="stage",
                    subject=str(stage),
                    onset_step=onset,
                    last_step=int(rs.steps[span_rows[-1]]),
                    magnitude=mag,
                    summary=(
                        f"pipeline stage {stage} is {mag:.2f}x slower than the other stages "
                        f"since step {onset} "
                        f"(all {len(cohorts[stage])} ranks: partitioning or data, not one rank); "
                        f"~{gpu_h:.1f} GPU-hours lost"
                    ),
                    active=active,
                    detected_step=int(rs.steps[rows_of[fired_w][-1]]),
                )
            )
        out += current_episode(episodes)  # one finding per stage
    return out
