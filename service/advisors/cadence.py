"""Checkpoint-cadence formulas and the advisor that combines them.

Symbols (checkpointing.md): delta = stall per checkpoint, P = async persist lag, M = job-level
mean time between interruptions, R = restart, D = detection, T = compute between checkpoints,
L = mean SDC detection latency, k = generations kept.

    >>> round(optimal_interval(stall_s=60, mtbf_s=4 * 3600))
    1275
    >>> [round(irrecoverable_probability(k, interval_s=1.0, latency_s=1.0), 3) for k in (1, 2, 3, 5)]
    [0.632, 0.233, 0.086, 0.012]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import brentq, minimize_scalar
from scipy.special import gamma, lambertw

from trainvitals.service.advisors.failure_log import (
    MIN_INCIDENTS,
    RADIUS_LEVELS,
    LogAnalysis,
    analyze_log,
    parse_event,
)

# Input ranges (docs/advisors.md): wide enough for any real job, narrow enough that every formula
# stays finite. Seconds: 1 ms to ~31.7 years; bytes: up to 1 EB.
MIN_SECONDS = 1e-3
MAX_SECONDS = 1e9
MAX_BYTES = 1e18
MAX_TIERS = 16
_MAX_TERMS = 2_000_000
"""Terms of a renewal sum kept (16 MB of floats): beyond them survival is negligible or the
model is past meaning (a fitted Weibull shape near 0)."""

# --- closed forms ------------------------------------------------------------------------------


def young_interval(*, stall_s: float, mtbf_s: float) -> float:
    """Young (1974): T = sqrt(2 delta M)."""
    return math.sqrt(2 * stall_s * mtbf_s)


def daly_first_order(*, stall_s: float, mtbf_s: float, restart_s: float) -> float:
    """Daly (2006) first order: T = sqrt(2 delta (M + R))."""
    return math.sqrt(2 * stall_s * (mtbf_s + restart_s))


def daly_higher_order(*, stall_s: float, mtbf_s: float) -> float:
    """Daly (2006) eq. 37, as in LLNL SCR scr_ckpt_interval.py; T = M when delta >= 2M."""
    if stall_s >= 2 * mtbf_s:
        return mtbf_s
    x = stall_s / (2 * mtbf_s)
    return math.sqrt(2 * stall_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - stall_s


def optimal_interval(*, stall_s: float, mtbf_s: float) -> float:
    """Exact minimiser of Daly's expected wall time, exponential failures: M [1 + W0(-e^-(delta/M+1))]."""
    w = lambertw(-math.exp(-(stall_s / mtbf_s + 1)), k=0).real
    return mtbf_s * (1 + w)


def first_order_waste(interval_s: float, *, stall_s: float, mtbf_s: float, downtime_s: float) -> float:
    """W ~ delta/T + (T/2 + D + R)/M (fraction of wall time)."""
    return stall_s / interval_s + (interval_s / 2 + downtime_s) / mtbf_s


def flat_basin_band(optimum_s: float, tolerance: float = 0.05) -> tuple[float, float]:
    """T where the variable waste stays within (1 + tolerance) of its minimum.

    The variable part grows by (x + 1/x)/2 with x = T/T*, so x = (1+e) -+ sqrt((1+e)^2 - 1);
    [0.73, 1.37] T* for e = 5%.
    """
    a = 1 + tolerance
    root = math.sqrt(a * a - 1)
    return optimum_s * (a - root), optimum_s * (a + root)


def variable_waste_ratio(interval_s: float, optimum_s: float) -> float:
    """How much the variable waste grows at T versus T*: (x + 1/x)/2 (1.25 for a 2x error)."""
    x = interval_s / optimum_s
    return (x + 1 / x) / 2


# --- exact expected waste for a renewal failure process ----------------------------------------


def weibull_scale(mtbf_s: float, shape: float) -> float:
    """Weibull scale eta with mean M: eta = M / Gamma(1 + 1/kappa)."""
    return mtbf_s / gamma(1 + 1 / shape)


def expected_waste(
    interval_s: float,
    *,
    stall_s: float,
    mtbf_s: float,
    downtime_s: float,
    persist_s: float = 0.0,
    shape: float = 1.0,
) -> float:
    """Expected fraction of wall time not kept as progress, for a fixed interval T.

    Failures form a renewal process (time between failures X, mean M, Weibull shape kappa; 1 =
    exponential); the job restarts D+R after each failure (a failure during restart starts it
    again) and keeps every segment whose checkpoint is durable (stall done, plus P if async):
        W(T) = 1 - T sum_k S(D + R + P + k (T + delta)) / M.
    For kappa = 1 this is Daly's exact model, so the Lambert-W optimum minimises it.
    """
    cycle = interval_s + stall_s
    offset = downtime_s + persist_s
    if shape == 1.0:
        # e^(-offset/M) / (e^(cycle/M) - 1), in logs: a stall many times M must not overflow.
        kept = math.exp(-offset / mtbf_s - _log_expm1(cycle / mtbf_s))
    else:
        eta = weibull_scale(mtbf_s, shape)
        horizon = offset + eta * 50.0 ** (1 / shape)  # S < e^-50 beyond this
        n = max(1, min(int(horizon / cycle) + 1, _MAX_TERMS))
        k = np.arange(1, n + 1, dtype=float)
        kept = float(np.exp(-(((offset + k * cycle) / eta) ** shape)).sum())
    return 1.0 - interval_s * kept / mtbf_s


def _log_expm1(x: float) -> float:
    """log(e^x - 1) for x > 0, without overflow for large x."""
    return x + math.log(-math.expm1(-x)) if x > 1 else math.log(math.expm1(x))


def optimal_interval_renewal(
    *, stall_s: float, mtbf_s: float, downtime_s: float, persist_s: float = 0.0, shape: float = 1.0
) -> float:
    """Numerical minimiser of `expected_waste` (used for Weibull failures, kappa != 1)."""
    guess = optimal_interval(stall_s=stall_s, mtbf_s=mtbf_s)
    res = minimize_scalar(
        lambda log_t: expected_waste(
            math.exp(log_t),
            stall_s=stall_s,
            mtbf_s=mtbf_s,
            downtime_s=downtime_s,
            persist_s=persist_s,
            shape=shape,
        ),
        bounds=(math.log(guess / 20), math.log(min(guess * 20, 50 * mtbf_s))),
        method="bounded",
        options={"xatol": 1e-4},
    )
    return float(math.exp(res.x))


def hazard_schedule(
    *, stall_s: float, mtbf_s: float, shape: float, segments: int = 8, steady_s: float
) -> tuple[float, ...]:
    """Local-hazard rule T(t) = sqrt(2 delta / h(t)) for the first segments after a restart.

    h(t) = (kappa/eta)(t/eta)^(kappa-1) is evaluated mid-segment; intervals are capped at the
    steady (fixed-interval optimum) value and floored at the stall.
    """
    eta = weibull_scale(mtbf_s, shape)
    out: list[float] = []
    t = 0.0
    for _ in range(segments):
        w = steady_s
        for _ in range(20):  # fixed point: the interval depends on the hazard at its own midpoint
            mid = t + w / 2
            hazard = (shape / eta) * (mid / eta) ** (shape - 1)
            w = min(steady_s, max(stall_s, math.sqrt(2 * stall_s / hazard)))
        out.append(w)
        t += w + stall_s
    return tuple(out)


def schedule_waste(
    schedule_s: Sequence[float],
    *,
    steady_s: float,
    stall_s: float,
    mtbf_s: float,
    downtime_s: float,
    persist_s: float = 0.0,
    shape: float = 1.0,
) -> float:
    """Expected waste of a schedule (given intervals after each restart, then `steady_s`)."""
    eta = weibull_scale(mtbf_s, shape)
    offset = downtime_s + persist_s
    horizon = offset + eta * 50.0 ** (1 / shape)
    # Bounded as in expected_waste: a fitted shape far below 1 puts the horizon light-years out
    # (one log: 46 GiB of terms, a MemoryError from /metrics' advice).
    n_tail = min(int(horizon / (steady_s + stall_s)) + 1, _MAX_TERMS)
    work = np.concatenate([np.asarray(schedule_s, dtype=float), np.full(n_tail, steady_s)])
    ends = np.cumsum(work + stall_s)
    kept = float((work * np.exp(-(((offset + ends) / eta) ** shape))).sum())
    return 1.0 - kept / mtbf_s


def _check_seconds(key: str, value: float, *, low: float) -> None:
    """ValueError naming the key unless low <= value <= MAX_SECONDS (a NaN fails too)."""
    if not low <= value <= MAX_SECONDS:
        raise ValueError(f"{key}: must be between {low:g} and {MAX_SECONDS:g} seconds, got {value!r}")


# --- retention ---------------------------------------------------------------------------------


def irrecoverable_probability(k: int, *, interval_s: float, latency_s: float) -> float:
    """P_irr(k) = (L/T) e^(-kT/L) (e^(T/L) - 1): an SDC caught after all k generations are bad."""
    r = interval_s / latency_s
    return math.exp(-k * r + _log_expm1(r) - math.log(r))


def _generations_for_risk(*, interval_s: float, latency_s: float, risk: float) -> int:
    """Smallest k >= 1 with P_irr(k) <= risk, in closed form (a loop would run for L/T steps):
    k >= (log((e^r - 1)/r) - log(risk)) / r with r = T/L."""
    r = interval_s / latency_s
    k = max(1, math.ceil((_log_expm1(r) - math.log(r) - math.log(risk)) / r - 1e-9))
    while k > 1 and irrecoverable_probability(k - 1, interval_s=interval_s, latency_s=latency_s) <= risk:
        k -= 1  # guard the rounding of the closed form
    return k


@dataclass(kw_only=True, slots=True, frozen=True)
class RetentionAdvice:
    """How many generations to keep and why."""

    keep: int
    """Generations to keep (never below 2: a save can be cut off mid-write)."""
    keep_for_risk: int
    """Smallest k with P_irr(k) <= acceptable risk (exponential latency)."""
    keep_deterministic: int
    """1 + ceil(L/T): enough if the latency were exactly L."""
    risk_at_keep: float
    """P_irr at the kept count."""
    storage_limit: int | None
    """Generations the storage budget allows."""
    keep_every: int
    """Keep every j-th checkpoint (1 = consecutive) so k_max generations span enough time."""
    promote_after_s: float | None
    """Age after which a generation may be marked validated: the (1 - risk) quantile of latency."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """What bound the answer."""


def advise_retention(
    *,
    interval_s: float,
    latency_s: float | None,
    acceptable_risk: float,
    checkpoint_bytes: float | None = None,
    storage_budget_bytes: float | None = None,
) -> RetentionAdvice:
    """Retention k from SDC detection latency, acceptable risk and storage budget."""
    if not 0 < acceptable_risk < 1:
        raise ValueError(f"acceptable_risk: must be in (0, 1), got {acceptable_risk!r}")
    limit = None
    if checkpoint_bytes and storage_budget_bytes:
        limit = int(storage_budget_bytes // checkpoint_bytes)
    if latency_s is not None and not latency_s > 0:
        raise ValueError(f"sdc_latency_s: must be > 0 (omit it when SDC is not a concern), got {latency_s!r}")
    if latency_s is None:
        keep = 2 if limit is None else max(1, min(2, limit))
        return RetentionAdvice(
            keep=keep,
            keep_for_risk=2,
            keep_deterministic=2,
            risk_at_keep=0.0,
            storage_limit=limit,
            keep_every=1,
            promote_after_s=None,
            notes=("no SDC latency given: keep 2 (a save can be cut off mid-write)",),
        )
    k_risk = _generations_for_risk(interval_s=interval_s, latency_s=latency_s, risk=acceptable_risk)
    k_det = 1 + math.ceil(latency_s / interval_s)
    keep = max(2, k_risk)
    notes: list[str] = []
    every = 1
    if limit is not None and keep > limit:
        notes.append(f"storage budget allows {limit} generations < {keep} needed")
        keep = max(1, limit)
        if limit >= 1:
            # Space the kept generations further apart: solve P_irr(limit, S) = risk for S.
            def f(spacing: float) -> float:
                return (
                    irrecoverable_probability(limit, interval_s=spacing, latency_s=latency_s)
                    - acceptable_risk
                )

            hi = interval_s
            while f(hi) > 0 and hi < 1e6 * latency_s:
                hi *= 2
            if f(hi) <= 0:
                spacing = brentq(f, interval_s, hi) if f(interval_s) > 0 else interval_s
                every = max(1, math.ceil(spacing / interval_s))
                notes.append(
                    f"keep 1 of every {every} checkpoints so {limit} generations span "
                    f"{every * interval_s * limit / 3600:.1f} h"
                )
    risk = irrecoverable_probability(keep, interval_s=interval_s * every, latency_s=latency_s)
    return RetentionAdvice(
        keep=keep,
        keep_for_risk=k_risk,
        keep_deterministic=k_det,
        risk_at_keep=risk,
        storage_limit=limit,
        keep_every=every,
        promote_after_s=latency_s * math.log(1 / acceptable_risk),
        notes=tuple(notes),
    )


# --- multi-tier --------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True, frozen=True)
class TierSpec:
    """One checkpoint tier, fastest first."""

    name: str
    """E.g. "peer_ram", "nvme", "pfs", "object_store"."""
    cost_s: float
    """Stall (or cost) of one save to this tier, seconds."""
    survives: str
    """Largest blast radius this tier's copy survives: one of RADIUS_LEVELS."""

    def __post_init__(self) -> None:
        if self.survives not in RADIUS_LEVELS:
            raise ValueError(
                f"tier {self.name}: survives must be one of {RADIUS_LEVELS}, got {self.survives!r}"
            )
        _check_seconds(f"tier {self.name}: cost_s", self.cost_s, low=MIN_SECONDS)


@dataclass(kw_only=True, slots=True, frozen=True)
class TierAdvice:
    """Interval for one tier."""

    name: str
    """Tier name."""
    interval_s: float
    """sqrt(2 C_i / lambda_i), never shorter than the faster tier's interval."""
    rate_per_hour: float
    """lambda_i: incidents that destroy every faster tier."""


def advise_tiers(tiers: Sequence[TierSpec], radius_rates_per_s: dict[str, float]) -> tuple[TierAdvice, ...]:
    """Per tier T_i = sqrt(2 C_i / lambda_i), lambda_i = rate of incidents wider than all faster tiers."""
    out: list[TierAdvice] = []
    protected = -1  # index into RADIUS_LEVELS of the widest radius a faster tier survives
    previous = 0.0
    for tier in tiers:
        rate = sum(r for radius, r in radius_rates_per_s.items() if RADIUS_LEVELS.index(radius) > protected)
        interval = math.inf if rate <= 0 else max(previous, math.sqrt(2 * tier.cost_s / rate))
        out.append(TierAdvice(name=tier.name, interval_s=interval, rate_per_hour=rate * 3600))
        previous = interval
        protected = max(protected, RADIUS_LEVELS.index(tier.survives))
    return tuple(out)


# --- the advisor -------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True, frozen=True)
class CadenceInputs:
    """What the cadence advisor needs; either mtbf_s or log must be given."""

    stall_s: float
    """Time training is blocked per checkpoint (delta; delta_b for async)."""
    persist_s: float = 0.0
    """Async lag until the checkpoint is durable (P); 0 for synchronous saves."""
    mtbf_s: float | None = None
    """Job-level mean time between interruptions; with a log, the prior used when the log has
    fewer than MIN_INCIDENTS incidents."""
    log: LogAnalysis | None = None
    """Analysed failure log (incidents, rate with bounds, Poisson tests)."""
    restart_s: float = 600.0
    """Restart/recovery time R (replaced by the log's median incident cost when known)."""
    detect_s: float = 60.0
    """Time to detect a failure D."""
    sdc_latency_s: float | None = None
    """Mean silent-data-corruption detection latency L."""
    acceptable_risk: float = 0.01
    """Acceptable probability that one SDC cannot be rolled back."""
    checkpoint_bytes: float | None = None
    """Size of one checkpoint generation."""
    storage_budget_bytes: float | None = None
    """Storage available for retained generations."""
    tiers: tuple[TierSpec, ...] = ()
    """Checkpoint tiers, fastest first."""
    radius_mix: dict[str, float] | None = None
    """Share of incidents per blast radius when there is no log (default: all "node"); normalised."""
    basin_tolerance: float = 0.05
    """Extra variable waste accepted in the flat-basin band."""

    def __post_init__(self) -> None:
        # Every value is checked here, so the CLI and the HTTP route refuse the same inputs with
        # the same one-line message (exit 2 / 422) instead of computing with inf or NaN.
        _check_seconds("stall_s", self.stall_s, low=MIN_SECONDS)
        for key in ("persist_s", "restart_s", "detect_s"):
            _check_seconds(key, getattr(self, key), low=0.0)
        if self.mtbf_s is None and self.log is None:
            raise ValueError("mtbf_s: give an MTBF or an event log")
        if self.mtbf_s is not None:
            _check_seconds("mtbf_s", self.mtbf_s, low=MIN_SECONDS)
        if self.sdc_latency_s is not None:
            _check_seconds("sdc_latency_s", self.sdc_latency_s, low=MIN_SECONDS)
        if not 0 < self.acceptable_risk < 1:
            raise ValueError(f"acceptable_risk: must be in (0, 1), got {self.acceptable_risk!r}")
        for key in ("checkpoint_bytes", "storage_budget_bytes"):
            value = getattr(self, key)
            if value is not None and not 0 < value <= MAX_BYTES:
                raise ValueError(f"{key}: must be > 0 and at most {MAX_BYTES:g}, got {value!r}")
        if not 0 < self.basin_tolerance <= 1:
            raise ValueError(f"basin_tolerance: must be in (0, 1], got {self.basin_tolerance!r}")
        if len(self.tiers) > MAX_TIERS:
            raise ValueError(f"tiers: at most {MAX_TIERS}, got {len(self.tiers)}")
        if self.radius_mix is not None:
            for radius, share in self.radius_mix.items():
                if radius not in RADIUS_LEVELS:
                    raise ValueError(f"radius_mix: unknown radius {radius!r} ({', '.join(RADIUS_LEVELS)})")
                if not 0 <= share <= 1e9:
                    raise ValueError(f"radius_mix.{radius}: must be a share >= 0, got {share!r}")
            if not sum(self.radius_mix.values()) > 0:
                raise ValueError("radius_mix: the shares add up to 0")


@dataclass(kw_only=True, slots=True, frozen=True)
class CadenceAdvice:
    """The advisor's answer; `as_dict()` is the JSON of `trainvitals advise --json`."""

    young_interval_s: float
    """sqrt(2 delta M)."""
    daly_first_order_s: float
    """sqrt(2 delta (M + R))."""
    daly_interval_s: float
    """Daly higher order (SCR)."""
    optimal_interval_s: float
    """Exact minimiser for exponential failures (Lambert W)."""
    recommended_interval_s: float
    """What to configure (the Weibull-renewal optimum when the Poisson assumption is rejected)."""
    band_s: tuple[float, float]
    """Flat-basin band around the recommendation."""
    confidence_band_s: tuple[float, float]
    """Recommendation at the rate's confidence bounds."""
    expected_waste: float
    """Expected fraction of wall time lost at the recommendation."""
    expected_waste_young: float
    """Expected waste at Young's interval, same model."""
    mtbf_s: float
    """M used (incident-level; current intensity when a trend is detected)."""
    downtime_s: float
    """D + R used per incident."""
    shape: float
    """Failure-time shape used (1 = exponential)."""
    incidents: int | None
    """Incidents of the log the failure rate rests on (None when M was given directly)."""
    retention: RetentionAdvice
    """Generations to keep."""
    tiers: tuple[TierAdvice, ...]
    """Per-tier intervals."""
    schedule_s: tuple[float, ...] | None
    """Hazard-adapted intervals after a restart (only when infant mortality is detected)."""
    schedule_gain: float | None
    """Expected waste saved by the schedule versus the fixed recommendation (fraction of wall time)."""
    high_density_interval_s: float | None
    """Interval for bursts at 3x the average rate (when counts are over-dispersed)."""
    assumptions: tuple[str, ...]
    """What the numbers assume."""
    warnings: tuple[str, ...]
    """Test rejections and what the advice did about them."""

    def as_dict(self) -> dict[str, Any]:
        r = self.retention
        return {
            "young_interval_s": self.young_interval_s,
            "daly_first_order_s": self.daly_first_order_s,
            "daly_interval_s": self.daly_interval_s,
            "optimal_interval_s": self.optimal_interval_s,
            "recommended_interval_s": self.recommended_interval_s,
            "band_s": list(self.band_s),
            "confidence_band_s": list(self.confidence_band_s),
            "expected_waste": self.expected_waste,
            "expected_waste_young": self.expected_waste_young,
            "mtbf_s": self.mtbf_s,
            "downtime_s": self.downtime_s,
            "shape": self.shape,
            "incidents": self.incidents,
            "retention": {
                "keep": r.keep,
                "keep_for_risk": r.keep_for_risk,
                "keep_deterministic": r.keep_deterministic,
                "risk_at_keep": r.risk_at_keep,
                "storage_limit": r.storage_limit,
                "keep_every": r.keep_every,
                "promote_after_s": r.promote_after_s,
                "notes": list(r.notes),
            },
            "tiers": [
                {"name": t.name, "interval_s": t.interval_s, "rate_per_hour": t.rate_per_hour}
                for t in self.tiers
            ],
            "schedule_s": list(self.schedule_s) if self.schedule_s else None,
            "schedule_gain": self.schedule_gain,
            "high_density_interval_s": self.high_density_interval_s,
            "assumptions": list(self.assumptions),
            "warnings": list(self.warnings),
        }


def _interval(stall: float, mtbf: float, downtime: float, persist: float, shape: float) -> float:
    if shape == 1.0:
        return optimal_interval(stall_s=stall, mtbf_s=mtbf)
    return optimal_interval_renewal(
        stall_s=stall, mtbf_s=mtbf, downtime_s=downtime, persist_s=persist, shape=shape
    )


@dataclass(kw_only=True, slots=True)
class _FailureModel:
    """What the advice assumes about interruptions: given as an MTBF, or fitted to a log and then
    adjusted by each Poisson test the log rejects (in the order trend, Weibull, dispersion)."""

    mtbf_s: float
    """M the interval is computed for (incident-level)."""
    rate_lo: float
    """Lower bound of the incident rate, per second (the confidence band's long end)."""
    rate_hi: float
    """Upper bound of the incident rate, per second."""
    restart_s: float
    """R per incident."""
    shape: float = 1.0
    """Failure-time shape (1 = exponential)."""
    high_density: bool = False
    """Counts are over-dispersed: also advise for bursts at 3x the rate."""
    assumptions: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _failure_model_from_mtbf(i: CadenceInputs) -> _FailureModel:
    assert i.mtbf_s is not None  # CadenceInputs checks: mtbf_s or a log
    return _FailureModel(
        mtbf_s=i.mtbf_s,
        rate_lo=1 / i.mtbf_s,
        rate_hi=1 / i.mtbf_s,
        restart_s=i.restart_s,
        assumptions=["M given directly (no confidence bounds without an event log)"],
    )


def _failure_model_from_log(log: LogAnalysis, i: CadenceInputs) -> _FailureModel:
    """M with its Garwood bounds from the log's incidents, R from its median downtime when logged;
    then each rejected test adjusts the model (or only warns), in a fixed order. A log of fewer
    than MIN_INCIDENTS counted incidents gives M from the prior or the rate's upper bound instead."""
    fm = _FailureModel(
        mtbf_s=1 / log.rate_per_s if log.rate_per_s > 0 else math.inf,
        rate_lo=log.rate_ci_per_s[0],
        rate_hi=log.rate_ci_per_s[1],
        restart_s=i.restart_s,
    )
    if log.median_downtime_s is not None:
        fm.restart_s = max(0.0, log.median_downtime_s - i.detect_s)
        fm.assumptions.append(
            f"R from the log's median incident downtime ({log.median_downtime_s:.0f} s incl. detection)"
        )
    if log.n_counted < MIN_INCIDENTS:
        _thin_log(fm, log, prior_s=i.mtbf_s)
        return fm
    opened = "" if log.exposure_given else " (the first opens the window: no exposure given)"
    fm.assumptions.append(
        f"M = {fm.mtbf_s / 3600:.2f} h from {log.n_counted} of {log.n_incidents} incidents{opened} "
        f"({log.n_events} raw events, cluster factor {log.cluster_factor:.2f}) over "
        f"{log.exposure_s / 3600:.0f} h"
    )
    trending = _use_current_intensity(fm, log)
    _use_weibull_renewal(fm, log, trending=trending)
    _widen_for_dispersion(fm, log)
    cv = log.tests.cv
    if cv is not None and cv.rejects:
        fm.warnings.append(f"inter-arrival CV {cv.estimate:.2f} > 1: failures cluster beyond incident merging")
    fm.rate_lo = max(fm.rate_lo, 1e-12)
    return fm


def _thin_log(fm: _FailureModel, log: LogAnalysis, *, prior_s: float | None) -> None:
    """Too few incidents for the log's own rate: M from the stated prior, else from the upper end
    of the rate's exact interval (zero failures in T still bound it: rate < 3.0 / T at 95%)."""
    seen = f"only {log.n_counted} incident(s) in {log.exposure_s / 3600:.3g} h (fewer than {MIN_INCIDENTS})"
    if prior_s is not None:
        fm.mtbf_s = prior_s
        fm.rate_lo, fm.rate_hi = min(fm.rate_lo, 1 / prior_s), max(fm.rate_hi, 1 / prior_s)
        fm.warnings.append(f"{seen}: using the stated prior M = {prior_s / 3600:.3g} h")
    elif not log.exposure_given:
        # A thin log's own span is chosen by its failures: no rate, not even a bound, comes of it.
        raise ValueError(
            f"events: only {log.n_counted} counted incident(s) (fewer than {MIN_INCIDENTS}) and no "
            "exposure: give the period the log covers (exposure) or an MTBF prior"
        )
    else:
        fm.mtbf_s = 1 / fm.rate_hi
        fm.warnings.append(
            f"{seen}: M = {fm.mtbf_s / 3600:.3g} h is the rate's upper confidence bound (a "
            "conservative, short interval); give an MTBF prior or a longer log"
        )
    if not log.exposure_given:
        fm.warnings.append(
            f"no exposure given: the window is the log's own span ({log.exposure_s:.0f} s); "
            "give the period the log covers"
        )
    fm.assumptions.append(f"M = {fm.mtbf_s / 3600:.3g} h; the log counted {log.n_counted} incident(s)")
    fm.rate_lo = max(fm.rate_lo, 1e-12)


def _use_current_intensity(fm: _FailureModel, log: LogAnalysis) -> bool:
    """When a trend rejects a constant rate, forecast with the intensity at the end of the window,
    not the window's average. True when it did."""
    trend = log.tests.trend
    if trend is None or not trend.rejects:
        return False
    scale = log.current_rate_per_s / log.rate_per_s
    fm.mtbf_s /= scale
    fm.rate_lo, fm.rate_hi = fm.rate_lo * scale, fm.rate_hi * scale
    fm.warnings.append(
        f"trend (Crow-AMSAA beta = {trend.estimate:.2f}) rejects a constant rate: "
        f"using the current intensity, M = {fm.mtbf_s / 3600:.2f} h"
    )
    return True


def _use_weibull_renewal(fm: _FailureModel, log: LogAnalysis, *, trending: bool) -> None:
    """When the Weibull shape rejects exponential gaps of a stationary process, switch to the
    Weibull renewal model with the fitted shape and mean."""
    weibull = log.tests.weibull
    if weibull is None or not weibull.rejects:
        return
    lo, hi = weibull.ci or (weibull.estimate,) * 2
    if trending or log.weibull_scale_s is None:
        # Gaps of a non-stationary process are not identically distributed: no renewal fit.
        fm.warnings.append(
            f"Weibull shape {weibull.estimate:.2f} (CI {lo:.2f}-{hi:.2f}) not "
            "used: the rate is not stationary"
        )
        return
    fm.shape = weibull.estimate
    # The truncation-corrected fit also gives the mean of the unmerged process, which the
    # renewal model needs (merging short gaps into incidents inflates n / exposure's M).
    fitted = log.weibull_scale_s * gamma(1 + 1 / fm.shape)
    fm.rate_lo, fm.rate_hi = fm.rate_lo * fm.mtbf_s / fitted, fm.rate_hi * fm.mtbf_s / fitted
    fm.mtbf_s = fitted
    fm.warnings.append(
        f"Weibull shape {fm.shape:.2f} (CI {lo:.2f}-{hi:.2f}) rejects exponential "
        "inter-arrivals: interval from the Weibull renewal model"
    )


def _widen_for_dispersion(fm: _FailureModel, log: LogAnalysis) -> None:
    """When daily counts are over-dispersed, widen the rate band by sqrt(var/mean) (quasi-Poisson)
    and ask for a high-density interval."""
    dispersion = log.tests.dispersion
    if dispersion is None or not dispersion.rejects:
        return
    fm.high_density = True
    phi = max(1.0, dispersion.estimate)
    centre = 1 / fm.mtbf_s
    fm.rate_lo = centre - (centre - fm.rate_lo) * math.sqrt(phi)
    fm.rate_hi = centre + (fm.rate_hi - centre) * math.sqrt(phi)
    fm.warnings.append(
        f"counts over-dispersed (var/mean = {phi:.2f}): confidence band widened "
        "(quasi-Poisson); shorten the interval during high-density periods"
    )


def _cost_assumptions(stall_s: float, persist_s: float) -> list[str]:
    notes = ["interruptions arrive as a renewal process; one incident = one interruption"]
    if persist_s > 0:
        notes.append(
            f"async saves: only the {stall_s:.0f} s stall enters the interval; the "
            f"{persist_s:.0f} s persist lag adds rework (a failure before it lands "
            "falls back one generation)"
        )
    return notes


def _restart_schedule(
    fm: _FailureModel, *, stall_s: float, persist_s: float, downtime_s: float, steady_s: float, steady_waste: float
) -> tuple[tuple[float, ...] | None, float | None]:
    """Under infant mortality (shape < 1), the hazard-adapted intervals after a restart and the
    waste they save versus the steady interval; (None, None) otherwise."""
    if not fm.shape < 1.0:
        return None, None
    schedule = hazard_schedule(stall_s=stall_s, mtbf_s=fm.mtbf_s, shape=fm.shape, steady_s=steady_s)
    gain = steady_waste - schedule_waste(
        schedule,
        steady_s=steady_s,
        stall_s=stall_s,
        mtbf_s=fm.mtbf_s,
        downtime_s=downtime_s,
        persist_s=persist_s,
        shape=fm.shape,
    )
    return schedule, gain


def _tier_advice(i: CadenceInputs, mtbf_s: float) -> tuple[TierAdvice, ...]:
    """Per-tier intervals, splitting the incident rate by blast radius: as the log counted it, else
    by radius_mix (default: every incident takes one node)."""
    if not i.tiers:
        return ()
    mix: Mapping[str, float]
    if i.log is not None and i.log.radius_counts:
        mix = {r: float(c) for r, c in i.log.radius_counts.items()}
    else:
        mix = i.radius_mix or {"node": 1.0}
    total = sum(mix.values())  # shares are normalised: counts, or a mix that need not add to 1
    return advise_tiers(i.tiers, {r: share / total / mtbf_s for r, share in mix.items()})


def advise_cadence(inputs: CadenceInputs) -> CadenceAdvice:
    """Checkpoint interval, bands, retention and tiers from costs and a failure rate or log.

    The failure model (M, its rate bounds, the shape) comes from mtbf_s or from the log; the
    interval minimises the expected waste under it (Lambert W when exponential, numerically for a
    Weibull renewal); retention, tiers and the restart schedule are then derived at that interval.
    """
    i = inputs
    fm = _failure_model_from_log(i.log, i) if i.log is not None else _failure_model_from_mtbf(i)
    stall, persist, mtbf, shape = i.stall_s, i.persist_s, fm.mtbf_s, fm.shape
    downtime = fm.restart_s + i.detect_s

    recommended = _interval(stall, mtbf, downtime, persist, shape)
    confidence = sorted(
        (
            _interval(stall, 1 / fm.rate_hi, downtime, persist, shape),
            _interval(stall, 1 / fm.rate_lo, downtime, persist, shape),
        )
    )
    young = young_interval(stall_s=stall, mtbf_s=mtbf)
    waste = expected_waste(
        recommended, stall_s=stall, mtbf_s=mtbf, downtime_s=downtime, persist_s=persist, shape=shape
    )
    schedule, gain = _restart_schedule(
        fm, stall_s=stall, persist_s=persist, downtime_s=downtime, steady_s=recommended, steady_waste=waste
    )
    return CadenceAdvice(
        young_interval_s=young,
        daly_first_order_s=daly_first_order(stall_s=stall, mtbf_s=mtbf, restart_s=fm.restart_s),
        daly_interval_s=daly_higher_order(stall_s=stall, mtbf_s=mtbf),
        optimal_interval_s=optimal_interval(stall_s=stall, mtbf_s=mtbf),
        recommended_interval_s=recommended,
        band_s=flat_basin_band(recommended, i.basin_tolerance),
        confidence_band_s=(confidence[0], confidence[1]),
        expected_waste=waste,
        expected_waste_young=expected_waste(
            young, stall_s=stall, mtbf_s=mtbf, downtime_s=downtime, persist_s=persist, shape=shape
        ),
        mtbf_s=mtbf,
        downtime_s=downtime,
        shape=shape,
        incidents=i.log.n_counted if i.log is not None else None,
        retention=advise_retention(
            interval_s=recommended,
            latency_s=i.sdc_latency_s,
            acceptable_risk=i.acceptable_risk,
            checkpoint_bytes=i.checkpoint_bytes,
            storage_budget_bytes=i.storage_budget_bytes,
        ),
        tiers=_tier_advice(i, mtbf),
        schedule_s=schedule,
        schedule_gain=gain,
        high_density_interval_s=(
            _interval(stall, mtbf / 3, downtime, persist, shape) if fm.high_density else None
        ),
        assumptions=tuple(fm.assumptions + _cost_assumptions(stall, persist)),
        warnings=tuple(fm.warnings),
    )


# --- from the collector's observed records -------------------------------------------------------

_OK_STATUSES = {"ok", "success", "succeeded", "completed", "complete", "done"}


def advise_from_records(
    checkpoints: Sequence[Mapping[str, Any]],
    failures: Sequence[Mapping[str, Any]],
    *,
    exposure_s: float | None = None,
    mtbf_s: float | None = None,
    restart_s: float = 600.0,
    detect_s: float = 60.0,
    sdc_latency_s: float | None = None,
    acceptable_risk: float = 0.01,
    storage_budget_bytes: float | None = None,
    tiers: Sequence[TierSpec] = (),
) -> CadenceAdvice:
    """Cadence advice from a run's observed checkpoint records and failure events.

    checkpoints: dicts with stall_s (or write_stall_s), optional persist_s, size_bytes and status
    ("ok"/"failed"); medians of successful saves are used. failures: event dicts as accepted by
    `failure_log.parse_event`. mtbf_s is used directly without failures, and as the prior for a
    log of fewer than MIN_INCIDENTS incidents; with neither failures nor mtbf_s, zero failures
    over exposure_s bound the rate.
    """
    ok = [c for c in checkpoints if str(c.get("status", "ok")).lower() in _OK_STATUSES]
    stalls = [float(c.get("stall_s", c.get("write_stall_s", 0.0)) or 0.0) for c in ok]
    stalls = [s for s in stalls if s > 0]
    if not stalls:
        raise ValueError("checkpoints: no successful checkpoint record with stall_s > 0")
    persists = [float(c["persist_s"]) for c in ok if c.get("persist_s") is not None]
    sizes = [float(c["size_bytes"]) for c in ok if c.get("size_bytes")]
    log = None
    if failures or (mtbf_s is None and exposure_s):
        # No failure in a known exposure still bounds the rate (see analyze_log).
        log = analyze_log([parse_event(f) for f in failures], exposure_s=exposure_s, restart_s=restart_s)
    elif mtbf_s is None:
        raise ValueError("failures: no failure events, no exposure and no mtbf_s given")
    advice = advise_cadence(
        CadenceInputs(
            stall_s=float(np.median(stalls)),
            persist_s=float(np.median(persists)) if persists else 0.0,
            mtbf_s=mtbf_s,
            log=log,
            restart_s=restart_s,
            detect_s=detect_s,
            sdc_latency_s=sdc_latency_s,
            acceptable_risk=acceptable_risk,
            checkpoint_bytes=float(np.median(sizes)) if sizes else None,
            storage_budget_bytes=storage_budget_bytes,
            tiers=tuple(tiers),
        )
    )
    failed = len(checkpoints) - len(ok)
    if failed:
        note = f"{failed} of {len(checkpoints)} saves failed: never keep fewer than 2 validated generations"
        advice = dataclasses.replace(advice, warnings=advice.warnings + (note,))
    return advice
