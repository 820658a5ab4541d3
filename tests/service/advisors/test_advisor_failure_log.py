"""Event logs: loading, incident merging, exact rate bounds, Poisson-assumption tests."""

import json
from pathlib import Path

import numpy as np
import pytest

from trainvitals.service.advisors.cadence import CadenceInputs, advise_cadence
from trainvitals.service.advisors.failure_log import (
    FailureEvent,
    analyze_log,
    crow_amsaa_test,
    dispersion_test,
    garwood_interval,
    load_events,
    merge_incidents,
    parse_event,
    weibull_mle,
    weibull_test,
)

H = 3600.0


def test_load_csv_and_json(tmp_path: Path) -> None:
    csv_path = tmp_path / "events.csv"
    csv_path.write_text(
        "timestamp,ranks,nodes,domains,cause,restart_start,restart_end\n"
        "2024-05-01T10:00:00Z,0;1,node3,rack=r1;switch=s2,xid79,2024-05-01T10:01:00Z,2024-05-01T10:20:00Z\n"
        "1714558000,,node4,rack=r1,nccl_timeout,,\n")
    events = load_events(csv_path)
    assert events[0].ranks == (0, 1) and events[0].domains == (("rack", "r1"), ("switch", "s2"))
    assert events[0].restart_end_s - events[0].timestamp_s == 1200
    json_path = tmp_path / "events.json"
    json_path.write_text(json.dumps({"events": [{"timestamp": 5, "nodes": ["a"], "domains": {"pod": "p"}}]}))
    assert load_events(json_path)[0].domains == (("pod", "p"),)
    json_path.write_text(json.dumps([{"nodes": ["a"]}]))
    with pytest.raises(ValueError, match="event 0: timestamp: required"):
        load_events(json_path)


def test_bad_fields_are_named() -> None:
    with pytest.raises(ValueError, match="timestamp: not epoch seconds or ISO 8601"):
        parse_event({"timestamp": "yesterday"})
    with pytest.raises(ValueError, match="ranks: not integers"):
        parse_event({"timestamp": 0, "ranks": "a;b"})
    with pytest.raises(ValueError, match="domains: expected key=value"):
        parse_event({"timestamp": 0, "domains": "rack"})


def _ev(t: float, node: str, rack: str | None = None, pod: str | None = None) -> FailureEvent:
    domains = tuple(sorted(x for x in (("rack", rack) if rack else None, ("pod", pod) if pod else None) if x))
    return FailureEvent(timestamp_s=t, nodes=(node,), domains=domains)


def test_merge_window_domain_window_and_radius() -> None:
    events = [_ev(0, "a", "r1"), _ev(30, "b", "r1"), _ev(40, "c", "r1"),  # burst: one rack incident
              _ev(1800, "d", "r1"),  # 30 min later, same rack: aftershock, merged by the domain window
              _ev(4 * H, "e", "r2"), _ev(4 * H + 2000, "f", "r3"),  # no shared tag, > 5 min: two incidents
              _ev(10 * H, "g", "r4", "p1"), _ev(10 * H + 60, "h", "r5", "p1"),
              _ev(20 * H, "i", "r6", "p1"), _ev(20 * H + 60, "j", "r7", "p2")]
    incidents = merge_incidents(events)
    assert [i.n_events for i in incidents] == [4, 1, 1, 2, 2]
    assert [i.blast_radius for i in incidents] == ["rack", "node", "node", "pod", "cluster"]
    assert len(merge_incidents(events, domain_window_s=0)) == 6


def test_window_defaults_to_median_restart() -> None:
    events = [FailureEvent(timestamp_s=0, nodes=("a",), restart_end_s=1200),
              FailureEvent(timestamp_s=900, nodes=("b",), restart_end_s=2000)]
    assert len(merge_incidents(events)) == 1  # window = median restart (1150 s) > 900 s gap
    assert len(merge_incidents(events, window_s=300)) == 2


def test_garwood_interval_exact_values() -> None:
    lo, hi = garwood_interval(10, 1.0, 0.9)
    assert (round(lo, 3), round(hi, 3)) == (5.425, 16.962)
    assert garwood_interval(0, 1.0, 0.9) == (0.0, pytest.approx(2.996, abs=1e-3))


def test_poisson_data_passes_every_test() -> None:
    rng = np.random.default_rng(11)
    times = np.cumsum(rng.exponential(4 * H, 400))
    events = [_ev(float(t), f"n{i}") for i, t in enumerate(times)]
    analysis = analyze_log(events, start_s=0.0, end_s=float(times[-1]) + 1)
    assert analysis.tests.rejected == ()
    assert analysis.rate_ci_per_s[0] < 1 / (4 * H) < analysis.rate_ci_per_s[1]
    assert 1.0 <= analysis.cluster_factor < 1.05  # gaps under the 5-min window merge (~2% at M = 4 h)


def test_weibull_shape_mle_and_rejection() -> None:
    rng = np.random.default_rng(3)
    x = 5000 * rng.weibull(0.6, 2000)
    shape, scale = weibull_mle(x)
    assert shape == pytest.approx(0.6, rel=0.05) and scale == pytest.approx(5000, rel=0.1)
    result = weibull_test(x)
    assert result.rejects and result.ci[1] < 1
    assert not weibull_test(rng.exponential(5000, 300)).rejects


def test_trend_and_dispersion_detect_non_stationary_rates() -> None:
    rng = np.random.default_rng(5)
    # Ageing: intensity grows as t^1 (beta = 2) over 100 days.
    span = 100 * 86400.0
    times = np.sort(span * np.sqrt(rng.uniform(0, 1, 300)))
    trend = crow_amsaa_test(times, start_s=0, end_s=span)
    assert trend.rejects and trend.estimate == pytest.approx(2, rel=0.2)
    # Regimes: quiet days and 3x days -> over-dispersed daily counts.
    counts = rng.poisson(np.where(np.arange(60) % 4 == 0, 18, 2))
    stamps = [d * 86400 + rng.uniform(0, 86400) for d, c in enumerate(counts) for _ in range(c)]
    assert dispersion_test(stamps, start_s=0, end_s=60 * 86400).rejects


def test_trend_makes_advice_use_current_intensity() -> None:
    rng = np.random.default_rng(8)
    span = 100 * 86400.0
    times = np.sort(span * np.sqrt(rng.uniform(0, 1, 300)))
    analysis = analyze_log([_ev(float(t), f"n{i}") for i, t in enumerate(times)], start_s=0, end_s=span)
    advice = advise_cadence(CadenceInputs(stall_s=60, log=analysis))
    assert advice.mtbf_s == pytest.approx(1 / analysis.current_rate_per_s)
    assert advice.mtbf_s < span / 300  # rising rate: shorter than the average M
    assert any("Crow-AMSAA" in w for w in advice.warnings)


def test_raw_bursts_reject_but_incidents_do_not() -> None:
    rng = np.random.default_rng(2)
    starts = np.cumsum(rng.exponential(6 * H, 200))
    events = [_ev(float(t + rng.uniform(0, 60)), f"n{j}", f"r{i % 16}")
              for i, t in enumerate(starts) for j in range(8)]
    analysis = analyze_log(events, start_s=0.0, end_s=float(starts[-1]) + 1)
    # A few bursts in the same rack within an hour merge (domain window); none split.
    assert 190 <= analysis.n_incidents <= 200 and analysis.cluster_factor >= 8.0
    assert analysis.radius_counts["rack"] >= 190  # two racks' bursts within 5 min read as "cluster"
    assert "cv" not in analysis.tests.rejected and "dispersion" not in analysis.tests.rejected


def test_an_older_incident_still_in_its_domain_window_takes_a_later_event() -> None:
    """The merge stopped at the newest group out of reach: rack r1's incident, which ends after
    rack r2's started, missed an event of r1 inside its hour-long domain window."""
    spec = [(0.0, "a", "r1"), (1000.0, "b", "r2"), (2000.0, "c", "r1"), (5000.0, "d", "r1")]
    events = [FailureEvent(timestamp_s=t, ranks=(i,), nodes=(n,), domains=(("rack", r),))
              for i, (t, n, r) in enumerate(spec)]  # fmt: skip
    assert [(inc.start_s, inc.n_events) for inc in merge_incidents(events)] == [(0.0, 3), (1000.0, 1)]


def test_the_node_of_an_event_without_nodes_is_its_host_or_node_tag() -> None:
    """The collector's failure events name the agent's host in their domains, never in `nodes`:
    every incident read as one node wide, so a tier that survives a node (peer RAM) looked safe
    from incidents that took two racks."""
    assert parse_event({"timestamp": 1.0, "domains": {"host": "n0"}}).nodes == ("n0",)
    assert parse_event({"timestamp": 1.0, "nodes": ["n9"], "domains": {"node": "n0"}}).nodes == ("n9",)
    events = [parse_event({"timestamp": 100.0 * H * k + dt, "ranks": [rank], "domains": {"node": node, "rack": rack}})
              for k in range(6) for dt, rank, node, rack in ((0.0, 0, "n0", "r1"), (5.0, 64, "n8", "r2"))]  # fmt: skip
    log = analyze_log(events, exposure_s=600 * H)
    assert log.n_incidents == 6 and log.radius_counts == {"cluster": 6}


def test_the_merge_window_defaults_to_the_known_restart_time() -> None:
    """Without restart ends in the log, the window was 5 min whatever the restart time: a rank
    and its NCCL-timeout victims 400 s later (one outage, a 600 s restart) counted twice."""
    events = [parse_event({"timestamp": 48 * H * k + dt, "ranks": [rank]})
              for k in range(5) for dt, rank in ((0.0, 3), (400.0, 0))]  # fmt: skip
    assert analyze_log(events, exposure_s=240 * H).n_incidents == 10
    assert analyze_log(events, exposure_s=240 * H, restart_s=600.0).n_incidents == 5


def test_a_log_that_fits_a_shape_near_zero_still_gets_advice() -> None:
    """Each outage logged as its first rank, then its NCCL-timeout victims 600 s later: the gaps
    have two peaks and the Weibull shape fits near 0.1. The restart schedule's waste summed terms
    out to a horizon of eta x 50^(1/shape): numpy asked for 46 GiB, a MemoryError from /metrics."""
    rng = np.random.default_rng(7)
    starts = np.cumsum(rng.exponential(12 * H, size=10))
    events = [parse_event({"timestamp": float(t) + dt, "ranks": ranks})
              for t in starts for dt, ranks in ((0.0, [3]), (600.0, [0, 1, 2]))]  # fmt: skip
    log = analyze_log(events, exposure_s=float(starts[-1]) + 12 * H)
    advice = advise_cadence(CadenceInputs(stall_s=60.0, log=log))
    assert advice.shape < 0.5 and advice.schedule_s is not None and advice.schedule_gain is not None
    assert 60.0 < advice.recommended_interval_s < advice.mtbf_s
