"""Ingest routes: validate (pydantic, by FastAPI) and hand off to trainvitals.service.ingest."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Response, status

from trainvitals.service import ingest
from trainvitals.service.api.deps import CountersDep, SessionDep
from trainvitals.wire import Batch, BatchAck, RunRegistration

router = APIRouter(prefix="/v1", tags=["ingest"])


@router.post("/runs", status_code=status.HTTP_201_CREATED, summary="Register a run (idempotent)")
def register_run(registration: RunRegistration, session: SessionDep, response: Response) -> dict[str, object]:
    try:
        created = ingest.register_run(session, registration)
    except ValueError as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    if not created:
        response.status_code = status.HTTP_200_OK
    return {"run": registration.run, "created": created}


@router.post("/batches", summary="Store one rank's batch of records, exactly once")
def post_batch(batch: Batch, session: SessionDep, counters: CountersDep) -> BatchAck:
    try:
        ack = ingest.store_batch(session, batch)
    except ingest.UnknownRunError as exc:
        counters.count_batch(run=batch.run, outcome="rejected")
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    counters.count_batch(
        run=batch.run, outcome="duplicate" if ack.duplicate else "stored", records=ack.accepted
    )
    return ack
