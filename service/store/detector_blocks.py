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
import json
import math
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
    return [decode(payload) for payload in _payloads(session, stmt)]


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


_MAGIC = b"TVB1"
_ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def encode(arrays: Mapping[str, np.ndarray]) -> bytes:
    """One block's payload (what `decode` reads back): the magic, the length of a JSON header that
    gives each array's dtype, shape and offset, the header, then the arrays' bytes, each at a
    64-byte boundary. Not an .npz: reading one back copied and checksummed every array through
    zipfile (~0.5 s of a restart's ~640 MB at 16,384 ranks); these are read in place."""
    header: dict[str, tuple[str, list[int], int]] = {}
    datas, offset = [], 0
    for name, array in arrays.items():
        a = np.ascontiguousarray(array)
        if a.dtype.hasobject:
            raise ValueError(f"block array {name!r} holds Python objects; only plain dtypes are stored")
        header[name] = (a.dtype.str, list(a.shape), offset)
        datas.append(a.tobytes())
        offset += _aligned(a.nbytes)
    head = json.dumps(header).encode()
    start = _aligned(8 + len(head))
    out = bytearray(start + offset)
    out[:8] = _MAGIC + len(head).to_bytes(4, "little")
    out[8 : 8 + len(head)] = head
    for (_, _, at), data in zip(header.values(), datas, strict=True):
        out[start + at : start + at + len(data)] = data
    return bytes(out)


def decode(payload: bytes) -> dict[str, np.ndarray]:
    """The arrays of one payload, read-only views into it (no copy). A payload stored before this
    format (an .npz) is read by numpy."""
    if payload[:4] != _MAGIC:
        with np.load(io.BytesIO(payload), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    size = int.from_bytes(payload[4:8], "little")
    header = json.loads(payload[8 : 8 + size])
    start = _aligned(8 + size)
    out = {}
    for name, (dtype, shape, at) in header.items():
        flat = np.frombuffer(payload, dtype=np.dtype(dtype), count=math.prod(shape), offset=start + at)
        out[name] = flat.reshape(shape)
    return out


def save(session: Session, *, run_id: str, source: str, first: int, last: int, payload: bytes) -> None:
    """Store (or replace) one block, its payload from `encode` (not committed)."""
    b = DetectorBlock
    session.execute(delete(b).where(b.run_id == run_id, b.source == source, b.first_step == first))
    session.add(DetectorBlock(run_id=run_id, source=source, first_step=first, last_step=last, payload=payload))
