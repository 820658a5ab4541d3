"""Liveness and Prometheus exposition."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from trainvitals.service.api.deps import SessionDep

router = APIRouter(tags=["ops"])


@router.get("/healthz", summary="Liveness: the process serves and the database answers")
def healthz(session: SessionDep) -> dict[str, str]:
    session.execute(text("SELECT 1"))
    return {"status": "ok"}


@router.get("/metrics", summary="Prometheus exposition", response_class=Response)
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
