"""Advisor routes: cost model (plan / recommend), checkpoint cadence (from inputs or from a run's
observed saves and failures). The advisors are pure functions; these routes only adapt.

A body of the wrong shape is refused by its request model (422 naming the field); a value the
advisor refuses is a ValueError naming the key (422 with that message as detail).

The advisors read no project's data, but each call costs CPU: the POST routes need a read token
(of any project; anyone when auth is off), checked before the body is read, take bodies of at most 1 MiB
(http_limits.SMALL_BODY_BYTES; 413 otherwise, also for a chunked body) and the request models
cap the sizes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query

from trainvitals.service import advisors
from trainvitals.service.advisors.cadence import MAX_SECONDS as _MAX_SECONDS
from trainvitals.service.advisors.recommend import recommend_from_config
from trainvitals.service.analysis import expectations
from trainvitals.service.api.deps import (
    AuthenticatedFirst,
    KnownQueryOnly,
    PrincipalDep,
    ReadableRun,
    SessionDep,
    require,
)
from trainvitals.service.api.schemas import (
    CadenceAdvicePublic,
    CadenceRequest,
    PlanPublic,
    PlanRequest,
    RecommendationPublic,
    RecommendRequest,
    RunCadenceAdvicePublic,
)
from trainvitals.service.store import run_keys


def _reader(principal: PrincipalDep) -> None:
    """403 unless the token has read scope (any project's: the advisors read no project's data)."""
    if principal.project is not None:
        require(principal, "read", principal.project)


router = APIRouter(prefix="/v1", tags=["advisors"], dependencies=[KnownQueryOnly], route_class=AuthenticatedFirst)
ReaderOnly = Depends(_reader)


def _bad(exc: Exception) -> HTTPException:
    return HTTPException(422, str(exc))


@router.post(
    "/plan", summary="Predicted memory, step time and MFU for a parallelism config", dependencies=[ReaderOnly]
)
def plan(body: PlanRequest) -> PlanPublic:
    try:
        result = advisors.plan(advisors.parse_plan_input(body.as_config()))
    except ValueError as exc:
        raise _bad(exc) from exc
    return PlanPublic.model_validate(result.as_dict())


@router.post(
    "/plan/recommend", summary="Climb the parallelism ladder for a model and cluster", dependencies=[ReaderOnly]
)
def recommend(body: RecommendRequest) -> RecommendationPublic:
    try:
        result = recommend_from_config(body.as_config())
    except ValueError as exc:
        raise _bad(exc) from exc
    return RecommendationPublic.model_validate(result.as_dict())


@router.post(
    "/advise/checkpoints",
    summary="Checkpoint interval and retention from explicit inputs",
    dependencies=[ReaderOnly],
)
def advise(body: CadenceRequest) -> CadenceAdvicePublic:
    try:
        result = advisors.advise_cadence(body.as_inputs())
    except ValueError as exc:  # the request model has checked the types; TierSpec/CadenceInputs the values
        raise _bad(exc) from exc
    return CadenceAdvicePublic.model_validate(result.as_dict())




@router.get("/runs/{run_id}/advice/checkpoints", summary="Cadence advice from the run's observed saves and failures")
def advise_run(
    run: ReadableRun,
    session: SessionDep,
    mtbf_s: Annotated[float | None, Query(gt=0, le=_MAX_SECONDS, allow_inf_nan=False)] = None,
    restart_s: Annotated[float, Query(ge=0, le=_MAX_SECONDS, allow_inf_nan=False)] = 600.0,
    detect_s: Annotated[float, Query(ge=0, le=_MAX_SECONDS, allow_inf_nan=False)] = 60.0,
    sdc_latency_s: Annotated[float | None, Query(ge=0, le=_MAX_SECONDS, allow_inf_nan=False)] = None,
) -> RunCadenceAdvicePublic:
    try:
        result, saves, failures = expectations.run_checkpoint_advice(
            session,
            run_id=run.run_id,
            registration=run.registration,
            mtbf_s=mtbf_s,
            restart_s=restart_s,
            detect_s=detect_s,
            sdc_latency_s=sdc_latency_s,
        )
    except ValueError as exc:
        raise _bad(exc) from exc
    return RunCadenceAdvicePublic.model_validate(
        {
            "run": run_keys.run_id_of(run.run_id),
            "observed_saves": saves,
            "observed_failures": failures,
            **result.as_dict(),
        }
    )
