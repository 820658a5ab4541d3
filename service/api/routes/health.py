"""Liveness and Prometheus exposition."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.core import Metric
from sqlalchemy.orm import Session, sessionmaker

from trainvitals.service.api.deps import PrincipalDep, require
from trainvitals.service.api.schemas import HealthPublic
from trainvitals.service.exposition import TrainvitalsCollector
from trainvitals.service.self_metrics import ProcessMetrics
from trainvitals.service.store import queries

router = APIRouter(tags=["ops"])

# The classic text format, whatever the Accept header: every Prometheus parses it, and
# generate_latest writes it. (prometheus_client 0.26's CONTENT_TYPE_LATEST says version=1.0.0.)
_CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


@router.get("/healthz", summary="Liveness: the process serves and the database answers")
async def healthz(request: Request) -> HealthPublic:
    # On the event loop and a thread of its own (main.py), never queued behind the worker threads
    # that decode large bodies or serve slow reads: a busy collector still answers its probe.
    state = request.app.state
    await asyncio.get_running_loop().run_in_executor(state.health_executor, _ping, state.sessionmaker)
    return HealthPublic(status="ok")


def _ping(sessionmaker: sessionmaker[Session]) -> None:
    with sessionmaker() as session:
        queries.ping(session)


@router.get(
    "/metrics",
    summary="Prometheus exposition (a read token sees its project's runs)",
    response_class=Response,
)
def metrics(request: Request, principal: PrincipalDep) -> Response:
    if principal.project is None:
        return Response(generate_latest(request.app.state.registry), media_type=_CONTENT_TYPE)
    if principal.scope != "read":
        require(principal, "read", principal.project)
    state = request.app.state
    return Response(
        generate_latest(_ProjectView(state.collector, state.process_metrics, principal.project)),
        media_type=_CONTENT_TYPE,
    )


class _ProjectView:
    """A registry-like view limited to one project's runs (generate_latest needs collect()); the
    collector's own families, which name no run or project, are in every view."""

    def __init__(self, collector: TrainvitalsCollector, process: ProcessMetrics, project: str) -> None:
        self._collector = collector
        self._process = process
        self._project = project

    def collect(self) -> Iterator[Metric]:
        yield from self._collector.collect(project=self._project)
        yield from self._process.collect()  # the collector's own, as in the unscoped scrape
