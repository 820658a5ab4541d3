"""Post-mortem read routes: runs, tensor timelines, worst tensors, step-time matrix, findings,
checkpoint generations, rollback target. JSON by default, `?format=csv` for CSV."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Query, Response, status

from trainvitals.service.api.deps import PrincipalDep, SessionDep, readable_run, require
from trainvitals.service.csv_output import to_csv
from trainvitals.service.store import queries

router = APIRouter(prefix="/v1/runs", tags=["post-mortem"])

Format = Literal["json", "csv"]


def _reply(data: Any, fmt: Format) -> Any:
    if fmt == "csv":
        return Response(to_csv(data), media_type="text/csv")
    return data


@router.get("", summary="List runs (of the token's project)")
def list_runs(
    session: SessionDep, principal: PrincipalDep, project: str | None = None, format: Format = "json"
) -> Any:
    if principal.project is not None:
        require(principal, "read", project or principal.project)
        project = principal.project
    runs = [
        {
            "run": r.run_id,
            "project": r.project,
            "status": r.status,
            "world_size": r.world_size,
            "created_at": r.created_at,
            "last_seen_at": r.last_seen_at,
        }
        for r in queries.list_runs(session, project=project)
    ]
    return _reply(runs, format)


@router.get("/{run_id}", summary="One run: overview of what was stored")
def get_run(run_id: str, session: SessionDep, principal: PrincipalDep, format: Format = "json") -> Any:
    readable_run(session, principal, run_id)
    overview = queries.run_overview(session, run_id=run_id)
    assert overview is not None
    return _reply(dataclasses.asdict(overview), format)


@router.delete(
    "/{run_id}", status_code=status.HTTP_204_NO_CONTENT, summary="Delete a run and all its records"
)
def delete_run(run_id: str, session: SessionDep, principal: PrincipalDep) -> None:
    run = queries.get_run(session, run_id=run_id)
    if run is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r}")
    require(principal, "ingest", run.project)  # deleting is a write
    queries.delete_run(session, run_id=run_id)


@router.get("/{run_id}/tensors/worst", summary="Tensors with the least FP8 headroom in a step range")
def worst_tensors(
    run_id: str,
    session: SessionDep,
    principal: PrincipalDep,
    start: int | None = None,
    end: int | None = None,
    k: int = Query(10, ge=1, le=1000),
    format: Format = "json",
) -> Any:
    readable_run(session, principal, run_id)
    return _reply(queries.worst_tensors(session, run_id=run_id, start=start, end=end, k=k), format)


@router.get("/{run_id}/tensors/{tensor}/timeline", summary="A tensor's headroom / amax per step")
def tensor_timeline(
    run_id: str,
    tensor: str,
    session: SessionDep,
    principal: PrincipalDep,
    role: Literal["input", "weight", "grad_output"] | None = None,
    start: int | None = None,
    end: int | None = None,
    format: Format = "json",
) -> Any:
    readable_run(session, principal, run_id)
    rows = queries.tensor_timeline(session, run_id=run_id, tensor=tensor, role=role, start=start, end=end)
    return _reply(rows, format)


@router.get("/{run_id}/ranks/step-times", summary="Per-rank step time matrix for a step range")
def step_times(
    run_id: str,
    session: SessionDep,
    principal: PrincipalDep,
    start: int = Query(ge=0),
    end: int = Query(ge=0),
    format: Format = "json",
) -> Any:
    readable_run(session, principal, run_id)
    if end < start or end - start > 100_000:
        raise HTTPException(
            422, "need start <= end and at most 100000 steps"
        )
    return _reply(queries.step_time_matrix(session, run_id=run_id, start=start, end=end), format)


@router.get("/{run_id}/findings", summary="Detector findings with onset steps")
def findings(
    run_id: str, session: SessionDep, principal: PrincipalDep, active: bool = False, format: Format = "json"
) -> Any:
    readable_run(session, principal, run_id)
    return _reply(queries.findings(session, run_id=run_id, active_only=active), format)


@router.get("/{run_id}/checkpoints", summary="Checkpoint generations with status across ranks")
def checkpoints(run_id: str, session: SessionDep, principal: PrincipalDep, format: Format = "json") -> Any:
    readable_run(session, principal, run_id)
    return _reply(queries.checkpoint_generations(session, run_id=run_id), format)


@router.get("/{run_id}/rollback", summary="Which checkpoint generation to roll back to")
def rollback(
    run_id: str,
    session: SessionDep,
    principal: PrincipalDep,
    before_step: int | None = None,
    format: Format = "json",
) -> Any:
    readable_run(session, principal, run_id)
    return _reply(queries.rollback_target(session, run_id=run_id, before_step=before_step), format)
