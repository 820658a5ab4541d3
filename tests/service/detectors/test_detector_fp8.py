"""FP8 detectors: table tests on hand-made tensor series."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from trainvitals.service.detectors import detect
from trainvitals.service.detectors.fp8 import Fp8Config, detect_fp8
from trainvitals.service.detectors.series import RunEvent
from trainvitals.service.detectors.suppression import SuppressionConfig, suppression_for
from trainvitals.testing.scenarios import make_scenario, prefix

CFG = Fp8Config()
N = 4000


def _h(seed: int = 0) -> np.ndarray:
    return 0.3 + np.random.default_rng(seed).normal(0, 0.08, N)


def _run(series, tensors, events=None) -> list:
    s = series(len(tensors[0].steps), events=events or [])
    s.tensors = tensors
    return detect_fp8(tensors, "t", suppression_for(s, SuppressionConfig()), CFG)


def _by_kind(found: list) -> dict:
    return {f.kind: f for f in found}


def test_quiet_tensor_has_no_findings(series, tensor) -> None:
    assert _run(series, [tensor(_h())]) == []


@pytest.mark.parametrize(
    ("clip_steps", "headroom", "sat", "expect"),
    [
        ([2000, 2030, 2060], -1.5, np.nan, 2060),  # hard clips, saturation not measured
        ([2000, 2030, 2060], -0.2, 1e-3, 2000),  # shallow but saturating: the first measurement pages
        ([2000], -0.2, 1e-3, 2000),  # one expensive step (sat_frac is measured every 200 steps)
        ([2000], -0.01, 1e-4, None),  # a hair over (amax creep): less than E4M3's own rounding
        ([2000, 2030, 2060], -0.2, 1e-7, None),  # only the top few values: not clipping
        ([2000], -0.2, np.nan, None),  # shallow, saturation not measured: H < 0 alone is not a clip
        ([2000, 2030], -3.0, np.nan, None),  # two clips: a jump, not a regime
        ([2000, 2150, 2300], -2.0, np.nan, None),  # three clips, but not within 100 steps
    ],
)
def test_clipping(series, tensor, clip_steps: list[int], headroom: float, sat: float, expect: int | None) -> None:
    h = _h()
    s = np.full(N, np.nan)
    h[clip_steps] = headroom
    s[clip_steps] = sat
    found = _by_kind(_run(series, [tensor(h, sat=s)]))
    assert ("fp8_clipping" in found) is (expect is not None)
    if expect is not None:
        f = found["fp8_clipping"]
        assert f.severity == "page" and f.onset_step == 2000 and f.detected_step == expect
        assert f.subject_kind == "tensor" and f.subject == "layers.3.fc:input" and f.magnitude == headroom


def test_one_measured_saturation_of_an_e5m2_gradient_is_not_a_clip(series, tensor) -> None:
    """E5M2 overflows to inf rather than saturating (fp8_nonfinite's case): one step stays a jump."""
    h, s = _h(), np.full(N, np.nan)
    h[2000], s[2000] = -0.2, 1e-3
    found = _by_kind(_run(series, [tensor(h, sat=s, fmt="e5m2", role="grad_output")]))
    assert "fp8_clipping" not in found


@pytest.mark.parametrize("every", [20, 40, 80])
def test_clipping_of_a_sampled_shadow_tensor_is_three_of_five_samples_at_any_cadence(
    series, tensor, every: int
) -> None:
    """The agent samples shadow tensors every 20 steps, or every 40 or 80 where a sample is dear:
    100 steps then held 2 samples, and 3 clipped ones could never be seen."""
    n = 4000 // every
    h = _h()[:n]
    h[[30, 31, 32]] = -2.0  # three clipped samples in a row
    t = tensor(h, shadow=True)
    t.steps = np.arange(n, dtype=np.int64) * every
    (f,) = [f for f in _run(series, [t]) if f.kind == "fp8_clipping"]
    assert f.onset_step == 30 * every and f.detected_step == 32 * every
    h[32] = 0.3  # two of five: a jump, not a regime
    assert not [f for f in _run(series, [t]) if f.kind == "fp8_clipping"]


def test_shadow_tensor_is_information_only(series, tensor) -> None:
    h = _h()
    h[[2000, 2010, 2020]] = -2.0
    (f,) = [f for f in _run(series, [tensor(h, shadow=True)]) if f.kind == "fp8_clipping"]
    assert f.severity == "info" and f.paged_step is None
    assert f.summary.startswith("this run does not train in FP8; if FP8 (delayed scaling) were enabled here: ")
    nf = np.zeros(N)
    nf[2500] = 3
    (g,) = [g for g in _run(series, [tensor(_h(), nonfinite=nf, shadow=True)]) if g.kind == "fp8_nonfinite"]
    assert g.severity == "info" and "its own bf16/fp32 values" in g.summary


def test_shadow_run_keeps_what_if_findings_apart_from_pages_and_rollback() -> None:
    """The same amax creep, once in a run that trains in FP8 and once as the shadow monitor of a
    bf16 run: the FP8 run pages and has no rollback target before the onset once old checkpoints
    are gone; the bf16 run gets the same findings as information only, and no rollback page."""
    sc = make_scenario("fp8_amax_creep", 11)
    assert sc.loss_move_step is not None
    real = prefix(sc.series, sc.loss_move_step - 1)  # before the loss moves: FP8 findings only
    real.checkpoints = [c for c in real.checkpoints if c.step > 3800]  # none before the clipping (3,751)
    shadow = dataclasses.replace(real, tensors=[dataclasses.replace(t, shadow=True) for t in real.tensors])
    in_fp8, what_if = detect(real), detect(shadow)
    fp8_kinds = {f.kind for f in in_fp8 if f.kind.startswith("fp8_")}
    assert {"fp8_clipping", "fp8_headroom_trend"} <= fp8_kinds
    assert any(f.severity == "page" for f in in_fp8 if f.kind.startswith("fp8_"))
    assert any(f.kind == "no_rollback_target" and f.severity == "page" for f in in_fp8)
    assert {f.kind for f in what_if} == fp8_kinds  # the same findings, no rollback page
    assert all(f.severity == "info" and f.paged_step is None for f in what_if)
    assert all("this run does not train in FP8" in f.summary for f in what_if)


def test_big_jump_and_rising_jump_rate(series, tensor) -> None:
    lag = np.zeros(N)
    lag[2500] = 3.0
    assert _by_kind(_run(series, [tensor(_h(), lag=lag)]))["fp8_jump"].onset_step == 2500
    lag = np.zeros(N)
    lag[[2000, 2300, 2600]] = 1.5
    f = _by_kind(_run(series, [tensor(_h(), lag=lag)]))["fp8_jump"]
    assert f.severity == "ticket" and f.onset_step == 2000 and f.detected_step == 2600
    lag = np.zeros(N)
    lag[[1000, 3000]] = 1.5  # two isolated 1.5-bit jumps: not a rising rate
    assert "fp8_jump" not in _by_kind(_run(series, [tensor(_h(), lag=lag)]))


def test_headroom_trend_forecasts_exhaustion(series, tensor) -> None:
    t = np.arange(N)
    h = _h() - 0.0005 * np.clip(t - 1500, 0, None)  # -0.5 bits per 1k steps from step 1500
    f = _by_kind(_run(series, [tensor(h)]))["fp8_headroom_trend"]
    # Starting at 0.3 bits, zero is < 2,000 steps away once the trend is confirmed: it pages.
    assert f.severity == "page" and 1400 <= f.onset_step <= 2500
    # A trend needs a reference range before its fit window, so not before ~2.5k steps into a run.
    assert f.detected_step is not None and f.detected_step <= 3100
    # Seen live at its detection step, the forecast is ahead of it: about (0.3 + 1) / 0.5 * 1000 - 1500.
    live = _by_kind(_run(series, [tensor(h[: f.detected_step + 1])]))["fp8_headroom_trend"]
    assert 300 < live.magnitude < 2500 and live.detected_step == f.detected_step
    flat = _by_kind(_run(series, [tensor(_h(1))]))
    assert "fp8_headroom_trend" not in flat


def test_stale_scale_and_underflow_rise(series, tensor) -> None:
    h = _h()
    h[2000:2400] += 3.5  # a spike set a 'max' history: the scale is too small for 400 steps
    uf = np.full(N, np.nan)
    uf[::10] = 2e-4
    uf[2000:2400:10] = 2e-4 * 2**3.5
    found = _by_kind(_run(series, [tensor(h, underflow=uf)]))
    assert found["fp8_stale_scale"].onset_step == 2000 and found["fp8_stale_scale"].detected_step == 2099
    assert found["fp8_underflow_rise"].onset_step == 2000
    assert found["fp8_underflow_rise"].magnitude > 5


def _crest(high_from: int | None, *, level: float = 13.5, every: int = 200) -> np.ndarray:
    """Crest measured on expensive steps (every 200 by default), NaN between: 7 bits, then `level`
    from step `high_from` on."""
    c = np.full(N, np.nan)
    c[::every] = 7.0 + np.random.default_rng(3).normal(0, 0.3, len(c[::every]))
    if high_from is not None:
        c[high_from::every] = level
    return c


def test_a_sustained_e4m3_crest_above_12_bits_is_a_precision_ticket(series, tensor) -> None:
    (f,) = [f for f in _run(series, [tensor(_h(), crest=_crest(2000))]) if f.kind == "fp8_precision_crest"]
    assert f.severity == "ticket" and f.subject == "layers.3.fc:input" and f.active
    # The first raw sample above 12 bits; the 5-sample median crosses on the third, held one more sample.
    assert f.onset_step == 2000 and f.detected_step == 2600 and f.magnitude == 13.5
    assert "13.5 bits below its amax" in f.summary


@pytest.mark.parametrize(
    ("crest", "fmt", "why"),
    [
        (_crest(None), "e4m3", "a crest of 7 bits"),
        (_crest(2000, level=11.5), "e4m3", "below 12 bits"),
        (_crest(2000), "e5m2", "E5M2 has 15 bits more range below"),
    ],
)
def test_no_precision_ticket(series, tensor, crest: np.ndarray, fmt: str, why: str) -> None:
    found = _by_kind(_run(series, [tensor(_h(), crest=crest, fmt=fmt)]))
    assert "fp8_precision_crest" not in found, why


def test_one_or_two_high_crest_samples_are_not_a_precision_ticket(series, tensor) -> None:
    """One outlier batch's crest: the 5-sample median stays low."""
    c = _crest(None)
    c[[2000, 2400]] = 14.0
    assert "fp8_precision_crest" not in _by_kind(_run(series, [tensor(_h(), crest=c)]))


def test_a_crest_episode_that_ended_is_inactive_and_the_newest_one_is_reported(series, tensor) -> None:
    c = _crest(None)
    c[1000:1800:200] = 13.0  # 4 samples, then back to 7
    old = _by_kind(_run(series, [tensor(_h(), crest=c)]))["fp8_precision_crest"]
    assert old.onset_step == 1000 and not old.active
    c[3000::200] = 14.0
    new = _by_kind(_run(series, [tensor(_h(), crest=c)]))["fp8_precision_crest"]
    assert new.onset_step == 3000 and new.active and new.magnitude == 14.0


def test_a_shadow_tensors_high_crest_is_info(series, tensor) -> None:
    (f,) = [f for f in _run(series, [tensor(_h(), crest=_crest(2000), shadow=True)]) if f.kind == "fp8_precision_crest"]
    assert f.severity == "info" and f.summary.startswith("this run does not train in FP8")


@pytest.mark.parametrize("amax", [np.nan, np.inf])
def test_a_nonfinite_amax_between_expensive_steps_pages(series, tensor, amax: float) -> None:
    """Recipe tensors report amax every step; the element count only every 200 steps (NaN between)."""
    nf = np.full(N, np.nan)
    nf[::200] = 0
    t = tensor(_h(), nonfinite=nf, fmt="e5m2", role="grad_output")
    t.amax[3101] = amax
    (f,) = [f for f in _run(series, [t]) if f.kind == "fp8_nonfinite"]
    assert f.severity == "page" and f.onset_step == 3101 and f.magnitude == 0


def test_nonfinite_e5m2_gradient_pages(series, tensor) -> None:
    nf = np.zeros(N)
    nf[3100] = 4
    (f,) = _run(series, [tensor(_h(), nonfinite=nf, fmt="e5m2", role="grad_output")])
    assert f.kind == "fp8_nonfinite" and f.severity == "page" and f.onset_step == 3100
    assert "E5M2" in f.summary


@pytest.mark.parametrize(("first_step_headroom", "expect"), [(0.3, False), (-2.0, True), (5.0, True)])
def test_bad_first_step_after_resume(series, tensor, first_step_headroom: float, expect: bool) -> None:
    h = _h()
    h[3000] = first_step_headroom
    found = _by_kind(_run(series, [tensor(h)], events=[RunEvent(event="resume", ts=0.0, step=3000)]))
    assert ("fp8_resume_bad_step" in found) is expect
    assert "fp8_clipping" not in found  # the resume window suppresses the baseline detectors


@pytest.mark.parametrize(("bits_per_1k", "pages"), [(0.6, True), (0.15, False)])
def test_headroom_trend_pages_when_zero_is_near(series, tensor, bits_per_1k: float, pages: bool) -> None:
    """A 3-bit margin eaten steadily: paged while the forecast to zero is within 2,000 steps and
    before the headroom is gone; a slow fall stays a ticket."""
    t = np.arange(N * 2)
    h = 3.0 + np.random.default_rng(3).normal(0, 0.08, len(t)) - bits_per_1k / 1000 * np.clip(t - 1500, 0, None)
    found = _by_kind(_run(series, [tensor(h)]))
    if not pages:
        assert found.get("fp8_headroom_trend") is None or found["fp8_headroom_trend"].severity == "ticket"
        return
    f = found["fp8_headroom_trend"]
    zero = 1500 + int(3.0 / bits_per_1k * 1000)
    assert f.severity == "page" and f.paged_step is not None and f.detected_step is not None
    assert f.detected_step <= f.paged_step < zero - 500  # well before the headroom is gone
    assert zero - f.paged_step <= CFG.trend_page_horizon_steps + 1000
    assert "paged at step" in f.summary
    live = _by_kind(_run(series, [tensor(h[: f.paged_step])]))["fp8_headroom_trend"]
    assert live.severity == "ticket" and live.detected_step == f.detected_step
    (shadow,) = [g for g in _run(series, [tensor(h, shadow=True)]) if g.kind == "fp8_headroom_trend"]
    assert shadow.severity == "info" and shadow.paged_step is None


@pytest.mark.parametrize(
    ("pattern", "expect"),
    [
        ("sporadic_from_5000", True),  # ~1 per 150 steps from step 5000, never 3 within 100
        ("sporadic_throughout", False),  # the same rate all along: the tensor's own normal
        ("one_burst", False),  # 10 saturated steps within 150: a burst counts once per block
    ],
)
def test_sporadic_saturation_against_own_history(series, tensor, pattern: str, expect: bool) -> None:
    n = 10_000
    h = 0.3 + np.random.default_rng(0).normal(0, 0.08, n)
    if pattern == "one_burst":
        at = np.arange(5000, 5150, 15)
    else:
        at = np.arange(5000 if pattern == "sporadic_from_5000" else 400, n, 150)
        at = at + np.random.default_rng(1).integers(0, 50, len(at))
    h[at[at < n]] = -1.5
    found = _by_kind(_run(series, [tensor(h)]))
    assert ("fp8_saturation_rate" in found) is expect
    assert "fp8_clipping" not in found or pattern == "one_burst"
    if expect:
        f = found["fp8_saturation_rate"]
        assert f.severity == "ticket" and f.active and 5000 <= f.onset_step <= 5100
        assert f.detected_step is not None and f.detected_step <= 5000 + 2500
