"""Ingest routes: validate (pydantic) and hand off to trainvitals.service.ingest."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from trainvitals.service import ingest
from trainvitals.service.api.deps import CountersDep, PrincipalDep, SessionDep, require
from trainvitals.wire import Batch, BatchAck, RunRegistration

router = APIRouter(prefix="/v1", tags=["ingest"])


async def _batch_from_body(request: Request) -> Batch:
    """Parse and validate the body in one pass with pydantic-core's JSON parser.

    FastAPI's generic body handling runs json.loads into Python dicts and then validates those:
    about three times the CPU per record of `model_validate_json`, and ingest is CPU-bound.
    Errors are re-raised as FastAPI's, with the same `body.` locations, so the 422 message still
    names the offending field (records.3.step.step_seconds).
    """
    try:
        return Batch.model_validate_json(await request.body())
    except ValidationError as exc:
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in exc.errors(include_url=False)]
        ) from None


def _inline_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema with its $defs inlined: the operation documents the body on its own."""
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


# The body is read by a dependency, so FastAPI would not document it: declare it here.
_BATCH_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": _inline_schema(Batch.model_json_schema())}},
    }
}
BatchBody = Annotated[Batch, Depends(_batch_from_body)]


@router.post("/runs", status_code=status.HTTP_201_CREATED, summary="Register a run (idempotent)")
def register_run(
    registration: RunRegistration, session: SessionDep, principal: PrincipalDep, response: Response
) -> dict[str, object]:
    require(principal, "ingest", registration.project)
    try:
        created = ingest.register_run(session, registration)
    except ValueError as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    if not created:
        response.status_code = status.HTTP_200_OK
    return {"run": registration.run, "created": created}


@router.post("/batches", summary="Store one rank's batch of records, exactly once", openapi_extra=_BATCH_BODY)
def post_batch(
    # principal before batch: dependencies resolve in this order, and an unauthenticated caller
    # gets 401 before the body is even parsed (as with FastAPI's own body handling).
    principal: PrincipalDep,
    batch: BatchBody,
    session: SessionDep,
    counters: CountersDep,
) -> BatchAck:
    if principal.scope not in (None, "ingest"):
        require(principal, "ingest", principal.project or "")
    try:
        ack = ingest.store_batch(session, batch, project=principal.project)
    except ingest.UnknownRunError as exc:
        counters.count_batch(run=batch.run, outcome="rejected")
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    except ingest.WrongProjectError as exc:
        counters.count_batch(run=batch.run, outcome="rejected")
        raise HTTPException(status.HTTP_403_FORBIDDEN, str(exc)) from exc
    counters.count_batch(
        run=batch.run, outcome="duplicate" if ack.duplicate else "stored", records=ack.accepted
    )
    return ack
