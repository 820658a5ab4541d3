"""Cadence formulas against checkpointing.md, and the advisor's decisions."""

import math

import numpy as np
import pytest

from trainvitals.service.advisors.cadence import (
    CadenceInputs,
    TierSpec,
    advise_cadence,
    advise_from_records,
    advise_retention,
    advise_tiers,
    daly_first_order,
    daly_higher_order,
    expected_waste,
    first_order_waste,
    flat_basin_band,
    hazard_schedule,
    irrecoverable_probability,
    optimal_interval,
    optimal_interval_renewal,
    schedule_waste,
    variable_waste_ratio,
    young_interval,
)

H = 3600.0


def test_young_and_daly_closed_forms() -> None:
    assert young_interval(stall_s=60, mtbf_s=4 * H) == pytest.approx(math.sqrt(2 * 60 * 14400))
    assert daly_first_order(stall_s=60, mtbf_s=4 * H, restart_s=600) == pytest.approx(
        math.sqrt(2 * 60 * 15000))
    x = 60 / (2 * 4 * H)
    expected = math.sqrt(2 * 60 * 4 * H) * (1 + math.sqrt(x) / 3 + x / 9) - 60
    assert daly_higher_order(stall_s=60, mtbf_s=4 * H) == pytest.approx(expected)
    assert daly_higher_order(stall_s=3 * H, mtbf_s=H) == H  # delta >= 2M branch


def test_lambert_optimum_minimises_daly_exact_waste() -> None:
    for stall, mtbf in ((60, 4 * H), (600, 2 * H), (5, 24 * H)):
        best = optimal_interval(stall_s=stall, mtbf_s=mtbf)
        grid = np.geomspace(best / 3, best * 3, 2001)
        waste = [expected_waste(t, stall_s=stall, mtbf_s=mtbf, downtime_s=600) for t in grid]
        assert grid[int(np.argmin(waste))] == pytest.approx(best, rel=0.003)
        # R scales the cost but does not move T*.
        assert optimal_interval_renewal(stall_s=stall, mtbf_s=mtbf, downtime_s=5 * H) == pytest.approx(
            best, rel=1e-3)


def test_higher_order_daly_tracks_exact_optimum() -> None:
    for ratio in (1e-4, 1e-3, 1e-2, 0.1):
        exact = optimal_interval(stall_s=ratio * H, mtbf_s=H)
        assert daly_higher_order(stall_s=ratio * H, mtbf_s=H) == pytest.approx(exact, rel=0.02)
        assert young_interval(stall_s=ratio * H, mtbf_s=H) > exact  # Young overshoots


def test_flat_basin_band_and_cost_of_a_2x_error() -> None:
    lo, hi = flat_basin_band(1.0, 0.05)
    assert (round(lo, 2), round(hi, 2)) == (0.73, 1.37)
    assert variable_waste_ratio(2.0, 1.0) == pytest.approx(1.25)
    assert variable_waste_ratio(lo, 1.0) == pytest.approx(1.05)
    # First-order waste minimum: sqrt(2 delta/M) + (D+R)/M.
    t = young_interval(stall_s=60, mtbf_s=4 * H)
    assert first_order_waste(t, stall_s=60, mtbf_s=4 * H, downtime_s=600) == pytest.approx(
        math.sqrt(2 * 60 / (4 * H)) + 600 / (4 * H))


def test_irrecoverable_probability_values() -> None:
    values = [irrecoverable_probability(k, interval_s=H, latency_s=H) for k in (1, 2, 3, 5)]
    assert [round(v, 3) for v in values] == [0.632, 0.233, 0.086, 0.012]


def test_weibull_path_equals_exponential_closed_form_at_shape_one() -> None:
    closed = expected_waste(1200, stall_s=60, mtbf_s=4 * H, downtime_s=600, persist_s=120)
    summed = expected_waste(1200, stall_s=60, mtbf_s=4 * H, downtime_s=600, persist_s=120,
                            shape=1.0 + 1e-9)
    assert summed == pytest.approx(closed, rel=1e-6)


def test_async_persist_adds_about_p_over_m() -> None:
    base = expected_waste(1300, stall_s=30, mtbf_s=4 * H, downtime_s=600)
    lagged = expected_waste(1300, stall_s=30, mtbf_s=4 * H, downtime_s=600, persist_s=300)
    # Exactly: kept progress shrinks by e^(-P/M); to first order the waste grows by P/M.
    assert 1 - lagged == pytest.approx((1 - base) * math.exp(-300 / (4 * H)))
    assert lagged - base == pytest.approx(300 / (4 * H), rel=0.15)
    advice = advise_cadence(CadenceInputs(stall_s=30, persist_s=300, mtbf_s=4 * H))
    assert advice.recommended_interval_s == pytest.approx(optimal_interval(stall_s=30, mtbf_s=4 * H))


def test_retention_from_risk_latency_and_budget() -> None:
    r = advise_retention(interval_s=H, latency_s=H, acceptable_risk=0.05)
    assert (r.keep, r.keep_for_risk, r.keep_deterministic) == (4, 4, 2)
    assert r.risk_at_keep == pytest.approx(irrecoverable_probability(4, interval_s=H, latency_s=H))
    assert advise_retention(interval_s=H, latency_s=0.01 * H, acceptable_risk=0.05).keep == 2  # floor
    tight = advise_retention(interval_s=H, latency_s=H, acceptable_risk=0.01, checkpoint_bytes=1e12,
                             storage_budget_bytes=3.5e12)
    assert tight.keep == 3 and tight.storage_limit == 3 and tight.keep_every >= 2
    assert tight.risk_at_keep <= 0.01
    assert any("storage budget" in n for n in tight.notes)


def test_tiers_use_rates_of_incidents_wider_than_faster_tiers() -> None:
    tiers = (TierSpec(name="peer_ram", cost_s=5, survives="node"),
             TierSpec(name="pfs", cost_s=120, survives="cluster"))
    rates = {"node": 0.9 / (4 * H), "rack": 0.1 / (4 * H)}
    ram, pfs = advise_tiers(tiers, rates)
    assert ram.interval_s == pytest.approx(math.sqrt(2 * 5 * 4 * H))
    assert pfs.interval_s == pytest.approx(math.sqrt(2 * 120 / rates["rack"]))
    assert pfs.rate_per_hour == pytest.approx(0.1 / 4)
    with pytest.raises(ValueError, match="survives"):
        TierSpec(name="x", cost_s=1, survives="galaxy")


def test_hazard_schedule_starts_dense_and_gains_under_infant_mortality() -> None:
    steady = optimal_interval_renewal(stall_s=60, mtbf_s=4 * H, downtime_s=600, shape=0.6)
    sched = hazard_schedule(stall_s=60, mtbf_s=4 * H, shape=0.6, steady_s=steady)
    assert list(sched) == sorted(sched) and sched[0] < 0.6 * steady
    fixed = expected_waste(steady, stall_s=60, mtbf_s=4 * H, downtime_s=600, shape=0.6)
    adapted = schedule_waste(sched, steady_s=steady, stall_s=60, mtbf_s=4 * H, downtime_s=600, shape=0.6)
    assert adapted < fixed


def test_advice_without_log_has_no_confidence_width() -> None:
    a = advise_cadence(CadenceInputs(stall_s=60, mtbf_s=4 * H))
    assert a.confidence_band_s[0] == pytest.approx(a.confidence_band_s[1])
    assert a.band_s[0] < a.recommended_interval_s < a.band_s[1]
    assert a.expected_waste < a.expected_waste_young + 1e-12
    d = a.as_dict()
    for key in ("young_interval_s", "daly_interval_s", "optimal_interval_s", "recommended_interval_s",
                "band_s", "confidence_band_s", "retention", "expected_waste", "assumptions"):
        assert key in d
    with pytest.raises(ValueError, match="mtbf_s"):
        CadenceInputs(stall_s=60)


def test_advise_from_observed_records() -> None:
    checkpoints = [{"stall_s": 40, "persist_s": 200, "size_bytes": 2e11, "status": "ok"},
                   {"stall_s": 60, "persist_s": 220, "size_bytes": 2e11, "status": "ok"},
                   {"write_stall_s": 50, "persist_s": 210, "status": "completed"},
                   {"stall_s": 900, "status": "failed"}]
    times = np.cumsum(np.random.default_rng(1).exponential(4 * H, 39))
    failures = [{"timestamp": float(t), "nodes": [f"n{i}"]} for i, t in enumerate(times)]
    a = advise_from_records(checkpoints, failures, exposure_s=float(times[-1]) + H, sdc_latency_s=H,
                            acceptable_risk=0.01, storage_budget_bytes=2e12)
    # Failures closer than the restart time (600 s by default, no restart ends logged) are one incident.
    incidents = 1 + int((np.diff(times) > 600).sum())
    assert incidents < 39
    assert a.mtbf_s == pytest.approx((times[-1] + H) / incidents)
    assert a.recommended_interval_s == pytest.approx(optimal_interval(stall_s=50, mtbf_s=a.mtbf_s))
    assert a.retention.storage_limit == 10
    assert any("1 of 4 saves failed" in w for w in a.warnings)
    with pytest.raises(ValueError, match="checkpoints"):
        advise_from_records([{"stall_s": 10, "status": "failed"}], failures)
