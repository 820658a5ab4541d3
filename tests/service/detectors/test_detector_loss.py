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


def _bumped(n: int, bumps: list[tuple[int, float, float]], keep: float = 0.0) -> np.ndarray:
    """The quiet loss with +nats bumps at steps, each decaying with its time constant; `keep` of the
    last bump's height stays (a bump that does not recover)."""
    t = np.arange(n, dtype=float)
    log_bump = np.zeros(n)
    for at, nats, tau in bumps:
        log_bump += np.where(t >= at, nats * np.exp(-np.clip(t - at, 0, None) / tau), 0.0)
    if keep:
        log_bump += np.where(t >= bumps[-1][0], keep * bumps[-1][1], 0.0)
    return _loss(n) * np.exp(log_bump)


@pytest.mark.parametrize(
    ("bumps", "keep", "severity", "paged_after_fire"),
    [
        ([(3000, 0.5, 40)], 0.0, "ticket", None),  # benign: back within ~150 steps
        ([(3000, 0.5, 100)], 0.0, "ticket", None),  # benign: back within ~350 steps
        ([(3000, 0.4, 60)], 0.6, "page", 500),  # settles 0.24 nats up: persistence pages
        ([(2500, 0.4, 60), (3500, 0.4, 60)], 0.0, "page", None),  # recurrence pages at the 2nd
    ],
)
def test_a_bump_is_a_ticket_until_it_persists_or_recurs(
    series, bumps: list[tuple[int, float, float]], keep: float, severity: str, paged_after_fire: int | None
) -> None:
    s = series(5000, loss=_bumped(5000, bumps, keep))
    (f,) = detect_divergence(s, suppression_for(s, SuppressionConfig()), CFG)
    assert f.severity == severity and f.detected_step is not None
    assert abs(f.onset_step - bumps[0][0]) <= 5 and f.detected_step - bumps[0][0] <= 40
    if severity == "ticket":
        assert f.paged_step is None and not f.active and "closes when the loss is back" in f.summary
        assert f.magnitude > 1.3  # a resolved bump reports its peak
    elif paged_after_fire is not None:
        assert f.paged_step == f.detected_step + paged_after_fire and f.active
    else:
        assert f.paged_step is not None and bumps[1][0] < f.paged_step <= bumps[1][0] + 40
        assert "recurred" in f.summary


def test_a_climbing_loss_pages_before_the_persistence_limit(series) -> None:
    n = 4000
    t = np.arange(n)
    loss = _loss(n) * np.exp(0.6 * (np.clip(t - 3000, 0, None) / 300) ** 2)
    s = series(n, loss=loss)
    (f,) = detect_divergence(s, suppression_for(s, SuppressionConfig()), CFG)
    assert f.severity == "page" and f.paged_step is not None and f.detected_step is not None
    assert f.paged_step - f.detected_step < CFG.page_persist_steps
    # Live, just before it paged, the same finding was a ticket.
    early = series(f.paged_step, loss=loss[: f.paged_step])
    (g,) = detect_divergence(early, suppression_for(early, SuppressionConfig()), CFG)
    assert g.severity == "ticket" and g.detected_step == f.detected_step and g.onset_step == f.onset_step


@pytest.mark.parametrize(
    ("shape", "expect"),
    [
        ("flat", False),  # the healthy decay
        ("bump", False),  # one benign bump lifts a block or two: not a steady climb
        ("ramp", True),  # 3x over 35k steps from step 3000: ~0.3% per 100 steps
    ],
)
def test_slow_climb_is_a_trend(series, shape: str, expect: bool) -> None:
    from trainvitals.service.detectors.loss import detect_trend

    n = 12_000
    t = np.arange(n)
    loss = _loss(n)
    if shape == "ramp":
        loss = loss * np.exp(math.log(3.0) * np.clip(t - 3000, 0, None) / 35_000)
    elif shape == "bump":
        loss = _bumped(n, [(5000, 0.5, 100)])
    s = series(n, loss=loss)
    sup = suppression_for(s, SuppressionConfig())
    found = detect_trend(s, sup, CFG)
    assert bool(found) is expect
    assert not detect_divergence(s, sup, CFG) or shape == "bump"  # the short-window test is blind to it
    if expect:
        (f,) = found
        assert f.kind == "loss_trend" and f.active and f.detected_step is not None
        assert 2500 <= f.onset_step <= 4000 and f.detected_step - 3000 <= 3500
        assert f.severity == "page" and f.paged_step is not None  # 25% above the low by step ~12k
        seen = float(np.median(loss[f.detected_step - 250 : f.detected_step]) / np.median(loss[2750:3000]))
        assert seen < 1.12  # found while the climb is still small
