"""Gradient-norm detectors: table tests on hand-made series."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainvitals.service.detectors.grad_norm import (
    GradNormConfig,
    detect_drift,
    detect_nonfinite,
    detect_spikes,
)
from trainvitals.service.detectors.series import RunEvent
from trainvitals.service.detectors.suppression import SuppressionConfig, suppression_for

CFG = GradNormConfig()


def _gn(n: int, seed: int = 0) -> np.ndarray:
    return np.exp(np.random.default_rng(seed).normal(0, 0.05, n))


def _kinds(findings: list) -> dict[str, object]:
    return {f.kind: f for f in findings}


@pytest.mark.parametrize(
    ("spikes", "expect_recurring"),
    [
        ([], False),  # quiet run
        ([1500], False),  # one spike: counted, never paged
        ([1500, 1510, 1525, 1540, 1560, 1590], False),  # one burst: one episode
        ([1000, 1300, 1600, 1900, 2200], False),  # 5 episodes, but early: not enough history vs the prior
        ([2000, 2150, 2300, 2450, 2600, 2750, 2900], True),  # 7 separate episodes in 900 steps
    ],
)
def test_spikes_counted_and_recurrence_paged(series, spikes: list[int], expect_recurring: bool) -> None:
    gn = _gn(3000)
    gn[spikes] *= 4.0
    s = series(3000, grad_norm=gn)
    found = _kinds(detect_spikes(s, suppression_for(s, SuppressionConfig()), CFG))
    if spikes:
        assert found["grad_spike"].severity == "info"
        assert found["grad_spike"].magnitude == len(spikes)
        assert found["grad_spike"].onset_step == spikes[0]
    else:
        assert not found
    assert ("grad_spikes_recurring" in found) is expect_recurring
    if expect_recurring:
        f = found["grad_spikes_recurring"]
        assert f.severity == "page" and f.onset_step == 2000 and f.active
        assert f.detected_step in spikes and f.detected_step > 2000  # became sure later than the onset


def test_spike_needs_both_robust_z_and_ratio(series) -> None:
    gn = _gn(2000)
    gn[1500] *= 1.6  # z is huge (5% noise) but below 2x the median: not a spike
    s = series(2000, grad_norm=gn)
    assert detect_spikes(s, suppression_for(s, SuppressionConfig()), CFG) == []


def test_spikes_in_warmup_and_after_resume_are_suppressed(series) -> None:
    gn = _gn(3000)
    gn[[100, 2005, 2010]] *= 5.0
    s = series(3000, grad_norm=gn, events=[RunEvent(event="resume", ts=0.0, step=2000)])
    assert detect_spikes(s, suppression_for(s, SuppressionConfig()), CFG) == []


def test_drift_ticket_with_onset_and_floor(series) -> None:
    n = 4000
    t = np.arange(n)
    rising = _gn(n) * np.exp(math.log(1.6) * np.clip((t - 2000) / 1500, 0, 1))
    s = series(n, grad_norm=rising)
    (f,) = detect_drift(s, suppression_for(s, SuppressionConfig()), CFG)
    assert f.kind == "grad_norm_drift" and f.severity == "ticket"
    assert 2000 <= f.onset_step <= 2600
    assert f.detected_step is not None and f.onset_step < f.detected_step < 3500
    # A 5% rise stays under the ln(1.1) floor: no ticket.
    small = _gn(n) * np.exp(math.log(1.05) * np.clip((t - 2000) / 500, 0, 1))
    s2 = series(n, grad_norm=small)
    assert detect_drift(s2, suppression_for(s2, SuppressionConfig()), CFG) == []


def test_phase_change_restarts_the_drift_baseline(series) -> None:
    n = 4000
    gn = _gn(n) * np.where(np.arange(n) >= 2000, 1.5, 1.0)
    plain = series(n, grad_norm=gn)
    assert detect_drift(plain, suppression_for(plain, SuppressionConfig()), CFG)
    annotated = series(n, grad_norm=gn, events=[RunEvent(event="phase_change", ts=0.0, step=2000)])
    assert detect_drift(annotated, suppression_for(annotated, SuppressionConfig()), CFG) == []


@pytest.mark.parametrize(
    ("value", "nonfinite_count", "expect"),
    [(math.inf, 0, True), (math.nan, 12, True), (math.nan, 0, False), (1.0, 0, False)],
)
def test_nonfinite_pages_at_once_but_nan_alone_is_unknown(series, value: float, nonfinite_count: int,
                                                           expect: bool) -> None:
    s = series(500)
    s.steps.grad_norm[100] = value
    s.steps.grad_nonfinite[100] = nonfinite_count
    found = detect_nonfinite(s, CFG)
    assert bool(found) is expect
    if expect:
        assert found[0].severity == "page" and found[0].onset_step == 100 and found[0].detected_step == 100


def _skipping(series, n: int, skipped_at: list[int]):
    """A run whose optimizer skipped the given steps on inf gradients (a loss scaler's skips)."""
    s = series(n)
    s.steps.skipped = np.zeros(n, dtype=bool)
    s.steps.skipped[skipped_at] = True
    s.steps.grad_norm[skipped_at] = math.inf
    s.steps.grad_nonfinite[skipped_at] = 3
    return s


def test_steps_a_loss_scaler_skipped_are_not_paged(series) -> None:
    """fp16 with torch.amp.GradScaler: the first steps overflow while the scale calibrates, and one
    step in every growth interval after that. Nothing was applied, nothing to page."""
    skipped = [0, 1, 2, 3, 4, 5, 6, 2000, 4000, 4001, 6000]
    s = _skipping(series, 8000, skipped)
    assert detect_nonfinite(s, CFG) == []
    # The same steps without the skip flags are a divergence: paged at the first one.
    s.steps.skipped = None
    assert detect_nonfinite(s, CFG)[0].onset_step == 0


@pytest.mark.parametrize("in_a_row", [CFG.skipped_run_steps - 1, CFG.skipped_run_steps])
def test_a_collapsing_loss_scale_pages_from_the_first_skip_of_the_run(series, in_a_row: int) -> None:
    s = _skipping(series, 3000, [10, 11] + list(range(2500, 2500 + in_a_row)))
    found = detect_nonfinite(s, CFG)
    if in_a_row < CFG.skipped_run_steps:
        assert found == []
        return
    (f,) = found
    assert (f.severity, f.onset_step, f.last_step, f.magnitude) == ("page", 2500, 2500 + in_a_row - 1, in_a_row)
    assert f.active and "loss scale is collapsing" in f.summary


def test_an_applied_nonfinite_step_pages_beside_skipped_ones(series) -> None:
    """A non-finite gradient the optimizer applied (no scaler, or one that missed it) pages at once;
    the routine skips are named in the summary, not counted."""
    s = _skipping(series, 1000, [0, 1, 2])
    s.steps.grad_norm[700] = math.inf
    (f,) = detect_nonfinite(s, CFG)
    assert (f.onset_step, f.magnitude) == (700, 1.0)
    assert "and 3 skipped by the loss scaler" in f.summary


def test_a_skipped_steps_norm_is_no_spike(series) -> None:
    """A loss scaler that skips on its own finite test (a norm cap) leaves a large norm that was
    never applied: not a spike of the run's trajectory."""
    gn = _gn(3000)
    gn[[1500, 2200]] *= 4.0
    s = series(3000, grad_norm=gn)
    s.steps.skipped = np.zeros(3000, dtype=bool)
    s.steps.skipped[1500] = True
    found = _kinds(detect_spikes(s, suppression_for(s, SuppressionConfig()), CFG))
    assert found["grad_spike"].magnitude == 1 and found["grad_spike"].onset_step == 2200


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        GradNormConfig(spike_ratio=1.0)
    with pytest.raises(ValueError):
        GradNormConfig(min_episodes=1)
