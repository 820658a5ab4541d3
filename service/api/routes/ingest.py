"""Ingest routes: decode and validate, then hand off to the group-commit writer (service/batch_writer)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from fastapi import APIRouter, HTTPException, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from trainvitals.service.api.deps import PrincipalDep, SessionDep, authenticate, require
from trainvitals.service.api.schemas import RunRegisteredPublic
from trainvitals.service.ingest.batch_writer import WriterBusyError
from trainvitals.service.ingest.decode import decode_batch
from trainvitals.service.self_metrics import refuse
from trainvitals.service.store import batches
from trainvitals.service.store.batches import AnyBatch
from trainvitals.wire import Batch, BatchAck, RunRegistration

router = APIRouter(prefix="/v1", tags=["ingest"])


# A typical batch (a few hundred records, tens of KB) decodes in well under a millisecond: on the
# event loop, without a thread hop. A body near the size limit would stall the loop; it goes to a thread.
_PARSE_INLINE_BYTES = 1 << 20


def _decode(body: bytes) -> AnyBatch:
    """msgspec first (service/wire_decode.py); pydantic for anything it refuses, so a bad batch gets
    pydantic's field-by-field 422 and the rare body only pydantic's lax rules accept (NaN
    constants, numbers as strings) is still taken."""
    try:
        return decode_batch(body)
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    try:
        return Batch.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in exc.errors(include_url=False)]
        ) from None


async def _batch_from_body(request: Request) -> AnyBatch:
    """Read, decode and validate the body in one pass (no json.loads into Python dicts first).

    Errors are raised as FastAPI's, with the same `body.` locations, so the 422 message still
    names the offending field (records.3.step.step_seconds).
    """
    limit = request.app.state.settings.max_body_bytes
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():  # BodyLimit saw no Content-Length if this is chunked
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    if len(body) > _PARSE_INLINE_BYTES:
        return await run_in_threadpool(_decode, body)
    return _decode(body)


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


# The route reads the body itself, so FastAPI would not document it: declare it here.
_BATCH_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": _inline_schema(Batch.model_json_schema())}},
    }
}


@router.post("/runs", status_code=status.HTTP_201_CREATED, summary="Register a run (idempotent)")
def register_run(
    registration: RunRegistration, session: SessionDep, principal: PrincipalDep, response: Response
) -> RunRegisteredPublic:
    if "project" not in registration.model_fields_set and principal.project is not None:
        # No project named: the token's, the only one it may write to, so the two lines of
        # attach() need no project of their own (docs/agent.md). Auth off: the wire's default.
        registration = registration.model_copy(update={"project": principal.project})
    require(principal, "ingest", registration.project)
    try:
        created = batches.register_run(session, registration)
    except ValueError as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    if not created:
        response.status_code = status.HTTP_200_OK
    return RunRegisteredPublic(run=registration.run, created=created, project=registration.project)


@router.post(
    "/batches",
    summary="Store one rank's batch of records, exactly once",
    openapi_extra=_BATCH_BODY,
    response_model=BatchAck,
)
async def post_batch(request: Request) -> Response:
    """Decoded here, stored by the group-commit writer; answered after the commit that holds it.

    The hot path of the collector, hundreds of requests a second: it takes the bare Request and
    returns a ready Response, so FastAPI has no dependency graph to solve and no response model
    to validate per request (about half the CPU of a small batch). Authentication comes first:
    an unauthenticated caller gets 401 before the body is read.
    """
    state = request.app.state
    principal = await authenticate(request)
    if principal.scope not in (None, "ingest"):
        require(principal, "ingest", principal.project or "")
    batch = await _batch_from_body(request)
    try:
        future = state.batch_writer.submit(batch, project=principal.project)
    except WriterBusyError as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, str(exc), headers={"Retry-After": "1"}) from exc
    try:
        outcome = await asyncio.wrap_future(future)
    except Exception as exc:  # the database refused or is unreachable: nothing of this batch was stored
        refuse(request, "storage_error")
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, f"storage failed, nothing stored, retry: {exc}"[:500]
        ) from exc
    # Counted in the database by the transaction that decided the outcome (ingest_counts).
    if isinstance(outcome, batches.UnknownRunError):
        refuse(request, "unknown_run")
        raise HTTPException(status.HTTP_409_CONFLICT, str(outcome))
    if isinstance(outcome, batches.RefusedIncarnationError):  # counted as a conflict (the 409's default)
        raise HTTPException(status.HTTP_409_CONFLICT, str(outcome))
    if isinstance(outcome, batches.WrongProjectError):
        raise HTTPException(status.HTTP_403_FORBIDDEN, str(outcome))
    if isinstance(outcome, batches.UnstorableBatchError):
        refuse(request, "unstorable")
        raise HTTPException(422, f"nothing stored: {outcome}")
    return Response(outcome.model_dump_json(), media_type="application/json")
