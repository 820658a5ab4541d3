"""Failure event logs: load, merge into incidents, estimate the rate, test the Poisson assumption.

Event fields (CSV columns or JSON keys): timestamp (epoch seconds or ISO 8601), ranks, nodes,
domains (failure-domain tags such as rack=r12;switch=s3, or a JSON object), cause, restart_start,
restart_end. List fields in CSV are separated by ';'. Only the loaders do I/O.

    >>> events = [parse_event({"timestamp": t, "nodes": [n], "domains": {"rack": "r1"}})
    ...           for t, n in ((0, "a"), (20, "b"), (90_000, "c"))]
    >>> analysis = analyze_log(events, exposure_s=10 * 86400)
    >>> (analysis.n_events, analysis.n_incidents, analysis.incidents[0].blast_radius)
    (3, 2, 'rack')
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy.optimize import brentq, minimize
from scipy.stats import binom, chi2, norm

Samples = Sequence[float] | npt.NDArray[np.float64]
"""Times or gaps in seconds: a list, or the numpy array `analyze_log` takes np.diff into."""

RADIUS_LEVELS = ("rank", "node", "rack", "pod", "cluster")
"""Blast radii, narrowest first."""
WEIBULL_SHAPE_VAR = 6 / math.pi**2  # asymptotic n Var(k_hat)/k^2 of the Weibull shape MLE (0.608)


@dataclass(kw_only=True, slots=True, frozen=True)
class FailureEvent:
    """One raw failure as logged (one rank, node or device)."""

    timestamp_s: float
    """When it happened, epoch seconds."""
    ranks: tuple[int, ...] = ()
    """Ranks lost."""
    nodes: tuple[str, ...] = ()
    """Nodes lost."""
    domains: tuple[tuple[str, str], ...] = ()
    """Failure-domain tags, e.g. (("rack", "r12"), ("switch", "s3"))."""
    cause: str = ""
    """Free-text or categorised cause (xid, nccl_timeout, ...)."""
    restart_start_s: float | None = None
    """When the restart began."""
    restart_end_s: float | None = None
    """When training resumed."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Incident:
    """Raw events merged into one interruption."""

    start_s: float
    """First event."""
    end_s: float
    """Last event."""
    n_events: int
    """Raw events merged."""
    nodes: tuple[str, ...]
    """Distinct nodes hit."""
    ranks: tuple[int, ...]
    """Distinct ranks hit."""
    domains: tuple[tuple[str, str], ...]
    """Distinct failure-domain tags."""
    causes: tuple[str, ...]
    """Distinct causes."""
    blast_radius: str
    """One of RADIUS_LEVELS."""
    downtime_s: float | None
    """First event to training resumed (detect + replace + reload + warm-up), when logged."""


@dataclass(kw_only=True, slots=True, frozen=True)
class TestResult:
    """One test of the Poisson assumption."""

    name: str
    """dispersion, cv, weibull_shape, crow_amsaa or cascade."""
    estimate: float
    """var/mean, CV, Weibull shape, Crow-AMSAA beta, or observed/expected short gaps."""
    ci: tuple[float, float] | None
    """Confidence interval of the estimate when it has one."""
    p_value: float
    """p-value under the Poisson null."""
    rejects: bool
    """p < alpha."""
    detail: str
    """One-line reading."""


@dataclass(kw_only=True, slots=True, frozen=True)
class PoissonTests:
    """The assumption checks of checkpointing.md step 3 (None when too little data)."""

    dispersion: TestResult | None
    """Index of dispersion of per-bin counts (var/mean > 1: over-dispersed)."""
    cv: TestResult | None
    """Inter-arrival coefficient of variation (> 1: clustered)."""
    weibull: TestResult | None
    """Weibull shape MLE with CI (< 1: infant mortality, > 1: wear-out)."""
    trend: TestResult | None
    """Crow-AMSAA beta (< 1: burn-in, > 1: ageing)."""
    cascade: TestResult | None
    """Excess of very short inter-arrivals (cascades)."""

    @property
    def rejected(self) -> tuple[str, ...]:
        return tuple(
            t.name
            for t in (self.dispersion, self.cv, self.weibull, self.trend, self.cascade)
            if t is not None and t.rejects
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class LogAnalysis:
    """Everything the cadence advisor takes from a log."""

    incidents: tuple[Incident, ...]
    """Merged incidents, in time order."""
    n_events: int
    """Raw events."""
    n_incidents: int
    """Incidents."""
    cluster_factor: float
    """Raw events per incident."""
    exposure_s: float
    """Observed wall-clock time."""
    rate_per_s: float
    """Incident rate n / exposure (1/exposure when n = 0 would be meaningless: n >= 1 enforced)."""
    rate_ci_per_s: tuple[float, float]
    """Exact Poisson (Garwood) interval."""
    current_rate_per_s: float
    """Crow-AMSAA intensity at the end of the window (equals rate_per_s without a trend)."""
    median_downtime_s: float | None
    """Median incident downtime when restart times are logged."""
    weibull_scale_s: float | None = None
    """Scale of the truncation-corrected Weibull fit of incident inter-arrivals (with tests.weibull)."""
    radius_counts: dict[str, int] = field(default_factory=dict)
    """Incidents per blast radius."""
    tests: PoissonTests = field(
        default_factory=lambda: PoissonTests(dispersion=None, cv=None, weibull=None, trend=None, cascade=None)
    )
    """Poisson-assumption tests on incident times."""


# --- parsing and loading -------------------------------------------------------------------------


def _time(value: Any, key: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{key}: not a time: {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            return float(text)
        except ValueError:
            pass
        try:
            parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError as exc:
            raise ValueError(f"{key}: not epoch seconds or ISO 8601: {value!r}") from exc
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        return parsed.timestamp()
    raise ValueError(f"{key}: not a time: {value!r}")


def _list(value: Any) -> list[str]:
    if value is None or value == "":
        return []
    if isinstance(value, list | tuple):
        return [str(v) for v in value]
    text = str(value)
    for sep in (";", "|"):
        if sep in text:
            return [p.strip() for p in text.split(sep) if p.strip()]
    return [p for p in text.split() if p]


def _domains(value: Any) -> tuple[tuple[str, str], ...]:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), str(v)) for k, v in value.items()))
    pairs = []
    for item in _list(value):
        if "=" not in item:
            raise ValueError(f"domains: expected key=value tags, got {item!r}")
        k, v = item.split("=", 1)
        pairs.append((k.strip(), v.strip()))
    return tuple(sorted(pairs))


def parse_event(raw: Mapping[str, Any]) -> FailureEvent:
    """One event from a CSV row or JSON object; ValueError names the bad field."""
    if "timestamp" not in raw:
        raise ValueError("timestamp: required")
    try:
        ranks = tuple(int(r) for r in _list(raw.get("ranks")))
    except ValueError as exc:
        raise ValueError(f"ranks: not integers: {raw.get('ranks')!r}") from exc
    restart_start = raw.get("restart_start")
    restart_end = raw.get("restart_end")
    return FailureEvent(
        timestamp_s=_time(raw["timestamp"], "timestamp"),
        ranks=ranks,
        nodes=tuple(_list(raw.get("nodes"))),
        domains=_domains(raw.get("domains", raw.get("tags"))),
        cause=str(raw.get("cause") or ""),
        restart_start_s=None if restart_start in (None, "") else _time(restart_start, "restart_start"),
        restart_end_s=None if restart_end in (None, "") else _time(restart_end, "restart_end"),
    )


def load_events(path: str | Path) -> tuple[FailureEvent, ...]:
    """Load a CSV (header row) or JSON (list, or {"events": [...]}) or JSON-lines event log."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    if p.suffix.lower() == ".csv":
        rows: Iterable[Mapping[str, Any]] = list(csv.DictReader(text.splitlines()))
    elif p.suffix.lower() == ".jsonl":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        data = json.loads(text)
        rows = data["events"] if isinstance(data, Mapping) else data
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(parse_event(row))
        except ValueError as exc:
            raise ValueError(f"{p.name} event {i}: {exc}") from exc
    return tuple(sorted(out, key=lambda e: e.timestamp_s))


# --- incidents -----------------------------------------------------------------------------------


def _radius(events: Sequence[FailureEvent]) -> str:
    nodes = {n for e in events for n in e.nodes}
    if len(nodes) <= 1:
        return "node" if nodes else ("rank" if len({r for e in events for r in e.ranks}) <= 1 else "node")
    tags: dict[str, set[str]] = {}
    for e in events:
        for k, v in e.domains:
            tags.setdefault(k, set()).add(v)
    if len(tags.get("rack", set())) <= 1:
        return "rack"
    if "pod" in tags and len(tags["pod"]) == 1:
        return "pod"
    return "cluster"


def _incident(events: list[FailureEvent]) -> Incident:
    ends = [e.restart_end_s for e in events if e.restart_end_s is not None]
    start = events[0].timestamp_s
    return Incident(
        start_s=start,
        end_s=events[-1].timestamp_s,
        n_events=len(events),
        nodes=tuple(sorted({n for e in events for n in e.nodes})),
        ranks=tuple(sorted({r for e in events for r in e.ranks})),
        domains=tuple(sorted({d for e in events for d in e.domains})),
        causes=tuple(sorted({e.cause for e in events if e.cause})),
        blast_radius=_radius(events),
        downtime_s=max(ends) - start if ends else None,
    )


def default_window_s(events: Sequence[FailureEvent]) -> float:
    """max(5 min, median restart duration) (checkpointing.md step 1)."""
    durations = [e.restart_end_s - e.timestamp_s for e in events if e.restart_end_s is not None]
    return max(300.0, float(np.median(durations))) if durations else 300.0


def merge_incidents(
    events: Sequence[FailureEvent], *, window_s: float | None = None, domain_window_s: float = 3600.0
) -> tuple[Incident, ...]:
    """Merge events closer than window_s, or closer than domain_window_s when they share a domain tag."""
    ordered = sorted(events, key=lambda e: e.timestamp_s)
    window = default_window_s(ordered) if window_s is None else window_s
    groups: list[list[FailureEvent]] = []
    tags: list[set[tuple[str, str]]] = []
    for event in ordered:
        joined = False
        # Only groups whose last event is within the wider window can still absorb this one.
        for idx in range(len(groups) - 1, -1, -1):
            gap = event.timestamp_s - groups[idx][-1].timestamp_s
            if gap > max(window, domain_window_s):
                break
            if gap <= window or (gap <= domain_window_s and tags[idx] & set(event.domains)):
                groups[idx].append(event)
                tags[idx].update(event.domains)
                joined = True
                break
        if not joined:
            groups.append([event])
            tags.append(set(event.domains))
    incidents = [_incident(g) for g in groups]
    return tuple(sorted(incidents, key=lambda inc: inc.start_s))


# --- rates and tests -------------------------------------------------------------------------------


def garwood_interval(n: int, exposure_s: float, confidence: float = 0.9) -> tuple[float, float]:
    """Exact Poisson rate interval: [chi2(2n, a/2) / 2E, chi2(2n+2, 1-a/2) / 2E]."""
    a = 1 - confidence
    lo = 0.0 if n == 0 else chi2.ppf(a / 2, 2 * n) / (2 * exposure_s)
    return float(lo), float(chi2.ppf(1 - a / 2, 2 * n + 2) / (2 * exposure_s))


def dispersion_test(
    times_s: Samples, *, start_s: float, end_s: float, bin_s: float = 86400.0, alpha: float = 0.05
) -> TestResult | None:
    """Index of dispersion of counts per bin: sum (c - mean)^2 / mean ~ chi2(bins - 1) under Poisson."""
    n_bins = int((end_s - start_s) // bin_s)
    if n_bins < 5 or len(times_s) < 5:
        return None
    counts = np.histogram(np.asarray(times_s), bins=n_bins, range=(start_s, start_s + n_bins * bin_s))[0]
    mean = counts.mean()
    if mean == 0:
        return None
    stat = float(((counts - mean) ** 2).sum() / mean)
    p = float(chi2.sf(stat, n_bins - 1))
    ratio = float(counts.var(ddof=1) / mean)
    return TestResult(
        name="dispersion",
        estimate=ratio,
        ci=None,
        p_value=p,
        rejects=p < alpha,
        detail=f"var/mean of {n_bins} bins of {bin_s / 3600:.0f} h = {ratio:.2f}",
    )


def cv_test(inter_arrivals_s: Samples, *, alpha: float = 0.05) -> TestResult | None:
    """CV of inter-arrivals; for exponential data the sample CV has standard error ~ 1/sqrt(n)."""
    x = np.asarray(inter_arrivals_s, dtype=float)
    if len(x) < 10:
        return None
    cv = float(x.std(ddof=1) / x.mean())
    p = float(norm.sf((cv - 1) * math.sqrt(len(x))))
    return TestResult(
        name="cv",
        estimate=cv,
        ci=None,
        p_value=p,
        rejects=p < alpha,
        detail=f"CV = {cv:.2f} over {len(x)} inter-arrivals (1 for Poisson)",
    )


def weibull_mle(samples: Samples, *, truncation_s: float = 0.0) -> tuple[float, float]:
    """Weibull (shape, scale) maximum-likelihood estimate, optionally left-truncated.

    Merging events closer than the merge window w into one incident removes inter-arrivals
    shorter than w, which biases the shape upwards; with truncation_s = w the likelihood is
    conditioned on x > w: sum log f(x_i) - n log S(w). Shapes are clamped to [0.05, 50].
    """
    x = np.asarray(samples, dtype=float)
    x = x[x > 0]
    if len(x) < 2:
        raise ValueError("weibull_mle: need at least two positive samples")
    unit = x.mean()
    y = x / unit  # scale-free for numerical stability
    log_y = np.log(y)
    lo, hi = 0.05, 50.0

    def profile(k: float) -> float:
        w = y**k
        return float((w * log_y).sum() / w.sum() - 1 / k - log_y.mean())

    if profile(lo) * profile(hi) > 0:  # degenerate (e.g. identical gaps): the MLE runs to a bound
        shape = lo if profile(lo) > 0 else hi
    else:
        shape = brentq(profile, lo, hi)
    scale = float((y**shape).mean() ** (1 / shape))
    w_trunc = truncation_s / unit
    if w_trunc > 0:

        def nll(params: np.ndarray) -> float:
            k, eta = math.exp(params[0]), math.exp(params[1])
            return -float(
                (math.log(k) - k * math.log(eta) + (k - 1) * log_y - (y / eta) ** k).sum()
                + len(y) * (w_trunc / eta) ** k
            )

        res = minimize(
            nll,
            x0=np.log([shape, scale]),
            method="Nelder-Mead",
            options={"xatol": 1e-6, "fatol": 1e-9, "maxiter": 2000},
        )
        shape = min(hi, max(lo, math.exp(res.x[0])))
        scale = math.exp(res.x[1])
    return shape, unit * scale


def weibull_test(
    inter_arrivals_s: Samples, *, alpha: float = 0.05, truncation_s: float = 0.0
) -> TestResult | None:
    """Shape MLE with Wald CI on log(shape): Var(k_hat) ~ 0.608 k^2 / n; exponential is k = 1."""
    x = [v for v in inter_arrivals_s if v > 0]
    if len(x) < 10:
        return None
    shape, _ = weibull_mle(x, truncation_s=truncation_s)
    se = math.sqrt(WEIBULL_SHAPE_VAR / len(x))
    z = norm.ppf(1 - alpha / 2)
    ci = (shape * math.exp(-z * se), shape * math.exp(z * se))
    p = float(2 * norm.sf(abs(math.log(shape)) / se))
    reading = "infant mortality" if shape < 1 else "wear-out" if shape > 1 else "exponential"
    return TestResult(
        name="weibull_shape",
        estimate=shape,
        ci=ci,
        p_value=p,
        rejects=p < alpha,
        detail=f"shape {shape:.2f} ({reading}), {1 - alpha:.0%} CI {ci[0]:.2f}-{ci[1]:.2f}",
    )


def crow_amsaa_test(
    times_s: Samples, *, start_s: float, end_s: float, alpha: float = 0.05
) -> TestResult | None:
    """Power-law NHPP trend: beta = n / sum ln(T/t_i), CI from 2n beta / beta_hat ~ chi2(2n).

    The decision uses the Lewis-Robinson statistic (the Laplace trend statistic divided by the
    inter-arrival CV), which stays valid when the gaps are not exponential; Crow-AMSAA's own
    chi-square test assumes Poisson increments and rejects far too often on clustered data.
    """
    t = np.sort(np.asarray(times_s, dtype=float) - start_s)
    t = t[t > 0]
    span = end_s - start_s
    n = len(t)
    if n < 5:
        return None
    beta = n / float(np.log(span / t).sum())
    ci = (beta * chi2.ppf(alpha / 2, 2 * n) / (2 * n), beta * chi2.ppf(1 - alpha / 2, 2 * n) / (2 * n))
    laplace = (t.mean() - span / 2) / (span * math.sqrt(1 / (12 * n)))
    gaps = np.diff(np.concatenate([[0.0], t]))
    cv = float(gaps.std(ddof=1) / gaps.mean()) if n > 2 else 1.0
    p = float(2 * norm.sf(abs(laplace) / max(cv, 1e-9)))
    reading = "burn-in (falling rate)" if beta < 1 else "ageing (rising rate)"
    return TestResult(
        name="crow_amsaa",
        estimate=beta,
        ci=ci,
        p_value=p,
        rejects=p < alpha,
        detail=f"beta {beta:.2f}: {reading}, CI {ci[0]:.2f}-{ci[1]:.2f} (Lewis-Robinson p = {p:.3f})",
    )


def cascade_test(
    inter_arrivals_s: Samples, *, short_fraction: float = 0.1, alpha: float = 0.05
) -> TestResult | None:
    """Inter-arrivals shorter than 10% of the mean, versus the exponential's 1 - e^-0.1 share."""
    x = np.asarray(inter_arrivals_s, dtype=float)
    if len(x) < 10:
        return None
    threshold = short_fraction * x.mean()
    observed = int((x < threshold).sum())
    p0 = 1 - math.exp(-short_fraction)
    expected = p0 * len(x)
    p = float(binom.sf(observed - 1, len(x), p0))
    return TestResult(
        name="cascade",
        estimate=observed / expected,
        ci=None,
        p_value=p,
        rejects=p < alpha,
        detail=f"{observed} gaps < {threshold / 60:.0f} min vs {expected:.1f} expected",
    )


def analyze_log(
    events: Sequence[FailureEvent],
    *,
    exposure_s: float | None = None,
    start_s: float | None = None,
    end_s: float | None = None,
    window_s: float | None = None,
    domain_window_s: float = 3600.0,
    confidence: float = 0.9,
    alpha: float = 0.05,
    bin_s: float = 86400.0,
) -> LogAnalysis:
    """Incidents, rate with exact bounds, and Poisson tests for one log.

    The observation window defaults to [first event, last event or restart end]; pass start_s/end_s
    or exposure_s when the log covers a known period (recommended: starting at the first failure
    drops the first inter-arrival).
    """
    if not events:
        raise ValueError("events: the log is empty")
    window = default_window_s(events) if window_s is None else window_s
    incidents = merge_incidents(events, window_s=window, domain_window_s=domain_window_s)
    stamps = [e.timestamp_s for e in events] + [e.restart_end_s for e in events if e.restart_end_s]
    start = min(e.timestamp_s for e in events) if start_s is None else start_s
    if end_s is None:
        end_s = start + exposure_s if exposure_s is not None else max(stamps)
    exposure = end_s - start if exposure_s is None else exposure_s
    if not exposure > 0:
        raise ValueError("exposure_s: the log spans no time; pass exposure_s")
    n = len(incidents)
    starts = [inc.start_s for inc in incidents]
    gaps = np.diff(starts)
    weibull = weibull_test(gaps, alpha=alpha, truncation_s=window)
    tests = PoissonTests(
        dispersion=dispersion_test(starts, start_s=start, end_s=end_s, bin_s=bin_s, alpha=alpha),
        cv=cv_test(gaps, alpha=alpha),
        weibull=weibull,
        trend=crow_amsaa_test(starts, start_s=start, end_s=end_s, alpha=alpha),
        cascade=cascade_test(gaps, alpha=alpha),
    )
    rate = n / exposure
    current = rate * tests.trend.estimate if tests.trend is not None and tests.trend.rejects else rate
    downtimes = [inc.downtime_s for inc in incidents if inc.downtime_s is not None]
    radius: dict[str, int] = {}
    for inc in incidents:
        radius[inc.blast_radius] = radius.get(inc.blast_radius, 0) + 1
    return LogAnalysis(
        incidents=incidents,
        n_events=len(events),
        n_incidents=n,
        cluster_factor=len(events) / n,
        exposure_s=exposure,
        rate_per_s=rate,
        rate_ci_per_s=garwood_interval(n, exposure, confidence),
        current_rate_per_s=current,
        median_downtime_s=float(np.median(downtimes)) if downtimes else None,
        weibull_scale_s=weibull_mle(gaps, truncation_s=window)[1] if weibull else None,
        radius_counts=radius,
        tests=tests,
    )
