"""Loss divergence: the loss rising above its own recent level (or above a named baseline run at
the same steps), sustained; and non-finite loss, paged at once.

Own baseline: the trailing short median of log loss against the median of an older window (a gap
back, so a slow rise is not absorbed). With a baseline run: the same test on the difference of log
losses at equal steps, whose usual offset is learnt from the run's own history, so warm-up and
end-of-training shapes shared by both runs cancel.

Finding kinds and magnitudes:

- `loss_divergence` (ticket, escalating to page): loss / reference level (ratio). A rise that
  recovers is a ticket that closes itself when the loss is back (single bumps of ~0.5 nats that
  decay within a few hundred steps are benign, BLOOM / OPT logbooks); it pages when the loss is
  still up `page_persist_steps` later, still climbing `page_rising_steps` later, or when a second
  excursion follows within `recur_steps` (`Finding.paged_step` says when).
- `loss_trend` (ticket, page when large): a slow climb against a fixed earlier reference (the
  lowest level the run reached), which the short-window test cannot see.
- `loss_nonfinite` (page): number of steps with a non-finite loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ._stats import log_positive, runs_of_true, segment_apply, trailing_median, trailing_median_scale
from .baseline import aligned_log
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
    """Consecutive steps the condition must hold: then a ticket (a bump that recovers is benign)."""
    page_persist_steps: int = 500
    """The ticket pages when the loss is still up this many steps after it fired: benign bumps
    (BLOOM, OPT logbooks: +0.5 nats) decay back within a few hundred steps."""
    page_rising_steps: int = 200
    """... or when, this many steps after it fired, the loss is above everything it reached before
    by `rise_floor` (a bump peaks early and decays; a divergence keeps climbing)."""
    recur_steps: int = 2_000
    """An excursion that fires within this many steps of the previous one's end recurs."""
    recur_min_episodes: int = 2
    """Excursions in a chain of recurrences that page (the first recurrence pages)."""
    nonfinite_hold_steps: int = 500
    """A non-finite loss stays active this many steps after the last one."""
    trend_block_steps: int = 250
    """Slow-climb test (`loss_trend`): works on the median log loss per block of this many steps."""
    trend_ref_blocks: int = 3
    """Blocks of the segment needed before the reference (the lowest block so far) is trusted."""
    trend_floor: float = math.log(1.03)
    """Minimum effect: the block median must exceed the lowest earlier block by 3% (a slow climb is
    caught while still small; the short-window test needs 5% within ~400 steps)."""
    trend_z: float = 8.0
    """And by this many standard errors of the two block medians."""
    trend_blocks: int = 8
    """Blocks of the Mann-Kendall test: the climb must be steady (a bump lifts one block)."""
    trend_mk_z: float = 2.5
    """Mann-Kendall z of the last `trend_blocks` block medians (8 strictly rising blocks give 3.3)."""
    trend_persist_blocks: int = 2
    """Consecutive blocks the condition must hold."""
    trend_page_ratio: float = 1.25
    """The trend ticket pages once the loss is this multiple of the reference."""

    def __post_init__(self) -> None:
        if self.short_steps < 1 or self.sustain_steps < 1 or self.rise_floor <= 0:
            raise ValueError("short_steps, sustain_steps must be >= 1 and rise_floor > 0")
        if min(self.page_persist_steps, self.page_rising_steps, self.recur_min_episodes) < 1:
            raise ValueError("page_persist_steps, page_rising_steps, recur_min_episodes must be >= 1")


def detect_divergence(
    series: RunSeries, sup: Suppression, cfg: LossConfig, *, baseline: RunSeries | None = None
) -> list[Finding]:
    """`loss_divergence` (page) against the run's own history or a baseline run."""
    s = series.steps
    if len(s.steps) == 0:
        return []
    y = log_positive(s.loss)
    against = "its own level"
    yb = aligned_log(series, baseline, "loss", min_steps=cfg.min_history)
    if yb is not None and baseline is not None:
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
    episodes = _episodes(cond, short, ref, excess, threshold, seg, cfg)
    if not episodes:
        return []
    chain = _report_chain(episodes, len(cond), cfg)
    first, last_ep = chain[0], chain[-1]
    paged = _paged_index(chain, cfg)
    active = last_ep.end == len(cond)
    last_idx = len(cond) - 1 if active else last_ep.end - 1
    # Open: the current level; resolved: the peak the excursion reached.
    level = short[last_idx] if active else np.nanmax(short[last_ep.fire : last_idx + 1])
    mag = math.exp(float(level - last_ep.frozen)) if np.isfinite(level) else math.nan
    onset = int(s.steps[first.onset])
    if paged is None:
        why = "ticket: closes when the loss is back"
    elif len(chain) > 1 and paged == last_ep.fire:
        why = f"paged: recurred ({len(chain)} episodes)"
    else:
        why = f"paged: not recovering by step {int(s.steps[paged])}"
    return [
        Finding(
            kind="loss_divergence",
            severity="ticket" if paged is None else "page",
            run=series.run,
            subject_kind="run",
            subject="",
            onset_step=onset,
            last_step=int(s.steps[last_idx]),
            magnitude=mag,
            summary=f"loss up {mag:.2f}x {against} since step {onset} ({why})",
            active=active,
            detected_step=int(s.steps[first.fire]),
            paged_step=None if paged is None else int(s.steps[paged]),
        )
    ]


@dataclass(kw_only=True, slots=True, frozen=True)
class _Episode:
    """One excursion of the smoothed loss above its reference (indices into the run's steps)."""

    onset: int
    fire: int
    """Where the rise had held `sustain_steps`: the ticket."""
    end: int
    """First index where the loss was back (exclusive end); len(steps) while still up."""
    frozen: float
    """Reference level at `fire`, kept for the whole episode."""
    persist_page: int | None
    """Index at which the episode had lasted `page_persist_steps`, or kept rising: the page."""


def _episodes(
    cond: np.ndarray,
    short: np.ndarray,
    ref: np.ndarray,
    excess: np.ndarray,
    threshold: np.ndarray,
    seg: np.ndarray,
    cfg: LossConfig,
) -> list[_Episode]:
    out: list[_Episode] = []
    n = len(cond)
    i = 0
    while i < n:
        first_fire: int | None = None
        run_len = 0
        for j in range(i, n):
            run_len = run_len + 1 if cond[j] else 0
            if run_len >= cfg.sustain_steps:
                first_fire = j
                break
        if first_fire is None:
            break
        # Onset: walk back over the contiguous stretch where the smoothed loss was already above
        # half the threshold, then back half a short window (the median lags the raw loss by that).
        k = first_fire
        while (
            k > i
            and np.isfinite(excess[k - 1])
            and excess[k - 1] > threshold[k - 1] / 2
            and seg[k - 1] == seg[k]
        ):
            k -= 1
        onset = max(k - cfg.short_steps // 2, int(np.searchsorted(seg, seg[k])), i)
        # Once fired, the reference is frozen at its value then: a loss that stays up is still up
        # (a rolling reference would absorb the new level and close the finding).
        frozen = float(ref[first_fire])
        up = short - frozen
        still = np.isfinite(short) & (up > threshold[first_fire] / 2)
        still[first_fire] = True
        back = np.flatnonzero(~still[first_fire:])
        end = first_fire + int(back[0]) if len(back) else n
        out.append(
            _Episode(
                onset=onset,
                fire=first_fire,
                end=end,
                frozen=frozen,
                persist_page=_persist_page(up, first_fire, end, cfg),
            )
        )
        i = end
    return out


def _persist_page(up: np.ndarray, fire: int, end: int, cfg: LossConfig) -> int | None:
    """Where an episode stops looking like a benign bump: still up `page_persist_steps` after it
    fired, or still rising `page_rising_steps` after it fired (a bump peaks early, then decays)."""
    if end - fire > cfg.page_persist_steps:
        persist = fire + cfg.page_persist_steps
    else:
        persist = None
    lag = cfg.page_rising_steps
    if end - fire > lag:
        seg_up = np.nan_to_num(up[fire:end], nan=-np.inf)
        peak_before = np.maximum.accumulate(seg_up)  # highest level up to each index
        rising = seg_up[lag:] > peak_before[: len(seg_up) - lag] + cfg.rise_floor
        hits = np.flatnonzero(rising)
        if len(hits) and (persist is None or fire + lag + int(hits[0]) < persist):
            return fire + lag + int(hits[0])
    return persist


def _chains(episodes: list[_Episode], cfg: LossConfig) -> list[list[_Episode]]:
    """Episodes grouped by recurrence: one that fires within `recur_steps` of the previous one's
    end (indices are steps apart in a dense series) continues its chain."""
    chains: list[list[_Episode]] = []
    for ep in episodes:
        if chains and ep.fire - chains[-1][-1].end <= cfg.recur_steps:
            chains[-1].append(ep)
        else:
            chains.append([ep])
    return chains


def _paged_index(chain: list[_Episode], cfg: LossConfig) -> int | None:
    """First index at which the chain paged: an episode not recovering, or a recurrence."""
    pages = [ep.persist_page for ep in chain if ep.persist_page is not None]
    if len(chain) >= cfg.recur_min_episodes:
        pages.append(chain[cfg.recur_min_episodes - 1].fire)
    return min(pages) if pages else None


def _report_chain(episodes: list[_Episode], n: int, cfg: LossConfig) -> list[_Episode]:
    """The chain the finding describes (one finding per run): the latest if the loss is up now or it
    paged, else the latest chain that paged (a post-mortem must see the page), else the latest."""
    chains = _chains(episodes, cfg)
    latest = chains[-1]
    if latest[-1].end == n or _paged_index(latest, cfg) is not None:
        return latest
    paged = [c for c in chains if _paged_index(c, cfg) is not None]
    return paged[-1] if paged else latest


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


def _mann_kendall_z(y: np.ndarray) -> float:
    """Mann-Kendall trend z of a short series (positive: rising)."""
    n = len(y)
    i, j = np.triu_indices(n, k=1)
    s_stat = float(np.sum(np.sign(y[j] - y[i])))
    var = n * (n - 1) * (2 * n + 5) / 18
    return (s_stat - math.copysign(1.0, s_stat)) / math.sqrt(var) if s_stat else 0.0


def detect_trend(series: RunSeries, sup: Suppression, cfg: LossConfig) -> list[Finding]:
    """`loss_trend`: a slow, steady climb against a fixed earlier reference, the lowest block median
    the segment reached. Each short window looks flat against the one just before it, so the
    divergence test cannot see a small per-step slope; this one compares with where the run was."""
    s = series.steps
    bsz = cfg.trend_block_steps
    if len(s.steps) < bsz * (cfg.trend_ref_blocks + cfg.trend_blocks):
        return []
    y = np.where(sup.suppressed(s.steps), np.nan, log_positive(s.loss))
    seg = sup.segment_ids(s.steps)
    block = s.steps // bsz
    starts = np.concatenate([[0], np.flatnonzero(np.diff(block)) + 1])
    ends = np.concatenate([starts[1:], [len(block)]])
    meds, ses, bsegs, last_idx = [], [], [], []
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        v = y[a:b]
        fin = v[np.isfinite(v)]
        complete = int(block[a] + 1) * bsz - 1 <= int(s.steps[-1])
        if not complete or len(fin) < bsz // 2 or seg[a] != seg[b - 1]:
            continue
        # Per-step noise from first differences (immune to the trend), then the median's error.
        d = np.diff(fin)
        sigma = 1.4826 * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2) if len(d) else 0.0
        meds.append(float(np.median(fin)))
        ses.append(1.2533 * sigma / math.sqrt(len(fin)))
        bsegs.append(int(seg[a]))
        last_idx.append(b - 1)
    med, se, bseg = np.array(meds), np.array(ses), np.array(bsegs)
    cond = np.zeros(len(med), dtype=bool)
    ref_at = np.full(len(med), -1)
    for k in range(len(med)):
        same = np.flatnonzero(bseg[:k] == bseg[k])
        if len(same) < cfg.trend_ref_blocks or k - same[0] < cfg.trend_blocks - 1:
            continue
        r = int(same[np.argmin(med[same])])
        ref_at[k] = r
        excess = med[k] - med[r]
        noise = cfg.trend_z * math.hypot(se[k], se[r])
        recent = med[k - cfg.trend_blocks + 1 : k + 1]
        cond[k] = excess > max(cfg.trend_floor, noise) and _mann_kendall_z(recent) >= cfg.trend_mk_z
    fired = None
    for a, b in runs_of_true(cond):
        if b - a >= cfg.trend_persist_blocks:
            fired = a + cfg.trend_persist_blocks - 1
            break
    if fired is None:
        return []
    r = int(ref_at[fired])
    ref = med[r]
    # Stays open while the loss is still above the (frozen) reference by the floor.
    later = np.arange(fired, len(med))
    up = (med[later] - ref > cfg.trend_floor) & (bseg[later] == bseg[fired])
    back = np.flatnonzero(~up)
    stop = int(later[back[0]] - 1) if len(back) else len(med) - 1
    active = not len(back)
    page = np.flatnonzero(med[fired : stop + 1] - ref >= math.log(cfg.trend_page_ratio))
    paged = int(s.steps[last_idx[fired + int(page[0])]]) if len(page) else None
    mag = math.exp(float(med[stop] - ref))
    onset = int(s.steps[last_idx[r]]) + 1  # the climb starts after the lowest block
    rise_now = (mag - 1) * 100
    return [
        Finding(
            kind="loss_trend",
            severity="page" if paged is not None else "ticket",
            run=series.run,
            subject_kind="run",
            subject="",
            onset_step=onset,
            last_step=int(s.steps[last_idx[stop]]),
            magnitude=mag,
            summary=(
                f"loss climbing steadily: {rise_now:.0f}% above its lowest level (block of "
                f"{bsz} steps ending {int(s.steps[last_idx[r]])}) since step {onset}"
                + (f"; paged at {cfg.trend_page_ratio:g}x" if paged is not None else "")
            ),
            active=active,
            detected_step=int(s.steps[last_idx[fired]]),
            paged_step=paged,
        )
    ]


def detect_loss(
    series: RunSeries, sup: Suppression, cfg: LossConfig, *, baseline: RunSeries | None = None
) -> list[Finding]:
    """All loss findings of one run."""
    return (
        detect_nonfinite_loss(series, cfg)
        + detect_divergence(series, sup, cfg, baseline=baseline)
        + detect_trend(series, sup, cfg)
    )
