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
from typing import Any

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
    are only for a worker resuming a live run, and are about 450 MB for a 16,384-rank run. A run that
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


_MAGIC_V1 = b"TVB1"  # every array as it is (until session 38); still read
_MAGIC = b"TVB2"
_ALIGN = 64
_NARROW = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _packed(a: np.ndarray) -> tuple[str, Any, list[bytes]]:
    """How one array is stored: (form, its argument, the byte strings in order). Two forms save
    most of a tensor block's bytes, and so of a restart's load (bytes from the database dominate):
    - "sparse": a float array mostly NaN (sat_frac, underflow_frac, crest_bits and nonfinite are
      sent only on the FP8 expensive steps, every 200th by default) as the positions and values of
      the rest;
    - "narrow": integers whose range fits a narrower unsigned type (a block's steps span 1,000)
      as their minimum plus offsets.
    Both decode to exactly the values written; anything else is stored as it is ("raw")."""
    flat = a.reshape(-1)
    if a.dtype.kind == "f" and flat.size:
        kept = np.flatnonzero(~np.isnan(flat))
        if len(kept) * (4 + a.itemsize) <= flat.size * a.itemsize // 2 and flat.size < 2**32:
            return "sparse", len(kept), [kept.astype(np.uint32).tobytes(), flat[kept].tobytes()]
    if a.dtype.kind in "iu" and flat.size >= 16:
        lo, hi = int(flat.min()), int(flat.max())
        for narrow in _NARROW:
            if narrow.itemsize < a.itemsize and hi - lo <= np.iinfo(narrow).max:
                return "narrow", [lo, narrow.str], [(flat - a.dtype.type(lo)).astype(narrow).tobytes()]
    return "raw", None, [a.tobytes()]


def encode(arrays: Mapping[str, np.ndarray]) -> bytes:
    """One block's payload (what `decode` reads back): the magic, the length of a JSON header that
    gives each array's dtype, shape, offset and form (`_packed`), the header, then the arrays'
    bytes, each part at a 64-byte boundary. Not an .npz: reading one back copied and checksummed
    every array through zipfile (~0.5 s of a restart's ~640 MB at 16,384 ranks); raw arrays are
    read in place."""
    header: dict[str, tuple[str, list[int], int, str, Any]] = {}
    datas: list[tuple[int, bytes]] = []
    offset = 0
    for name, array in arrays.items():
        a = np.ascontiguousarray(array)
        if a.dtype.hasobject:
            raise ValueError(f"block array {name!r} holds Python objects; only plain dtypes are stored")
        form, arg, parts = _packed(a)
        header[name] = (a.dtype.str, list(a.shape), offset, form, arg)
        for data in parts:
            datas.append((offset, data))
            offset += _aligned(len(data))
    head = json.dumps(header).encode()
    start = _aligned(8 + len(head))
    out = bytearray(start + offset)
    out[:8] = _MAGIC + len(head).to_bytes(4, "little")
    out[8 : 8 + len(head)] = head
    for at, data in datas:
        out[start + at : start + at + len(data)] = data
    return bytes(out)


def decode(payload: bytes) -> dict[str, np.ndarray]:
    """The arrays of one payload, read-only: raw arrays are views into it (no copy), packed ones
    are rebuilt. A payload stored before this format (TVB1, or an .npz before that) still loads."""
    magic = payload[:4]
    if magic not in (_MAGIC, _MAGIC_V1):
        with np.load(io.BytesIO(payload), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    size = int.from_bytes(payload[4:8], "little")
    header = json.loads(payload[8 : 8 + size])
    start = _aligned(8 + size)
    out = {}
    for name, (dtype_str, shape, at, *packing) in header.items():
        form: str = packing[0] if packing else "raw"  # a TVB1 entry has no form: raw
        arg: Any = packing[1] if packing else None
        dtype, n = np.dtype(dtype_str), math.prod(shape)
        if form == "sparse":
            kept = np.frombuffer(payload, dtype=np.uint32, count=arg, offset=start + at)
            values = np.frombuffer(payload, dtype=dtype, count=arg, offset=start + at + _aligned(4 * arg))
            flat = np.full(n, np.nan, dtype=dtype)
            flat[kept] = values
        elif form == "narrow":
            lo, narrow = arg
            flat = np.frombuffer(payload, dtype=np.dtype(narrow), count=n, offset=start + at).astype(dtype)
            flat += dtype.type(lo)
        else:
            flat = np.frombuffer(payload, dtype=dtype, count=n, offset=start + at)
        flat.flags.writeable = False
        out[name] = flat.reshape(shape)
    return out


def save(session: Session, *, run_id: str, source: str, first: int, last: int, payload: bytes) -> None:
    """Store (or replace) one block, its payload from `encode` (not committed)."""
    b = DetectorBlock
    session.execute(delete(b).where(b.run_id == run_id, b.source == source, b.first_step == first))
    session.add(DetectorBlock(run_id=run_id, source=source, first_step=first, last_step=last, payload=payload))
