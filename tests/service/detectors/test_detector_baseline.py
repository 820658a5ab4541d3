"""Comparison with a named baseline run: shapes the previous run of the same recipe shared cancel,
faults do not; a baseline that ends before the run is not used.

The baselines are `make_scenario(family, seed, noise_seed=...)`: the same recipe (bump, rise, fault
at the same step and of the same size) with per-step noise of its own.
"""

from __future__ import annotations

import dataclasses

import pytest

from trainvitals.service.detectors import detect
from trainvitals.testing.scenarios import make_scenario, prefix


def _kinds(findings: list) -> set[str]:
    return {f.kind for f in findings if f.severity != "info"}


@pytest.mark.parametrize(
    ("family", "kind"),
    [
        ("healthy_end_rise", "grad_norm_drift"),  # end-of-training gradient-norm rise (Defazio 2025)
        ("healthy_loss_bump", "loss_divergence"),  # a loss bump at the same step (same data order)
    ],
)
@pytest.mark.parametrize("seed", [100, 101])
def test_a_shape_shared_with_the_baseline_cancels(family: str, kind: str, seed: int) -> None:
    run = make_scenario(family, seed).series
    base = make_scenario(family, seed, noise_seed=1).series
    assert kind in _kinds(detect(run))  # alone: found
    assert _kinds(detect(run, baseline=base)) == set()  # against the previous run: nothing
    # The registered baseline rides on the series (as the collector builds it): the same result.
    assert _kinds(detect(dataclasses.replace(run, baseline=base))) == set()


def test_a_fault_is_still_found_against_a_baseline() -> None:
    sc = make_scenario("late_divergence", 100)
    base = make_scenario("healthy_plain", 100).series  # a healthy run of the same base recipe
    found = {f.kind: f for f in detect(sc.series, baseline=base)}
    assert found["loss_divergence"].severity == "page" and found["grad_spikes_recurring"].severity == "page"
    drift = found["grad_norm_drift"]
    assert f"baseline run {base.run}" in drift.summary and drift.onset_step >= (sc.injected_step or 0)
    assert f"baseline run {base.run}" in found["loss_divergence"].summary


def test_a_baseline_that_ends_before_the_run_is_not_used() -> None:
    """Past the baseline's last step the run is judged against itself (one reference, not a mix)."""
    run = make_scenario("healthy_end_rise", 100).series
    short = prefix(make_scenario("healthy_end_rise", 100, noise_seed=1).series, 4000)
    assert [(f.kind, f.onset_step) for f in detect(run, baseline=short)] == [
        (f.kind, f.onset_step) for f in detect(run)
    ]
