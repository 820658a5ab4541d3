"""Loss divergence and non-finite loss."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainvitals.service.detectors.loss import LossConfig, detect_divergence, detect_nonfinite_loss
from trainvitals.service.detectors.series import RunEvent
from trainvitals.service.detectors.suppression import SuppressionConfig, suppression_for

CFG = LossConfig()


def _loss(n: int, seed: int = 0) -> np.ndarray:
    t = np.arange(n)
    return (2.0 + 1.0 / np.sqrt(1 + t / 100)) * np.exp(np.random.default_rng(seed).normal(0, 0.01, n))


@pytest.mark.parametrize(
    ("rise", "expect"),
    [
        (0.0, False),  # healthy decay
        (0.02, False),  # +2%: below the 5% floor
        (0.30, True),  # +30% from step 2000
    ],
)
def test_divergence_against_own_level(series, rise: float, expect: bool) -> None:
    n = 3000
    t = np.arange(n)
    loss = _loss(n) * np.exp(rise * np.clip((t - 2000) / 200, 0, 1))
    s = series(n, loss=loss)
    found = detect_divergence(s, suppression_for(s, SuppressionConfig()), CFG)
    assert bool(found) is expect
    if expect:
        f = found[0]
        assert f.severity == "page" and 1980 <= f.onset_step <= 2100 and f.active
        assert f.detected_step is not None and f.onset_step < f.detected_step <= 2200


def test_short_blips_do_not_count(series) -> None:
    loss = _loss(3000)
    loss[[1500, 1501, 1502, 2200]] *= 3.0  # a few bad batches
    s = series(3000, loss=loss)
    assert detect_divergence(s, suppression_for(s, SuppressionConfig()), CFG) == []


def test_phase_change_level_shift_is_suppressed(series) -> None:
    n = 3000
    loss = _loss(n) * np.where(np.arange(n) >= 1500, 1.08, 1.0)
    plain = series(n, loss=loss)
    assert detect_divergence(plain, suppression_for(plain, SuppressionConfig()), CFG)
    annotated = series(n, loss=loss, events=[RunEvent(event="phase_change", ts=0.0, step=1500)])
    assert detect_divergence(annotated, suppression_for(annotated, SuppressionConfig()), CFG) == []


def test_baseline_run_cancels_a_shared_shape(series) -> None:
    """A bump both runs share (same data at the same step) is not divergence against the baseline."""
    n = 3000
    bump = np.exp(0.2 * np.exp(-(((np.arange(n) - 2000) / 100.0) ** 2)))
    run = series(n, loss=_loss(n, seed=1) * bump, seed=1)
    base = series(n, loss=_loss(n, seed=2) * bump, seed=2)
    base.run = "baseline-run"
    sup = suppression_for(run, SuppressionConfig())
    assert detect_divergence(run, sup, CFG)  # alone: the bump looks like divergence
    assert detect_divergence(run, sup, CFG, baseline=base) == []
    diverging = series(n, loss=_loss(n, seed=1) * bump * np.where(np.arange(n) > 2500, 1.3, 1.0), seed=1)
    (f,) = detect_divergence(diverging, sup, CFG, baseline=base)
    assert "baseline run baseline-run" in f.summary and 2480 <= f.onset_step <= 2510


def test_nonfinite_loss(series) -> None:
    s = series(500)
    s.steps.loss[300] = math.inf
    (f,) = detect_nonfinite_loss(s, CFG)
    assert f.severity == "page" and f.onset_step == 300
    s2 = series(500)
    s2.steps.loss[300] = math.nan  # unknown, unless a rank reported it
    assert detect_nonfinite_loss(s2, CFG) == []
    s2.steps.loss_nonfinite = np.zeros(500, dtype=np.int64)
    s2.steps.loss_nonfinite[300] = 2
    assert detect_nonfinite_loss(s2, CFG)[0].onset_step == 300
