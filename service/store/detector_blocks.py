"""The detectors' input for fixed step ranges, stored as numpy arrays (table `detector_blocks`).

The live analysis worker keeps each run's detector input in memory (analysis/detector_inputs.py)
and writes each completed range of steps here once. A worker that starts without that memory (a
collector start, a lease takeover) loads these blocks instead of reading and converting the rows
again: at 16,384 ranks, 20,000 steps x 384 tensors and 600 steps x 16,384 ranks of timing are 17M
rows, over a minute of PostgreSQL and Python; the same data as blocks is a few hundred MB of bytes.

A block stays true because the reduction deletes every block at or after the first step it is about
to rewrite (`forget_from`, in the reduction's own transaction): late data re-dirties the steps it
lands on, so a block never outlives a change of the rows it was made from.
"""

from __future__ import annotations

import io
from collections.abc import Collection, Iterator, Mapping

import numpy as np
from sqlalchemy import Select, delete, select
from sqlalchemy.orm import Session

from trainvitals.service.store.models import DetectorBlock


def forget_from(session: Session, *, run_id: str, step: int) -> None:
    """Delete the run's blocks that hold `step` or later steps (not committed: the caller's
    transaction rewrites those steps). Usually there are none (blocks hold reduced steps; only late
    data rewrites those): looked for first, so the reduction takes no write lock early for them."""
    b = DetectorBlock
    held = (b.run_id == run_id, b.last_step >= step)
    if session.scalar(select(b.first_step).where(*held).limit(1)) is not None:
        session.execute(delete(b).where(*held))


def forget_upto(session: Session, *, run_id: str, source: str, step: int) -> None:
    """Delete the source's blocks that end at or before `step` (they left the lookback)."""
    b = DetectorBlock
    session.execute(delete(b).where(b.run_id == run_id, b.source == source, b.last_step <= step))


def forget_runs_except(session: Session, *, live: Collection[str]) -> None:
    """Delete the blocks of every run not in `live` (finished past its grace, idle, or deleted): they
    are only for a worker resuming a live run, and are about 640 MB for a 16,384-rank run. A run that
    becomes live again is read from its rows once. Committed; a cheap look first (a few rows per run)."""
    b = DetectorBlock
    gone = set(session.scalars(select(b.run_id).distinct())) - set(live)
    if gone:
        session.execute(delete(b).where(b.run_id.in_(gone)))
        session.commit()


def stored(session: Session, *, run_id: str, source: str) -> set[int]:
    """First steps of the source's stored blocks."""
    b = DetectorBlock
    return set(session.scalars(select(b.first_step).where(b.run_id == run_id, b.source == source)))


def load(session: Session, *, run_id: str, source: str, first: int, last: int) -> list[dict[str, np.ndarray]]:
    """The arrays of the source's blocks with first <= first_step and last_step <= last, by step."""
    b = DetectorBlock
    stmt = (
        select(b.payload)
        .where(b.run_id == run_id, b.source == source, b.first_step >= first, b.last_step <= last)
        .order_by(b.first_step)
    )
    out = []
    for payload in _payloads(session, stmt):
        with np.load(io.BytesIO(payload), allow_pickle=False) as z:
            out.append({k: z[k] for k in z.files})
    return out


def _payloads(session: Session, stmt: Select[bytes]) -> Iterator[bytes]:
    """The payloads, one at a time. PostgreSQL: in binary (its text form of bytea is hex, twice the
    bytes to send and decode: most of the load time of ~600 MB of blocks)."""
    conn = session.connection()
    if conn.dialect.name != "postgresql":
        yield from session.scalars(stmt)
        return
    compiled = stmt.compile(dialect=conn.dialect)
    driver = conn.connection.driver_connection
    assert driver is not None  # a checked-out connection
    with driver.cursor(binary=True) as cur:
        cur.execute(str(compiled), compiled.params)
        for (payload,) in cur:
            yield payload


def encode(arrays: Mapping[str, np.ndarray]) -> bytes:
    """One block's payload: the arrays as an .npz (what `load` reads back)."""
    buf = io.BytesIO()
    np.savez(buf, **dict(arrays))  # type: ignore[arg-type]  # numpy's stub types **kwds oddly
    return buf.getvalue()


def save(session: Session, *, run_id: str, source: str, first: int, last: int, payload: bytes) -> None:
    """Store (or replace) one block, its payload from `encode` (not committed)."""
    b = DetectorBlock
    session.execute(delete(b).where(b.run_id == run_id, b.source == source, b.first_step == first))
    session.add(DetectorBlock(run_id=run_id, source=source, first_step=first, last_step=last, payload=payload))
