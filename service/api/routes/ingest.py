"""Ingest routes: decode and validate, then hand off to the group-commit writer (service/batch_writer)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, NoReturn

import msgspec
from fastapi import APIRouter, HTTPException, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy.exc import DataError, OperationalError
from starlette.concurrency import run_in_threadpool

from trainvitals.service.api.deps import AuthenticatedFirst, PrincipalDep, SessionDep, authenticate, require
from trainvitals.service.api.schemas import RunRegisteredPublic
from trainvitals.service.ingest.batch_writer import WriterBusyError, database_reason
from trainvitals.service.ingest.decode import Batch as FastBatch
from trainvitals.service.ingest.decode import decode_batch
from trainvitals.service.self_metrics import refuse
from trainvitals.service.store import batches
from trainvitals.service.store.batches import AnyBatch
from trainvitals.wire import Batch, BatchAck, RunRegistration

router = APIRouter(prefix="/v1", tags=["ingest"], route_class=AuthenticatedFirst)


# A typical batch (a few hundred records, tens of KB) decodes in well under a millisecond: on the
# event loop, without a thread hop. A body near the size limit would stall the loop; it goes to a
# thread, and only `max_large_bodies` of those are decoded at once (each costs its size several
# times over in memory and a core for a fraction of a second): beyond, 503 with Retry-After.
_LARGE_BODY_BYTES = 1 << 20

# A body the fast decoder refuses is validated again for a better message or a laxer reading.
# pydantic collects every error of every record (seconds and hundreds of MB for a 16 MB body with
# an error per record), so it is asked only about bodies up to this size. A larger one gets the
# fast decoder's first error, unless the lax rules could take it: NaN or Infinity (the agent's
# json.dumps writes them) or a number as a string. Only then is it read by json.loads (which takes
# NaN and Infinity, as pydantic does) and msgspec's lax conversion, which stops at the first
# error: about 0.2 s for an 18 MB body, against 0.5-4 s for pydantic.
_REVALIDATE_MAX_BYTES = 256 << 10

_MSGSPEC_PATH = re.compile(r"\[(\d+)\]|\.([^.\[]+)")


def decode_body(body: bytes) -> AnyBatch:
    """msgspec first (service/ingest/decode.py); for anything it refuses, a small body gets
    pydantic's field-by-field 422 and a large one the first error (`_REVALIDATE_MAX_BYTES`); both
    still take what only the lax rules accept (NaN constants, numbers as strings)."""
    try:
        return decode_batch(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        refused = exc
    if len(body) > _REVALIDATE_MAX_BYTES:
        lax_may_take = (
            b"NaN" in body or b"Infinity" in body
            if isinstance(refused, msgspec.DecodeError)
            else "got `str`" in str(refused)
        )
        if not lax_may_take:
            _raise_first_error(refused)
        return _decode_large_lax(body)
    try:
        return Batch.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in exc.errors(include_url=False)]
        ) from None


def _decode_large_lax(body: bytes) -> AnyBatch:
    """The lax reading of a large body, bounded: one json.loads, then a conversion that stops at
    the first error, which the 422 names (records.3.step: Expected `int` >= 0)."""
    try:
        plain = json.loads(body)
    except (ValueError, RecursionError) as exc:  # malformed (json.JSONDecodeError is a ValueError), too deep
        raise RequestValidationError(
            [{"loc": ("body",), "msg": f"invalid JSON: {exc}", "type": "json_invalid"}]
        ) from None
    try:
        return msgspec.convert(plain, FastBatch, strict=False)
    except msgspec.ValidationError as exc:
        _raise_first_error(exc)


def _raise_first_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> NoReturn:
    """msgspec's error as FastAPI's 422, its place as a location (`$.records[3].step` ->
    body.records.3.step)."""
    message, _, where = str(exc).partition(" - at `$")
    loc = tuple(int(i) if i else name for i, name in _MSGSPEC_PATH.findall(where.rstrip("`")))
    kind = "json_invalid" if isinstance(exc, msgspec.DecodeError) else "invalid"
    raise RequestValidationError([{"loc": ("body", *loc), "msg": message, "type": kind}]) from None


async def _batch_from_body(request: Request) -> tuple[AnyBatch, bytes | None]:
    """Read, decode and validate the body in one pass (no json.loads into Python dicts first).
    Returns the batch and, unless it is large, the body as received (for the ingest journal).

    Errors are raised as FastAPI's, with the same `body.` locations, so the 422 message still
    names the offending field (records.3.step.step_seconds).
    """
    limit = request.app.state.settings.max_body_bytes
    declared = request.headers.get("content-length", "")
    large = _LargeBody(request)
    admitted = not (declared.isdigit() and int(declared) > _LARGE_BODY_BYTES) or large.enter()
    try:
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():  # BodyLimit saw no Content-Length if this is chunked
            size += len(chunk)
            if size > limit:
                raise HTTPException(413, f"request body exceeds the limit of {limit} bytes")
            if admitted and size > _LARGE_BODY_BYTES:
                admitted = large.enter()
            if admitted:
                chunks.append(chunk)
            else:  # refused: read to the end but keep nothing, so the client can read the 503
                chunks.clear()
        if not admitted:
            large.refuse()
        body = b"".join(chunks)
        del chunks
        if large.entered:
            return await run_in_threadpool(decode_body, body), None
        return decode_body(body), body
    finally:
        large.leave()


class _LargeBody:
    """A slot among the `max_large_bodies` large bodies read and decoded at once (per process;
    the count lives on app.state and is touched only on the event loop, so needs no lock).

    A refused body is still read, and dropped: a client such as http.client sends the whole body
    before it reads the answer, and a connection closed under it reads as a reset, not a 503."""

    def __init__(self, request: Request) -> None:
        self._request = request
        self.entered = False

    def enter(self) -> bool:
        """Take a slot; False when all are taken."""
        state = self._request.app.state
        if not self.entered and state.large_bodies < state.settings.max_large_bodies:
            state.large_bodies += 1
            self.entered = True
        return self.entered

    def refuse(self) -> None:
        refuse(self._request, "busy_large")
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            f"{self._request.app.state.large_bodies} large batches (over {_LARGE_BODY_BYTES} bytes) are being "
            "decoded: nothing stored, retry shortly",
            headers={"Retry-After": "1"},
        )

    def leave(self) -> None:
        if self.entered:
            self._request.app.state.large_bodies -= 1
            self.entered = False


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


STORAGE_RETRY_AFTER_S = 5
"""Retry-After of a storage failure: a database that is down or full takes more than a second."""


def _storage_failed(exc: BaseException) -> HTTPException:
    """503 for a database that failed to store a request (nothing of it is stored)."""
    return HTTPException(
        status.HTTP_503_SERVICE_UNAVAILABLE,
        f"storage failed, nothing stored, retry: {database_reason(exc)}",
        headers={"Retry-After": str(STORAGE_RETRY_AFTER_S)},
    )


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
        # Auth off: a batch names no project, so a run id must name one run whatever the project.
        created = batches.register_run(session, registration, unique_ids=principal.project is None)
    except batches.RunConflictError as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    except OperationalError as exc:  # the database is down, full or locked: a 503, never a 500
        raise _storage_failed(exc) from None
    except DataError as exc:  # a value PostgreSQL refuses (a NUL character in a tag): nothing stored
        detail = f"the database refused a value of the registration: {database_reason(exc)}; nothing stored"
        raise HTTPException(422, detail) from None
    except ValueError:  # auth off, and another project has this id: say it is taken, not whose it is
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"run id {registration.run!r} is taken by another project: nothing of this job is stored. Give this "
            "job its own run id (attach(run=...) or TRAINVITALS_RUN)",
        ) from None
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
    """Decoded here, stored by the group-commit writer; answered after the commit that holds it, or
    once in the ingest journal (service/ingest/batch_writer.py, "Acknowledged from the journal").

    The hot path of the collector, hundreds of requests a second: it takes the bare Request and
    returns a ready Response, so FastAPI has no dependency graph to solve and no response model
    to validate per request (about half the CPU of a small batch). Authentication comes first:
    an unauthenticated caller gets 401 before the body is read.
    """
    state = request.app.state
    principal = await authenticate(request)
    if principal.scope not in (None, "ingest"):
        require(principal, "ingest", principal.project or "")
    batch, body = await _batch_from_body(request)
    try:
        future = state.batch_writer.submit(batch, project=principal.project, body=body)
    except WriterBusyError as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, str(exc), headers={"Retry-After": "1"}) from exc
    try:
        outcome = await asyncio.wrap_future(future)
    except Exception as exc:  # the database refused or is unreachable: nothing of this batch was stored
        refuse(request, "storage_error")
        raise _storage_failed(exc) from exc
    # Counted in the database by the transaction that decided the outcome (ingest_counts).
    if isinstance(outcome, batches.WrongProjectError):  # cannot happen (the key is the project's): as unknown
        outcome = batches.UnknownRunError(f"run {batch.run!r} is not registered: POST /v1/runs first")
    if isinstance(outcome, batches.UnknownRunError):
        # Run ids are a project's own: another project's run of the same id is another run, and
        # nothing of it is said. Retrying cannot fix this.
        refuse(request, "unknown_run")
        raise HTTPException(status.HTTP_409_CONFLICT, str(outcome))
    if isinstance(outcome, batches.RefusedIncarnationError):  # counted as a conflict (the 409's default)
        raise HTTPException(status.HTTP_409_CONFLICT, str(outcome))
    if isinstance(outcome, batches.UnstorableBatchError):
        refuse(request, "unstorable")
        raise HTTPException(422, f"nothing stored: {outcome}")
    return Response(outcome.model_dump_json(), media_type="application/json")
