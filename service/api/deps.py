"""FastAPI dependencies as Annotated aliases (one place, reused by every route)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request, Response, status
from fastapi.routing import APIRoute
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from trainvitals.service.auth import ANONYMOUS, Principal
from trainvitals.service.store import queries, run_keys
from trainvitals.service.store.models import Run
from trainvitals.wire.v1 import _RUN_ID_PATTERN as RUN_ID_PATTERN  # the one definition of a run id
from trainvitals.wire.v1 import RUN_ID_MAX_LENGTH

# Typed, bounded parameters: whatever a client sends is a 422 before the database sees it (an
# integer beyond BIGINT, or a NUL byte that PostgreSQL refuses, would otherwise be a 500).
MAX_STEP = 2**63 - 1  # the steps' column is a BIGINT
_TEXT = r"^[^\x00]*$"  # any text but NUL, which PostgreSQL cannot store or compare
RunId = Annotated[str, Path(min_length=1, max_length=RUN_ID_MAX_LENGTH, pattern=RUN_ID_PATTERN, description="run id")]
TensorName = Annotated[
    str, Path(min_length=1, max_length=256, pattern=_TEXT, description="module fully-qualified name")
]
StepParam = Annotated[int | None, Query(ge=0, le=MAX_STEP, description="a step (inclusive bound)")]
ProjectParam = Annotated[
    str | None, Query(min_length=1, max_length=256, pattern=_TEXT, description="a project (default: the token's)")
]


def known_query_only(request: Request) -> None:
    """422 for a query parameter the route does not take: a misspelt filter (`?active_only=true`,
    `?before=`) would otherwise be ignored, and the answer would look like the one asked for."""
    route = request.scope.get("route")  # set by Starlette's router for the matched route
    if route is None:
        return
    taken = _query_names(route.dependant)
    if unknown := [name for name in request.query_params if name not in taken]:
        raise HTTPException(
            422, f"unknown query parameter {unknown[0]!r}: this route takes {', '.join(sorted(taken)) or 'none'}"
        )


def _query_names(dependant: Any) -> frozenset[str]:
    """The query parameters of a route with its dependencies' (FastAPI's Dependant tree), by alias."""
    names = {field.alias for field in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return frozenset(names)


KnownQueryOnly = Depends(known_query_only)


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


class AuthenticatedFirst(APIRoute):
    """Routes whose token is checked before their body is read.

    FastAPI reads and parses a declared body before it solves any dependency, so a route taking a
    body model would parse anyone's body (up to BodyLimit's 1 MiB: tens of MB of Python objects
    and the event loop for a while) before PrincipalDep refused the caller. The dependency's own
    call afterwards is a cache hit (TokenVerifier). A route without a declared body is as it was."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def authenticated_first(request: Request) -> Response:
            await authenticate(request)
            return await handler(request)

        return authenticated_first


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


def _authorized_run(session: Session, principal: Principal, run_id: str, project: str | None, scope: str) -> Run:
    """The caller's project's run `run_id` (run ids are a project's own: store/run_keys.py).

    Auth off: the one run with that id, or the named project's when several projects have one."""
    if principal.project is not None:
        require(principal, scope, project or principal.project)
        project = principal.project
    try:
        key = run_keys.resolve(session, run_id, project)
    except run_keys.AmbiguousRunError as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, f"{exc}: name one with ?project=...") from None
    run = None if key is None else queries.get_run(session, run_id=key)
    if run is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run {run_id!r}")
    return run


def readable_run(run_id: RunId, session: SessionDep, principal: PrincipalDep, project: ProjectParam = None) -> Run:
    """The path's run of the caller's project: 404 when it has none, 403 unless the caller may read."""
    return _authorized_run(session, principal, run_id, project, "read")


def deletable_run(run_id: RunId, session: SessionDep, principal: PrincipalDep, project: ProjectParam = None) -> Run:
    """The path's run of the caller's project: 404 when it has none, 403 without the admin scope."""
    return _authorized_run(session, principal, run_id, project, "admin")


def readable_project(principal: PrincipalDep, project: ProjectParam = None) -> str | None:
    """The project whose runs a caller sees: its token's (403 when `project` names another one),
    or `project` (None: every project) when auth is off."""
    if principal.project is None:
        return project
    require(principal, "read", project or principal.project)
    return principal.project


# A route that takes one of these gets the run (or project) already authorised; the session is
# the request's one (FastAPI caches a dependency per request), so the run is not loaded twice.
ReadableRun = Annotated[Run, Depends(readable_run)]
DeletableRun = Annotated[Run, Depends(deletable_run)]
ReadableProject = Annotated[str | None, Depends(readable_project)]
