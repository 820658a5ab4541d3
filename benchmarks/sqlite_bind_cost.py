"""What binding costs SQLite's writer: one chunk of tensor rows with each value bound, against the
same rows with a chunk's constant columns written into the statement.

    python benchmarks/sqlite_bind_cost.py [--rows 4096] [--rounds 12]      # ~10 seconds, one core

The writer (store/batches.py `sqlite_multirow`) inserts a group's rows of a kind with multi-row
INSERTs over flat parameters. sqlite3 binds each parameter with the GIL held: an int, float or str
directly (a str copied), a None or a bool through its adapter registry. `_chunk_params` writes a
column that is the same in every row of a chunk into the statement instead: NULL for a nullable
column empty in every row, 0 or 1 for a BOOLEAN column, and "?1" for a first column holding one
run key (bound once). This script times one statement of `--rows` tensor rows shaped like an
ordinary step's (four optional statistics absent, `shadow` false, one run key) in three forms:

1. the NULLs as literals, everything else bound (the writer before session 61);
2. and `shadow` as a literal 0;
3. and the run key bound once (the writer since session 61).

It also times what the writer does before binding: `_chunk_params` turning the flat rows (every
column, as a group's list holds them) into the third form's parameters and literals, and checks
that it gives exactly that form.

Each round runs the three forms one after the other, each in its own transaction rolled back (the
table stays empty, so every form inserts into the same b-trees), into a scratch SQLite file with the
collector's schema; the thread's CPU time per row, median and minimum over the rounds after two
warm-up rounds, and each form's ratio to the first. docs/performance.md, session 61, has numbers.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def tensor_rows(rows: int) -> list[Any]:
    """Flat parameters of `rows` tensor rows in the store's column order (run_id, rank, incarnation,
    step, tensor, role, format, amax, scale, headroom_bits, lag_bits, staleness_steps, sat_frac,
    underflow_frac, crest_bits, nonfinite, shadow)."""
    flat: list[Any] = []
    for i in range(rows):
        flat += [
            "bench/run-1", i % 512, 1_712_900_000_000, 100, f"model.layers.{i % 32}.mlp.fc{i % 4}",
            "input" if i % 2 else "weight", "e4m3", 3.5 + i * 1e-4, 112.5, 1.5, 0.02, 3,
            None, None, None, None, False,
        ]  # fmt: skip
    return flat


def forms(rows: int) -> dict[str, tuple[str, list[Any]]]:
    """Each form's statement and parameters, built with the store's own statement builder."""
    from trainvitals.service.store import batches

    plan = batches._SQLITE_PLAN["tensor"]  # noqa: SLF001 - the store's own statement
    head, _, values = plan.sql.partition(" VALUES ")
    width = values.count("?")
    flat = tensor_rows(rows)
    absent = tuple(k for k in plan.nullable if flat[k] is None)  # the four optional statistics
    (shadow,) = plan.boolean

    def without(params: list[Any], columns: tuple[int, ...]) -> list[Any]:
        return [v for i, v in enumerate(params) if i % width not in columns]

    nulls = tuple((k, "NULL") for k in absent)
    with_shadow = tuple(sorted((*nulls, (shadow, "0"))))
    sql = batches._sqlite_values_sql  # noqa: SLF001 - the store's own statement builder
    return {
        "NULLs as literals, the rest bound": (sql(head, values, rows, nulls), without(flat, absent)),
        "and shadow as a literal": (sql(head, values, rows, with_shadow), without(flat, (*absent, shadow))),
        "and the run key bound once (?1)": (
            sql(head, values, rows, ((0, "?1"), *with_shadow)),
            [flat[0], *without(flat, (0, *absent, shadow))],
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096, help="rows in the statement (the writer's largest chunk)")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    if args.rounds < 3:
        sys.exit("--rounds must be at least 3 (two are warm-up)")

    from trainvitals.service.store import batches, db

    with tempfile.TemporaryDirectory(prefix="tv_bind_") as scratch:
        path = Path(scratch) / "bind.db"
        db.upgrade(f"sqlite:///{path}")
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        cur = conn.cursor()
        timed = forms(args.rows)
        per_row: dict[str, list[float]] = {name: [] for name in timed}
        stored: list[list[tuple[Any, ...]]] = []
        for round_ in range(args.rounds):
            for name, (statement, params) in timed.items():
                conn.execute("BEGIN")
                started = time.thread_time()
                cur.execute(statement, params)
                spent = time.thread_time() - started
                if round_ == 0:  # every form stores the same rows
                    stored.append(conn.execute("SELECT * FROM tensor_stats ORDER BY id").fetchall())
                conn.execute("ROLLBACK")
                if round_ >= 2:
                    per_row[name].append(spent * 1e6 / args.rows)
        conn.close()
    if any(rows != stored[0] for rows in stored):
        sys.exit("the forms stored different rows: the comparison is void")
    prepared, (params, literals) = chunk_preparation(args.rows, args.rounds)
    statement, last_params = list(timed.values())[-1]
    plan = batches._SQLITE_PLAN["tensor"]  # noqa: SLF001 - the store's own statement
    head, _, values = plan.sql.partition(" VALUES ")
    if params != last_params or batches._sqlite_values_sql(head, values, args.rows, literals) != statement:  # noqa: SLF001
        sys.exit("the writer's chunk preparation does not give the last form: the comparison is void")
    print(f"{args.rows} tensor rows in one INSERT, {args.rounds - 2} rounds; CPU us a row")
    print(f"{'form':<40} {'median':>8} {'min':>8} {'ratio':>6}")
    base = statistics.median(next(iter(per_row.values())))
    for name, values in per_row.items():
        median = statistics.median(values)
        print(f"{name:<40} {median:8.3f} {min(values):8.3f} {median / base:6.2f}")
    print(
        f"before binding, the writer's chunk preparation (`_chunk_params`, the last form's parameters "
        f"from the flat rows): {statistics.median(prepared):.3f} us a row median, {min(prepared):.3f} least"
    )


def chunk_preparation(rows: int, rounds: int) -> tuple[list[float], tuple[list[Any], tuple[tuple[int, str], ...]]]:
    """CPU us a row the writer spends turning the flat rows into the last form's parameters and
    literals (store/batches.py `_chunk_params`), one value per round after two warm-up rounds, and
    what it returned."""
    from trainvitals.service.store import batches

    plan = batches._SQLITE_PLAN["tensor"]  # noqa: SLF001 - the store's own statement
    width = batches._WIDTH["tensor"]  # noqa: SLF001 - the store's own row layout
    flat = tensor_rows(rows)
    spent: list[float] = []
    for round_ in range(rounds):
        started = time.thread_time()
        prepared = batches._chunk_params(flat, width, 0, rows, plan)  # noqa: SLF001 - the writer's own step
        if round_ >= 2:
            spent.append((time.thread_time() - started) * 1e6 / rows)
    return spent, prepared


if __name__ == "__main__":
    main()
