"""Run read routes (post-mortem queries grow here)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, HTTPException, status

from trainvitals.service.api.deps import SessionDep
from trainvitals.service.store import queries

router = APIRouter(prefix="/v1/runs", tags=["runs"])


@router.get("", summary="List runs")
def list_runs(session: SessionDep, project: str | None = None) -> list[dict[str, Any]]:
    return [
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


@router.get("/{run_id}", summary="One run: registration and overview")
def get_run(run_id: str, session: SessionDep) -> dict[str, Any]:
    overview = queries.run_overview(session, run_id=run_id)
    if overview is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r}")
    return dataclasses.asdict(overview)


@router.delete("/{run_id}", status_code=status.HTTP_204_NO_CONTENT, summary="Delete a run and its records")
def delete_run(run_id: str, session: SessionDep) -> None:
    if not queries.delete_run(session, run_id=run_id):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r}")
