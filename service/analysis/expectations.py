"""The collector's use of the advisors for a live run: the MFU the cost model predicts for its
config (the MFU-gap detector's expectation) and checkpoint-cadence advice from what it observed."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy.orm import Session

from trainvitals.service.store import queries


def expected_mfu(registration: dict[str, Any]) -> float | None:
    """The cost model's prediction for the run's config; a `tags.expected_mfu` overrides it."""
    tag = (registration.get("tags") or {}).get("expected_mfu")
    if tag is not None:
        try:
            return float(tag)
        except ValueError:
            return None
    try:
        from trainvitals.service.advisors import predict_mfu

        pred = predict_mfu(registration)
    except Exception:  # noqa: BLE001 - an incomplete registration has no prediction
        return None
    value = getattr(pred, "predicted", None)
    return float(value) if value is not None and math.isfinite(value) else None


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
