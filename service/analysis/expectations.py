"""The collector's use of the advisors for a live run: the MFU the cost model predicts for its
config (the MFU-gap detector's expectation) and checkpoint-cadence advice from what it observed."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from sqlalchemy.orm import Session

from trainvitals.service.store import queries


class MfuExpectation(NamedTuple):
    predicted: float
    low: float | None
    """The prediction interval's ends (None for a `tags.expected_mfu`, which has no interval)."""
    high: float | None
    in_domain: bool = True
    """False when the config lies outside the calibrated domain (the band is widened for it)."""


def mfu_expectation(registration: dict[str, Any]) -> MfuExpectation | None:
    """The cost model's prediction for the run's config, with its interval; a `tags.expected_mfu`
    overrides it. None when the registration lacks what the model needs."""
    tag = (registration.get("tags") or {}).get("expected_mfu")
    if tag is not None:
        try:
            return MfuExpectation(float(tag), None, None)
        except ValueError:
            return None
    try:
        from trainvitals.service.advisors import predict_mfu

        pred = predict_mfu(registration)
    except Exception:  # noqa: BLE001 - an incomplete registration has no prediction
        return None
    if not all(math.isfinite(v) for v in (pred.predicted, pred.low, pred.high)):
        return None
    return MfuExpectation(float(pred.predicted), float(pred.low), float(pred.high), pred.in_domain)


def expected_mfu(registration: dict[str, Any]) -> float | None:
    """The point prediction alone (the MFU-gap detector's expectation)."""
    e = mfu_expectation(registration)
    return e.predicted if e is not None else None


def expected_mfu_low(registration: dict[str, Any]) -> float | None:
    """The band's low end, under which the cost model cannot explain the run's MFU (None for a
    configured `tags.expected_mfu`, which has no band)."""
    e = mfu_expectation(registration)
    return e.low if e is not None else None


def run_checkpoint_advice(session: Session, *, run_id: str, registration: dict[str, Any],
                          mtbf_s: float | None = None, restart_s: float = 600.0, detect_s: float = 60.0,
                          sdc_latency_s: float | None = None) -> tuple[Any, int, int]:
    """(CadenceAdvice, saves seen, failures seen) from the run's observed saves and failure events.
    MTBF: the argument, else `tags.mtbf_s` of the registration, else the observed failures alone.
    ValueError (naming what is missing) when there is not enough to advise."""
    from trainvitals.service.advisors import advise_from_records

    saves, failures, exposure = queries.observed_cadence_inputs(session, run_id=run_id)
    if mtbf_s is None and (tag := (registration.get("tags") or {}).get("mtbf_s")) is not None:
        mtbf_s = float(tag)
    result = advise_from_records(saves, failures, exposure_s=exposure or None, mtbf_s=mtbf_s,
                                 restart_s=restart_s, detect_s=detect_s, sdc_latency_s=sdc_latency_s)
    return result, len(saves), len(failures)


def checkpoint_advice(session: Session, *, run_id: str, registration: dict[str, Any]) -> Any | None:
    """For /metrics: the advice, or None while there is not enough to advise."""
    try:
        return run_checkpoint_advice(session, run_id=run_id, registration=registration)[0]
    except ValueError:
        return None
