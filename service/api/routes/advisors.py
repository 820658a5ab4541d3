"""Advisor routes: cost model (plan / recommend), checkpoint cadence (from inputs or from a run's
observed saves and failures). The advisors are pure functions; these routes only adapt."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, HTTPException

from trainvitals.service import advisors
from trainvitals.service.advisors.recommend import recommend_from_config
from trainvitals.service.analysis import expectations
from trainvitals.service.api.deps import PrincipalDep, SessionDep, readable_run
from trainvitals.service.store import queries

router = APIRouter(prefix="/v1", tags=["advisors"])

JsonBody = Annotated[dict[str, Any], Body()]


def _bad(exc: Exception) -> HTTPException:
    return HTTPException(422, str(exc))


@router.post("/plan", summary="Predicted memory, step time and MFU for a parallelism config")
def plan(config: JsonBody) -> dict[str, Any]:
    try:
        return advisors.plan(advisors.parse_plan_input(config)).as_dict()
    except ValueError as exc:
        raise _bad(exc) from exc


@router.post("/plan/recommend", summary="Climb the parallelism ladder for a model and cluster")
def recommend(config: JsonBody) -> dict[str, Any]:
    try:
        return recommend_from_config(config).as_dict()
    except ValueError as exc:
        raise _bad(exc) from exc


@router.post("/advise/checkpoints", summary="Checkpoint interval and retention from explicit inputs")
def advise(inputs: JsonBody) -> dict[str, Any]:
    try:
        return advisors.advise_cadence(advisors.CadenceInputs(**inputs)).as_dict()
    except (TypeError, ValueError) as exc:
        raise _bad(exc) from exc


@router.get("/runs/{run_id}/advice/checkpoints", summary="Cadence advice from the run's observed saves and failures")
def advise_run(run_id: str, session: SessionDep, principal: PrincipalDep, mtbf_s: float | None = None,
               restart_s: float = 600.0, detect_s: float = 60.0, sdc_latency_s: float | None = None) -> dict[str, Any]:
    readable_run(session, principal, run_id)
    run = queries.get_run(session, run_id=run_id)
    assert run is not None
    try:
        result, saves, failures = expectations.run_checkpoint_advice(
            session, run_id=run_id, registration=run.registration, mtbf_s=mtbf_s, restart_s=restart_s,
            detect_s=detect_s, sdc_latency_s=sdc_latency_s)
    except ValueError as exc:
        raise _bad(exc) from exc
    return {"run": run_id, "observed_saves": saves, "observed_failures": failures, **result.as_dict()}
