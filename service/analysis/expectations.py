"""The collector's use of the advisors for a live run: the MFU the cost model predicts for its
config (the MFU-gap detector's expectation) and checkpoint-cadence advice from what it observed.

The cost model quotes MFU in the convention its calibration tables use (N counting the embedding
tables, cost_model.FLOP_CONVENTION); a run's MFU is measured in the run's (wire FLOPS_CONVENTION:
N non-embedding, the input table left out, an output head counted). The same predicted step time
read in the two conventions differs by the embeddings' share (a 1B Llama's 6N: ~20%), which alone
would fire the gap detector on a run at exactly the predicted speed: so the prediction is restated
in the run's convention before it is compared.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy.orm import Session

from trainvitals.service.store import queries
from trainvitals.wire.conventions import FLOPS_CONVENTION

if TYPE_CHECKING:
    from trainvitals.service.advisors.model_config import PlanInput


class MfuExpectation(NamedTuple):
    predicted: float
    low: float | None
    """The prediction interval's ends (None for a `tags.expected_mfu`, which has no interval)."""
    high: float | None
    in_domain: bool = True
    """False when the config lies outside the calibrated domain (the band is widened for it)."""
    convention: str = FLOPS_CONVENTION
    """The FLOP convention of the numbers: the measured MFU's, which the prediction is restated in."""


def mfu_expectation(registration: dict[str, Any]) -> MfuExpectation | None:
    """The cost model's prediction for the run's config, with its interval, restated in the
    measured FLOP convention (module docstring); a `tags.expected_mfu` overrides it. None when the
    registration lacks what the model needs."""
    tag = (registration.get("tags") or {}).get("expected_mfu")
    if tag is not None:
        try:  # a number from a healthy run of the job: measured, so in the measured convention
            declared = registration.get("flops_convention") or FLOPS_CONVENTION
            return MfuExpectation(float(tag), None, None, convention=declared)
        except ValueError:
            return None
    try:
        from trainvitals.service.advisors.cost_model import model_flops_per_token, plan
        from trainvitals.service.advisors.model_config import parse_plan_input

        plan_input = parse_plan_input(registration, strict=False)
        pred = plan(plan_input).mfu
        # Same predicted time, the run's FLOPs per token: MFU scales with the FLOPs counted.
        scale = run_flops_per_token(registration, plan_input) / model_flops_per_token(plan_input)
    except Exception:  # noqa: BLE001 - an incomplete registration has no prediction
        return None
    values = (pred.predicted * scale, pred.low * scale, pred.high * scale)
    if not all(math.isfinite(v) and v > 0 for v in values):
        return None
    return MfuExpectation(*values, pred.in_domain, _convention(registration))


def run_flops_per_token(registration: dict[str, Any], plan_input: PlanInput) -> float:
    """FLOPs per token in the measured convention (FLOPS_CONVENTION, full training): the
    registration's N (what the agent counted from the parameters) where it gives one, else the
    shape's active parameters less the input embedding table (a tied table stays: it is the head)."""
    m = plan_input.model
    n = (registration.get("model") or {}).get("non_embedding_params")
    if not n:
        n = m.params_active - (0 if m.tied_embeddings else m.vocab * m.hidden)
    return 6.0 * float(n) + 12.0 * m.layers * m.attention_width * m.seq_len


def _convention(registration: dict[str, Any]) -> str:
    """The convention to quote with the comparison: the prediction is restated in FLOPS_CONVENTION;
    a job that counts its FLOPs another way (its own `flops_convention`) is told both."""
    declared = registration.get("flops_convention")
    if declared and declared != FLOPS_CONVENTION:
        return f"'{declared}' (measured), '{FLOPS_CONVENTION}' (predicted)"
    return FLOPS_CONVENTION


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
