"""detect(): the one entry point; deterministic, causal (live == offline), configurable."""

from __future__ import annotations

import dataclasses

import pytest

from trainvitals.service.detectors import DetectorConfig, detect
from trainvitals.service.detectors.suppression import SuppressionConfig
from trainvitals.testing.scenarios import make_scenario, prefix


def test_deterministic_and_ordered() -> None:
    sc = make_scenario("late_divergence", 7)
    a, b = detect(sc.series), detect(make_scenario("late_divergence", 7).series)
    assert a == b and a
    order = {"page": 0, "ticket": 1, "info": 2}
    keys = [(order[f.severity], f.onset_step) for f in a]
    assert keys == sorted(keys)
    assert all(f.run == sc.series.run and f.summary and f.summary.isascii() for f in a)


@pytest.mark.parametrize(
    ("family", "kind"),
    [
        ("late_divergence", "grad_spikes_recurring"),
        ("late_divergence", "grad_norm_drift"),
        ("fp8_amax_creep", "fp8_headroom_trend"),
        ("fp8_jump", "fp8_stale_scale"),
        ("straggler", "straggler"),
        ("intermittent_straggler", "straggler_intermittent"),
        ("mfu_gap", "mfu_gap"),
    ],
)
def test_live_equals_offline(family: str, kind: str) -> None:
    """Seen only up to its detection step, the run yields the same finding (same onset); one step
    earlier it does not exist yet. This is what lets the collector and the post-mortem agree."""
    sc = make_scenario(family, 11)
    want = sc.expect_subject
    (full,) = [f for f in detect(sc.series) if f.kind == kind and f.subject == (want or f.subject)]
    assert full.detected_step is not None
    live = [f for f in detect(prefix(sc.series, full.detected_step)) if f.key == full.key]
    assert len(live) == 1
    assert live[0].onset_step == full.onset_step and live[0].detected_step == full.detected_step
    assert not [f for f in detect(prefix(sc.series, full.detected_step - 1)) if f.key == full.key]


def test_rollback_target_page_joins_divergence_and_checkpoints() -> None:
    sc = make_scenario("late_divergence", 3)
    assert not [f for f in detect(sc.series) if f.kind == "no_rollback_target"]  # checkpoints every 500 steps
    sc.series.checkpoints = [c for c in sc.series.checkpoints if c.step > 4000]  # retention lost the old ones
    (f,) = [f for f in detect(sc.series) if f.kind == "no_rollback_target"]
    pages = [g for g in detect(sc.series) if g.kind == "grad_spikes_recurring"]
    first_page = min(pages, key=lambda g: g.onset_step)
    assert f.severity == "page" and f.onset_step == first_page.onset_step


def test_config_is_honoured() -> None:
    sc = make_scenario("healthy_burst", 4)
    default = [f for f in detect(sc.series) if f.kind == "grad_spike"]
    assert default  # the burst is counted
    quiet = DetectorConfig(suppression=SuppressionConfig(warmup_steps=10_000))
    assert [f for f in detect(sc.series, config=quiet) if f.kind == "grad_spike"] == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        quiet.suppression = SuppressionConfig()  # type: ignore[misc]
