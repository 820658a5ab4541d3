"""Property: every cadence input gets either an answer of finite numbers or a one-line ValueError
(the CLI's exit 2, the route's 422); never another exception, inf or NaN."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from trainvitals.service.advisors.cadence import CadenceInputs, TierSpec, advise_cadence

_ANY = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(10**12), 10**12)
_SANE = st.floats(min_value=1e-3, max_value=1e9)


def _finite(value: object) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for k, v in value.items() if k != "tiers")
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


@settings(max_examples=300, deadline=None)
@given(
    stall=_ANY | _SANE, mtbf=st.none() | _ANY | _SANE, persist=_ANY | st.just(0.0), restart=_ANY | _SANE,
    latency=st.none() | _ANY | _SANE, risk=_ANY | st.floats(1e-9, 0.5), ckpt=st.none() | _ANY,
    budget=st.none() | _ANY, tolerance=_ANY | st.just(0.05),
    mix=st.none() | st.dictionaries(st.sampled_from(["node", "rack", "galaxy"]), _ANY, max_size=3),
    tier_cost=st.none() | _ANY | _SANE,
)
def test_every_input_gets_an_answer_or_a_one_line_error(stall, mtbf, persist, restart, latency, risk, ckpt,
                                                        budget, tolerance, mix, tier_cost) -> None:
    try:
        tiers = () if tier_cost is None else (TierSpec(name="ram", cost_s=tier_cost, survives="node"),)
        advice = advise_cadence(CadenceInputs(
            stall_s=stall, mtbf_s=mtbf, persist_s=persist, restart_s=restart, sdc_latency_s=latency,
            acceptable_risk=risk, checkpoint_bytes=ckpt, storage_budget_bytes=budget, basin_tolerance=tolerance,
            radius_mix=mix, tiers=tiers))
    except ValueError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    out = advice.as_dict()
    assert _finite(out), out  # tier intervals may be inf (no incident reaches the tier)
    assert 0 < out["recommended_interval_s"] and 0 <= out["expected_waste"] <= 1
    assert out["retention"]["keep"] >= 1
