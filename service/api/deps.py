"""FastAPI dependencies as Annotated aliases (one place, reused by every route)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from trainvitals.service.exposition import IngestCounters


def _session(request: Request) -> Iterator[Session]:
    with request.app.state.sessionmaker() as session:
        yield session


def _counters(request: Request) -> IngestCounters:
    return request.app.state.counters


SessionDep = Annotated[Session, Depends(_session)]
CountersDep = Annotated[IngestCounters, Depends(_counters)]
