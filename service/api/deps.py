"""FastAPI dependencies as Annotated aliases (one place, reused by every route)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request, status
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from trainvitals.service.auth import ANONYMOUS, Principal


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


def readable_run(session: Session, principal: Principal, run_id: str) -> None:
    """404 for an unknown run, 403 unless the principal may read its project."""
    from trainvitals.service.store.queries import get_run

    run = get_run(session, run_id=run_id)
    if run is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r}")
    require(principal, "read", run.project)
