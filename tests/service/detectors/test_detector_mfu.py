"""MFU gap against the expected MFU."""

from __future__ import annotations

import numpy as np
import pytest

from trainvitals.service.detectors.mfu import MfuConfig, detect_mfu_gap
from trainvitals.service.detectors.suppression import SuppressionConfig, suppression_for

PEAK = 8e15


def _run(series, step_seconds: np.ndarray, expected: float | None):
    n = len(step_seconds)
    s = series(n)
    s.steps.step_seconds = step_seconds
    s.steps.flops = np.full(n, 0.4 * PEAK * 1.0)  # MFU 0.40 at 1.0 s per step
    s.expected_mfu = expected
    s.peak_flops_total = PEAK
    s.steps.mfu = s.steps.flops / (step_seconds * PEAK)  # the reduction's stored MFU
    return detect_mfu_gap(s, suppression_for(s, SuppressionConfig()), MfuConfig())


@pytest.mark.parametrize(
    ("slowdown", "expected", "expect"),
    [
        (1.0, 0.41, False),  # on target
        (1.0, None, False),  # no expectation: silent
        (1.08, 0.41, False),  # gap 10%, 7 points worse than its own early gap: below both tests
        (1.5, 0.41, True),  # gap 35%
    ],
)
def test_gap(series, slowdown: float, expected: float | None, expect: bool) -> None:
    sec = np.ones(3000)
    sec[1800:] *= slowdown
    found = _run(series, sec, expected)
    assert bool(found) is expect
    if expect:
        (f,) = found
        assert f.kind == "mfu_gap" and f.severity == "ticket" and f.onset_step == 1800
        assert f.magnitude == pytest.approx(1 - 0.4 / 1.5 / 0.41, abs=0.01)
        assert f.detected_step == 2399  # three 200-step windows


def test_gap_against_own_early_level(series) -> None:
    """Gap 5% early on, then 18% (under the absolute 20%) : 13 points worse than its own level fires."""
    sec = np.ones(3000)
    sec[2000:] *= 1.15
    (f,) = _run(series, sec, 0.40 / 0.95)
    assert f.onset_step == 2000 and 0.15 < f.magnitude < 0.2


def test_one_slow_window_is_not_a_gap(series) -> None:
    sec = np.ones(3000)
    sec[2000:2200] *= 2.0
    assert _run(series, sec, 0.41) == []
