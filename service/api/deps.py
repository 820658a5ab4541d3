"""FastAPI dependencies as Annotated aliases (one place, reused by every route)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request, status
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from trainvitals.service.auth import ANONYMOUS, Principal
from trainvitals.service.store import queries
from trainvitals.service.store.models import Run


def _session(request: Request) -> Iterator[Session]:
    with request.app.state.sessionmaker() as session:
        yield session


async def authenticate(request: Request) -> Principal:
    """The caller's token; async so a cached token costs neither a thread hop nor a query."""
    app = request.app
    if not app.state.settings.auth:
        return ANONYMOUS
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "missing bearer token", headers={"WWW-Authenticate": "Bearer"}
        )
    found, principal = app.state.verifier.cached(token)
    if not found:
        principal = await run_in_threadpool(_verify, app, token)
    if principal is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "unknown or revoked token", headers={"WWW-Authenticate": "Bearer"}
        )
    return principal


def _verify(app: FastAPI, token: str) -> Principal | None:
    with app.state.sessionmaker() as session:
        return app.state.verifier.verify(session, token)


def require(principal: Principal, scope: str, project: str) -> None:
    """403 unless the principal may act with `scope` on `project`."""
    if not principal.may(scope, project):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"token is for project {principal.project!r} with scope {principal.scope!r}; "
            f"this needs scope {scope!r} on project {project!r}",
        )


SessionDep = Annotated[Session, Depends(_session)]
PrincipalDep = Annotated[Principal, Depends(authenticate)]


def _authorized_run(session: Session, principal: Principal, run_id: str, scope: str) -> Run:
    run = queries.get_run(session, run_id=run_id)
    if run is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r}")
    require(principal, scope, run.project)
    return run


def readable_run(run_id: str, session: SessionDep, principal: PrincipalDep) -> Run:
    """The path's run: 404 when unknown, 403 unless the caller may read its project."""
    return _authorized_run(session, principal, run_id, "read")


def writable_run(run_id: str, session: SessionDep, principal: PrincipalDep) -> Run:
    """The path's run: 404 when unknown, 403 unless the caller may write (ingest) its project."""
    return _authorized_run(session, principal, run_id, "ingest")


def readable_project(principal: PrincipalDep, project: str | None = None) -> str | None:
    """The project whose runs a caller sees: its token's (403 when `project` names another one),
    or `project` (None: every project) when auth is off."""
    if principal.project is None:
        return project
    require(principal, "read", project or principal.project)
    return principal.project


# A route that takes one of these gets the run (or project) already authorised; the session is
# the request's one (FastAPI caches a dependency per request), so the run is not loaded twice.
ReadableRun = Annotated[Run, Depends(readable_run)]
WritableRun = Annotated[Run, Depends(writable_run)]
ReadableProject = Annotated[str | None, Depends(readable_project)]
