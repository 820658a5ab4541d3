"""Monte Carlo failure traces replayed against a checkpoint policy, to measure waste.

Three trace families (checkpointing.md; seed 004, section 7):
- Poisson: independent interruptions at a constant rate.
- Weibull renewal with shape < 1: infant mortality, each failure (node replaced) resets the hazard.
- Correlated bursts: domain incidents (a rack's nodes fail within seconds) at a Poisson rate, an
  aftershock in the same rack with some probability, plus independent single-node failures.

Traces are wall-clock failure times independent of the policy, so every interval is replayed on
the same trace (common random numbers). The job restarts `downtime_s` after a failure (a failure
during restart starts it again) and keeps each segment whose checkpoint is durable. All randomness
comes from a seeded numpy Generator passed in or built from `seed`.

    >>> trace = generate_trace(PoissonFamily(mtbf_s=3600.0), horizon_s=3600.0 * 500, seed=1)
    >>> waste = replay_waste(trace, intervals_s=[300.0, 3000.0], stall_s=30.0, downtime_s=300.0)
    >>> bool(waste[0] < waste[1])
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import gamma

from trainvitals.service.advisors.cadence import (
    CadenceInputs,
    advise_cadence,
    daly_higher_order,
    young_interval,
)
from trainvitals.service.advisors.failure_log import FailureEvent, Samples, analyze_log


@dataclass(kw_only=True, slots=True, frozen=True)
class PoissonFamily:
    """Exponential inter-arrivals."""

    mtbf_s: float
    """Mean time between interruptions."""


@dataclass(kw_only=True, slots=True, frozen=True)
class WeibullFamily:
    """Weibull renewal process (shape < 1: infant mortality after each replacement)."""

    mtbf_s: float
    """Mean time between failures."""
    shape: float
    """Weibull shape kappa."""


@dataclass(kw_only=True, slots=True, frozen=True)
class CorrelatedFamily:
    """Rack-level bursts plus independent node failures."""

    incident_mtbf_s: float
    """Mean time between rack incidents."""
    independent_mtbf_s: float
    """Mean time between independent single-node failures."""
    nodes_per_domain: int = 8
    """Nodes a rack incident takes down (raw events per burst)."""
    spread_s: float = 60.0
    """Raw events of one burst land within this many seconds."""
    aftershock_prob: float = 0.2
    """Probability of a second failure in the same rack later."""
    aftershock_window_s: float = 3600.0
    """The aftershock lands uniformly within this window after the burst."""
    racks: int = 16
    """Racks the job spans."""


TraceFamily = PoissonFamily | WeibullFamily | CorrelatedFamily


@dataclass(kw_only=True, slots=True, frozen=True)
class Trace:
    """Raw failure events of one simulated run."""

    family: str
    """poisson, weibull or correlated."""
    times_s: np.ndarray
    """Sorted raw failure times, seconds from 0."""
    nodes: tuple[str, ...]
    """Node of each event."""
    racks: tuple[str, ...]
    """Rack tag of each event."""
    horizon_s: float
    """Simulated wall-clock length."""


def _renewal_times(draw: np.ndarray, horizon_s: float) -> np.ndarray:
    times = np.cumsum(draw)
    return times[times < horizon_s]


def generate_trace(family: TraceFamily, *, horizon_s: float, seed: int) -> Trace:
    """Draw one trace of `family` over `horizon_s` seconds."""
    rng = np.random.default_rng(seed)
    if isinstance(family, PoissonFamily | WeibullFamily):
        n_draw = int(horizon_s / family.mtbf_s * 1.5 + 50)
        if isinstance(family, PoissonFamily):
            draw = rng.exponential(family.mtbf_s, n_draw)
            name = "poisson"
        else:
            scale = family.mtbf_s / gamma(1 + 1 / family.shape)
            draw = scale * rng.weibull(family.shape, n_draw)
            name = "weibull"
        times = _renewal_times(draw, horizon_s)
        nodes = tuple(f"n{int(i)}" for i in rng.integers(0, 128, len(times)))
        racks = tuple(f"r{int(n[1:]) // 8}" for n in nodes)
        return Trace(family=name, times_s=times, nodes=nodes, racks=racks, horizon_s=horizon_s)

    f = family
    n_inc = int(horizon_s / f.incident_mtbf_s * 1.5 + 50)
    incident_t = _renewal_times(rng.exponential(f.incident_mtbf_s, n_inc), horizon_s)
    rows: list[tuple[float, str, str]] = []
    for t in incident_t:
        rack = int(rng.integers(0, f.racks))
        offsets = rng.uniform(0, f.spread_s, f.nodes_per_domain)
        rows += [(t + o, f"n{rack * f.nodes_per_domain + j}", f"r{rack}") for j, o in enumerate(offsets)]
        if rng.random() < f.aftershock_prob:
            node = int(rng.integers(0, f.nodes_per_domain))
            rows.append(
                (
                    t + rng.uniform(0, f.aftershock_window_s),
                    f"n{rack * f.nodes_per_domain + node}",
                    f"r{rack}",
                )
            )
    n_ind = int(horizon_s / f.independent_mtbf_s * 1.5 + 50)
    for t in _renewal_times(rng.exponential(f.independent_mtbf_s, n_ind), horizon_s):
        node = int(rng.integers(0, f.racks * f.nodes_per_domain))
        rows.append((t, f"n{node}", f"r{node // f.nodes_per_domain}"))
    rows = sorted(r for r in rows if r[0] < horizon_s)
    return Trace(
        family="correlated",
        times_s=np.array([r[0] for r in rows]),
        nodes=tuple(r[1] for r in rows),
        racks=tuple(r[2] for r in rows),
        horizon_s=horizon_s,
    )


def trace_events(trace: Trace) -> tuple[FailureEvent, ...]:
    """The trace as a raw event log (what an operator would feed `trainvitals advise --events`)."""
    return tuple(
        FailureEvent(timestamp_s=float(t), nodes=(n,), domains=(("rack", r),))
        for t, n, r in zip(trace.times_s, trace.nodes, trace.racks, strict=True)
    )


def _uptimes(trace: Trace, downtime_s: float) -> tuple[np.ndarray, float]:
    # Uptime before failure i+1 is the gap after failure i minus the restart; a failure during the
    # restart (gap < downtime) restarts the clock, leaving zero uptime.
    t = trace.times_s
    if len(t) == 0:
        return np.zeros(0), trace.horizon_s
    first = t[:1]
    gaps = np.maximum(0.0, np.diff(t) - downtime_s)
    final = max(0.0, trace.horizon_s - t[-1] - downtime_s)
    ups = np.concatenate([first, gaps])
    return ups[ups > 0], final


def replay_waste(
    trace: Trace, *, intervals_s: Samples, stall_s: float, downtime_s: float, persist_s: float = 0.0
) -> np.ndarray:
    """Waste fraction (1 - kept progress / wall time) for each fixed interval on one trace."""
    ups, final = _uptimes(trace, downtime_s)
    out = np.empty(len(intervals_s))
    for i, interval in enumerate(intervals_s):
        cycle = interval + stall_s
        kept = interval * np.floor(np.maximum(0.0, ups - persist_s) / cycle).sum()
        # The run's end is a clean stop: all work done so far counts.
        kept += interval * math.floor(final / cycle) + min(final % cycle, interval)
        out[i] = 1.0 - kept / trace.horizon_s
    return out


@dataclass(kw_only=True, slots=True, frozen=True)
class FamilyResult:
    """Recommended versus simulated-optimal waste on one trace family."""

    family: str
    """Trace family."""
    recommended_s: float
    """Advisor's interval (fitted on a separate history trace)."""
    recommended_waste: float
    """Simulated waste at the recommendation."""
    optimum_s: float
    """Interval with the least simulated waste on the evaluation trace."""
    optimum_waste: float
    """That least waste."""
    young_s: float
    """Plain Young with M = exposure / raw events (every event counted, as LLNL SCR does)."""
    young_waste: float
    """Simulated waste at plain Young."""
    daly_s: float
    """Plain Daly higher order with the same raw M."""
    daly_waste: float
    """Simulated waste at plain Daly."""
    n_events: int
    """Raw events in the evaluation trace."""
    rejected: tuple[str, ...]
    """Poisson tests the history log rejected."""

    @property
    def recommended_excess(self) -> float:
        """recommended_waste / optimum_waste - 1."""
        return self.recommended_waste / self.optimum_waste - 1

    @property
    def young_excess(self) -> float:
        return self.young_waste / self.optimum_waste - 1

    @property
    def daly_excess(self) -> float:
        return self.daly_waste / self.optimum_waste - 1


def evaluate_family(
    family: TraceFamily,
    *,
    stall_s: float = 60.0,
    restart_s: float = 540.0,
    detect_s: float = 60.0,
    history_horizon_s: float,
    eval_horizon_s: float,
    seed: int = 0,
    grid_points: int = 241,
) -> FamilyResult:
    """Fit the advisor on a history trace, then replay a longer independent trace."""
    downtime = restart_s + detect_s
    history = generate_trace(family, horizon_s=history_horizon_s, seed=seed)
    analysis = analyze_log(trace_events(history), start_s=0.0, end_s=history_horizon_s)
    advice = advise_cadence(
        CadenceInputs(stall_s=stall_s, log=analysis, restart_s=restart_s, detect_s=detect_s)
    )
    raw_mtbf = history_horizon_s / max(1, len(history.times_s))
    young = young_interval(stall_s=stall_s, mtbf_s=raw_mtbf)
    daly = daly_higher_order(stall_s=stall_s, mtbf_s=raw_mtbf)

    trace = generate_trace(family, horizon_s=eval_horizon_s, seed=seed + 1)
    rec = advice.recommended_interval_s
    grid = np.geomspace(min(rec, young) / 4, max(rec, young) * 4, grid_points)
    grid_waste = replay_waste(trace, intervals_s=grid, stall_s=stall_s, downtime_s=downtime)
    best = int(np.argmin(grid_waste))
    rec_w, young_w, daly_w = replay_waste(
        trace, intervals_s=[rec, young, daly], stall_s=stall_s, downtime_s=downtime
    )
    return FamilyResult(
        family=history.family,
        recommended_s=rec,
        recommended_waste=float(rec_w),
        optimum_s=float(grid[best]),
        optimum_waste=float(grid_waste[best]),
        young_s=young,
        young_waste=float(young_w),
        daly_s=daly,
        daly_waste=float(daly_w),
        n_events=len(trace.times_s),
        rejected=analysis.tests.rejected,
    )


def standard_families(mtbf_s: float = 4 * 3600.0) -> tuple[TraceFamily, ...]:
    """The three families the tests and the report use, all with a job-level M of about `mtbf_s`."""
    return (
        PoissonFamily(mtbf_s=mtbf_s),
        WeibullFamily(mtbf_s=mtbf_s, shape=0.6),
        CorrelatedFamily(incident_mtbf_s=1.5 * mtbf_s, independent_mtbf_s=3 * mtbf_s),
    )
