"""What other forms of the tensor records would cost the collector per batch, against today's.

    python benchmarks/ingest_record_forms.py            # ~15 seconds, one process, one core

Issue 17 item 3 asks ingest to reach 0.7 of the raw-insert floor; on SQLite the collector's one
process holds one GIL between its event loop (HTTP, decoding, building rows) and its writer thread
(binding rows, stepping statements with the GIL released). Two forms of the records were proposed
to take work off that GIL, and this script measures what each would cost on the benchmark's own
batch (`ingest_throughput.batch_template`: 4 steps x (1 step, 5 grad, 48 tensor records)):

1. **Columnar tensor records on the wire.** Each step's 48 tensor records as one record of arrays
   (one list per column), decoded by msgspec into lists, the flat rows then interleaved from the
   columns in C (`zip`, `chain`). Compared with today's path: `decode_batch` into one struct a
   record, then `batch_rows`. Both run on the event loop, with the GIL held.
2. **SQLite extracting the rows from the body.** One `INSERT ... SELECT ... FROM json_each(?,
   '$.records')` per record kind and batch, the body bound as one parameter, so that binding the
   values moves into SQLite's C code, which runs with the GIL released. Compared with today's
   writer: the flat rows of 16 batches through `sqlite_multirow` in one transaction. Each path's
   time includes decoding (the route validates every body with msgspec either way).

3. **The FP8 records stored as one row per rank and step** (a "pack": each statistic's 48 values
   as one float64 blob). What the raw-insert floor (ingest_throughput.py's: sqlite3 `executemany`
   per kind, 16 batches per transaction, pre-built rows) becomes in records/s, against today's
   tables. The floor is what item 3's ratio divides by, so this is the denominator such a schema
   would set; the pack table is a scratch one, its blobs the size of real packs (None stored as
   NaN: not kept apart from NaN here, which a real pack must do).

Times are per batch of 216 records, wall and CPU of this one thread, best of `--repeats` (the
machine is shared: the least disturbed repeat), each form next to its baseline in the same run.
None of the forms is in the collector: these numbers are why (docs/performance.md, session 23).
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import time
from array import array
from collections.abc import Callable
from itertools import chain, islice, repeat
from pathlib import Path
from typing import Any, Literal

import msgspec

STEPS_PER_BATCH = 4
LAYERS_PER_RANK = 4
BATCHES = 16  # one group of the writer: what 16 clients queue at once
FLOOR_BATCHES = 512  # the floor's batches per timing: 32 groups


def batch_bodies(count: int) -> list[bytes]:
    """The first `count` batch bodies of the ingest benchmark's floor (ranks 0..count-1, seq 0)."""
    from ingest_throughput import _floor_batches

    bodies = _floor_batches("bench-forms", steps_per_batch=STEPS_PER_BATCH, layers_per_rank=LAYERS_PER_RANK)
    return list(islice(bodies, count))


# --------------------------------------------------------------------------- 1. columnar records

_TENSOR_COLUMNS = ("tensor", "role", "format", "amax", "scale", "headroom_bits", "lag_bits", "staleness_steps")
_OPTIONAL = (
    *("scale", "headroom_bits", "lag_bits", "staleness_steps"),
    *("sat_frac", "underflow_frac", "crest_bits", "nonfinite"),
)


def columnar_body(body: bytes) -> bytes:
    """The same batch with each step's tensor records as one record of columns (kind "tensors")."""
    batch = msgspec.json.decode(body)
    records: list[dict[str, Any]] = []
    for record in batch["records"]:
        last = records[-1] if records else None
        if record["kind"] != "tensor":
            records.append(record)
        elif last is not None and last["kind"] == "tensors" and last["step"] == record["step"]:
            for column in _TENSOR_COLUMNS:
                last[column].append(record.get(column))
        else:
            records.append({"kind": "tensors", "step": record["step"], **{c: [record.get(c)] for c in _TENSOR_COLUMNS}})
    batch["records"] = records
    return msgspec.json.encode(batch)


def columnar_decoder() -> msgspec.json.Decoder[Any]:
    """A decoder of the columnar form: today's structs for the other kinds (decode.py), one struct of
    lists for the tensors (the wire's bounds per element left out: this measures the shape)."""
    from trainvitals.service.ingest import decode

    tensors = msgspec.defstruct(
        "Tensors",
        [
            ("step", int),
            ("tensor", list[str]),
            ("role", list[Literal["input", "weight", "grad_output"]]),
            ("format", list[Literal["e4m3", "e5m2"]]),
            ("amax", list[float]),
            *((name, list[float | None] | None, None) for name in _OPTIONAL),
            ("shadow", list[bool] | None, None),
        ],
        namespace={"kind": "tensors"},  # as decode.py's structs: the kind as a class attribute
        tag="tensors",
        tag_field="kind",
        forbid_unknown_fields=True,
        frozen=True,
    )
    record = decode.StepRecord | decode.GradRecord | tensors | decode.CheckpointRecord | decode.EventRecord
    batch = msgspec.defstruct(
        "ColumnarBatch",
        [
            ("wire_version", int),
            ("run", str),
            ("rank", int),
            ("incarnation", int),
            ("seq", int),
            ("records", list[record]),  # type: ignore[valid-type]
            ("sent_at", float | None, None),
        ],
        forbid_unknown_fields=True,
        frozen=True,
    )
    return msgspec.json.Decoder(batch)


def columnar_rows(batch: Any) -> dict[str, list[Any]]:
    """The flat rows `batch_rows` builds, from the columnar form: the tensor rows interleaved from
    the columns by zip (absent optional columns as repeated None), the other kinds as today."""
    fast: dict[str, list[Any]] = {}
    prefix = (batch.run, batch.rank, batch.incarnation)
    for record in batch.records:
        if record.kind == "tensors":
            n = len(record.tensor)
            columns = [
                repeat(batch.run, n), repeat(batch.rank, n), repeat(batch.incarnation, n), repeat(record.step, n),
                record.tensor, record.role, record.format, record.amax,
                *(getattr(record, name) or repeat(None, n) for name in _OPTIONAL),
                record.shadow or repeat(False, n),
            ]  # fmt: skip
            fast.setdefault("tensor", []).extend(chain.from_iterable(zip(*columns, strict=True)))
        else:
            flat = fast.setdefault(record.kind, [])
            flat += prefix
            flat += msgspec.structs.astuple(record)
    return fast


# --------------------------------------------------------------------------- 2. rows from the body in SQLite


def json_insert_sql(kind: str) -> str:
    """INSERT ... SELECT of one kind's rows out of a batch body (parameters: run, rank, incarnation, body)."""
    from trainvitals.service.store import batches

    columns = batches._FAST_COLUMNS[kind]  # noqa: SLF001 - the store's own row layout

    def field(column: str) -> str:
        if column in ("shadow", "skipped"):  # the wire's BOOLEAN fields, false when left out
            return f"coalesce(value->>'{column}', 0)"
        return f"value->>'{'group' if column == 'group_name' else column}'"

    table = batches.RECORD_TABLES[kind].name
    return (
        f"INSERT INTO {table} (run_id, rank, incarnation, {', '.join(columns)}) "
        f"SELECT ?, ?, ?, {', '.join(map(field, columns))} "
        f"FROM json_each(?, '$.records') WHERE value->>'kind' = '{kind}'"
    )


def stored_rows(conn: sqlite3.Connection) -> list[tuple[object, ...]]:
    """Every stored record row without its id, each value with its storage class, in a fixed order."""
    from trainvitals.service.store import batches

    rows: list[tuple[object, ...]] = []
    for kind in batches._FAST_KINDS:  # noqa: SLF001 - the store's own record kinds
        columns = ("run_id", "rank", "incarnation", *batches._FAST_COLUMNS[kind])  # noqa: SLF001
        names = ", ".join(f"typeof({c}), {c}" for c in columns)
        table = batches.RECORD_TABLES[kind].name
        rows += [(kind, *r) for r in conn.execute(f"SELECT {names} FROM {table} ORDER BY {', '.join(columns)}")]
    return rows


# --------------------------------------------------------------------------- 3. packs: the floor

_PACK_KEY = ("run_id", "rank", "incarnation", "step", "layout")  # layout: the (tensor, role, format) list's digest
_PACK_VALUES = ("amax", *_OPTIONAL)  # one float64 blob each
_PACK_TABLE = (
    "CREATE TABLE tensor_packs (id INTEGER PRIMARY KEY, run_id VARCHAR(160), rank INTEGER, incarnation BIGINT, "
    f"step BIGINT, layout BLOB, {', '.join(f'{c} BLOB' for c in _PACK_VALUES)}, shadow BLOB)"
)
_PACK_INDEX = "CREATE INDEX ix_tensor_packs_run_step ON tensor_packs (run_id, step)"  # as tensor_stats'
_PACK_COLUMNS = (*_PACK_KEY, *_PACK_VALUES, "shadow")
_PACK_INSERT = f"INSERT INTO tensor_packs ({', '.join(_PACK_COLUMNS)}) VALUES ({', '.join('?' * len(_PACK_COLUMNS))})"


def pack_rows(batch: Any) -> list[tuple[Any, ...]]:
    """One pack row per step of a decoded batch: its tensor records' values as float64 blobs."""
    by_step: dict[int, list[Any]] = {}
    for record in batch.records:
        if record.kind == "tensor":
            by_step.setdefault(record.step, []).append(record)
    nan = float("nan")
    return [
        (
            batch.run, batch.rank, batch.incarnation, step, b"sha256 of the (tensor, role, format) list",
            *(array("d", [nan if v is None else v for v in (getattr(r, c) for r in records)]).tobytes()
              for c in _PACK_VALUES),
            bytes(r.shadow for r in records),
        )
        for step, records in by_step.items()
    ]  # fmt: skip


# --------------------------------------------------------------------------- timing


def best(fn: Callable[[], object], *, loops: int, repeats: int, per: int) -> tuple[float, float]:
    """(wall us, CPU us) per `per` items of one call of fn, the least of `repeats` timings of `loops` calls."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.thread_time()
        for _ in range(loops):
            fn()
        walls.append((time.perf_counter() - t) / loops / per * 1e6)
        cpus.append((time.thread_time() - c) / loops / per * 1e6)
    return min(walls), min(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    sys.path.insert(0, str(Path(__file__).parent))
    from ingest_throughput import add_shared_args, cpu_model, sqlite_scratch_db

    add_shared_args(parser, server=False)
    args = parser.parse_args()

    from trainvitals.service.store.db import upgrade

    print(f"machine: {cpu_model()}; SQLite {sqlite3.sqlite_version}")
    bodies = batch_bodies(FLOOR_BATCHES)
    time_event_loop(bodies[0], repeats=args.repeats)
    with sqlite_scratch_db(f"{args.db_prefix}_forms") as url:
        upgrade(url)
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "cache_size=-65536"):  # as the collector's
            conn.execute(f"PRAGMA {pragma}")
        time_writer(conn, bodies[:BATCHES], repeats=args.repeats)
        time_floor(conn, bodies, repeats=args.repeats)
        conn.close()


def _print_row(name: str, timed: tuple[float, float], base: tuple[float, float], extra: str = "") -> None:
    print(f"{name:<48} {timed[0]:9.1f} {timed[1]:9.1f} {timed[0] / base[0]:6.2f}{extra}")


def _print_head(title: str) -> None:
    print(f"\n{title:<48} {'wall us':>9} {'CPU us':>9} {'ratio':>6}")


def time_event_loop(body: bytes, *, repeats: int) -> None:
    """1. Decoding and row building of one batch: today's records against columnar ones."""
    from trainvitals.service.ingest.decode import decode_batch
    from trainvitals.service.store import batches

    columnar = columnar_body(body)
    decoder = columnar_decoder()
    # The columnar form holds the same rows (the prefix and every column, in order).
    today = batches.batch_rows(decode_batch(body))[0]
    assert columnar_rows(decoder.decode(columnar)) == today, "the columnar form must build the same rows"
    print(f"a batch of {len(decode_batch(body).records)} records, best of {repeats} repeats")
    print(f"body: {len(body):,} bytes as records, {len(columnar):,} columnar")

    def per_batch(fn: Callable[[], object]) -> tuple[float, float]:
        return best(fn, loops=2000, repeats=repeats, per=1)

    _print_head("event loop, per batch")
    base = per_batch(lambda: batches.batch_rows(decode_batch(body)))
    _print_row("today: decode_batch + batch_rows", base, base)
    _print_row("  of it decode_batch", per_batch(lambda: decode_batch(body)), base)
    _print_row("columnar: decode + rows from columns", per_batch(lambda: columnar_rows(decoder.decode(columnar))), base)
    _print_row("  of it decode", per_batch(lambda: decoder.decode(columnar)), base)


def time_writer(conn: sqlite3.Connection, bodies: list[bytes], *, repeats: int) -> None:
    """2. One group of batches into SQLite: today's multi-row INSERTs against SQLite's JSON extraction."""
    from trainvitals.service.ingest.decode import decode_batch
    from trainvitals.service.store import batches

    kinds = batches._FAST_KINDS  # noqa: SLF001 - the store's own record kinds
    statements = {kind: json_insert_sql(kind) for kind in kinds}

    def multirow() -> None:  # today: decode, build rows, one multi-row INSERT per kind
        built = [batches.batch_rows(decode_batch(b))[0] for b in bodies]
        conn.execute("BEGIN")
        for kind in kinds:
            plan = batches._SQLITE_PLAN[kind]  # noqa: SLF001 - the store's own statement
            flat = list(chain.from_iterable(rows.get(kind, ()) for rows in built))
            batches.sqlite_multirow(conn, plan, flat)
        conn.execute("COMMIT")

    def from_body() -> None:  # decode (validation), then SQLite extracts the rows
        decoded = [decode_batch(b) for b in bodies]
        conn.execute("BEGIN")
        for kind in kinds:
            for raw, batch in zip(bodies, decoded, strict=True):
                conn.execute(statements[kind], (batch.run, batch.rank, batch.incarnation, raw))
        conn.execute("COMMIT")

    # Both store the same rows: every column of every table but the id, with its storage class (a
    # float SQLite parsed from the body must be the very float msgspec parsed).
    from_body()
    extracted = stored_rows(conn)
    for kind in kinds:
        conn.execute(f"DELETE FROM {batches.RECORD_TABLES[kind].name}")
    multirow()
    records = sum(len(decode_batch(b).records) for b in bodies)
    assert stored_rows(conn) == extracted and len(extracted) == records, "the two paths must store the same rows"
    _print_head(f"writer, per batch ({len(bodies)} per transaction)")
    base = best(multirow, loops=20, repeats=repeats, per=len(bodies))
    _print_row("today: decode + rows + multi-row INSERT", base, base)
    _print_row(
        "json_each: decode + INSERT ... SELECT", best(from_body, loops=20, repeats=repeats, per=len(bodies)), base
    )


def time_floor(conn: sqlite3.Connection, bodies: list[bytes], *, repeats: int) -> None:
    """3. The raw-insert floor, today's tables against packs: every row built before the clock starts."""
    from ingest_throughput import row_tuples

    from trainvitals.service.ingest.decode import decode_batch
    from trainvitals.service.store import batches

    conn.execute(_PACK_TABLE)
    conn.execute(_PACK_INDEX)
    decoded = [decode_batch(b) for b in bodies]
    today_rows = [batches.batch_rows(b)[0] for b in decoded]
    groups = [slice(g, g + BATCHES) for g in range(0, len(bodies), BATCHES)]
    group_rows = {
        "today": [row_tuples(today_rows[g]) for g in groups],
        "packs": [
            {**row_tuples(today_rows[g], skip="tensor"), "pack": [r for b in decoded[g] for r in pack_rows(b)]}
            for g in groups
        ],
    }
    amax = len(_PACK_KEY)  # a pack row's amax blob: 8 bytes a tensor record
    in_packs = sum(len(row[amax]) // 8 for g in group_rows["packs"] for row in g["pack"])
    assert in_packs == sum(len(g["tensor"]) for g in group_rows["today"]), "the packs must hold every tensor record"
    insert = {**batches._SQLITE_INSERT, "pack": _PACK_INSERT}  # noqa: SLF001 - the floor's statements

    def floor(form: str) -> None:
        for group in group_rows[form]:
            conn.execute("BEGIN")
            for kind, rows in group.items():
                conn.executemany(insert[kind], rows)
            conn.execute("COMMIT")

    records = len(decoded[0].records)
    _print_head(f"raw-insert floor, per batch ({BATCHES} per transaction)")
    base = best(lambda: floor("today"), loops=2, repeats=repeats, per=len(bodies))
    packs = best(lambda: floor("packs"), loops=2, repeats=repeats, per=len(bodies))
    for name, timed in (("today's tables", base), ("FP8 records as one pack row a step", packs)):
        _print_row(name, timed, base, f"   {records / timed[0] * 1e6:,.0f} records/s")


if __name__ == "__main__":
    main()
