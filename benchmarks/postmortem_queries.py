"""Post-mortem query times on PostgreSQL for a 16,384-rank run, with EXPLAIN ANALYZE evidence.

    python benchmarks/postmortem_queries.py [--tensor-steps 2500] [--window-count 250] [--raw-steps 300]

What is stored (defaults) and why not all of "16,384 ranks x 100k steps":

- step_summaries     100,000 steps (the full run)
- tensor_summaries   2,000 (tensor, role) series x --tensor-steps newest steps (5.0M rows; the
                     full run would be 200M rows, tens of GB with its indexes)
- rank_windows       16,384 ranks x --window-count windows of 50 steps (4.1M rows = 12,500 steps;
                     the full run would be 2,000 windows = 32.8M rows)
- steps (raw)        16,384 ranks x --raw-steps steps (4.9M rows; the step-time matrix query of
                     queries.step_time_matrix reads these)
- checkpoints (raw)  20 generations x 16,384 ranks x started + persisted (655,360 rows)
- findings           40

Rows are generated inside PostgreSQL (generate_series). Each table is loaded with its indexes
dropped and they are rebuilt afterwards from their own definitions (pg_indexes / pg_constraint),
the usual bulk-load order; then VACUUM ANALYZE, as autovacuum would leave a live database.

Every query is a B-tree range scan whose cost is O(log N + rows returned): the table size enters
only through the index depth (one more level per ~300x rows), so the times below hold at the full
100k steps as long as the plans stay on the indexes, which the EXPLAIN column shows. Each query is
timed as the collector runs it (the queries.py function, median of --repeats) and by EXPLAIN
ANALYZE of the equivalent SQL (server time, and the index it used).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ingest_throughput import WORLD_SIZE, add_shared_args, pg_scratch_db, registration
from sqlalchemy import Engine, text

from trainvitals.service.store import db, queries

RUN = "bench-16k"
STEPS = 100_000
SERIES = 2_000  # (tensor, role) pairs
WINDOW = 50
GENERATIONS = 20
FINDINGS = 40


def _tables_sql(*, tensor_steps: int, window_count: int, raw_steps: int, now: float) -> dict[str, str]:
    last = STEPS - 1
    return {
        "step_summaries": (
            "INSERT INTO step_summaries (run_id, step, ranks, ts, step_seconds_min, step_seconds_p50, "
            "step_seconds_p90, step_seconds_p99, step_seconds_max, slowest_rank, compute_seconds_p50, "
            "wait_seconds_p50, data_seconds_p50, loss, loss_nonfinite, grad_norm, agent_grad_norm, "
            "grad_nonfinite, tokens, flops, mfu, peak_flops_total) "
            f"SELECT '{RUN}', s, {WORLD_SIZE}, {now} - ({last} - s) * 1.05, 1.0, 1.02, 1.04, 1.05, 1.06, "
            f"s % {WORLD_SIZE}, 0.8, 0.2, 0.01, 2.5, 0, 0.9, 0.9, 0, 1.3e8, 5.9e18, 0.41, 1.3576e19 "
            f"FROM generate_series(0, {last}) s"
        ),
        "tensor_summaries": (
            "INSERT INTO tensor_summaries (run_id, tensor, role, step, format, amax, headroom_bits, "
            "lag_bits, staleness_steps, sat_frac, underflow_frac, crest_bits, nonfinite, shadow) "
            f"SELECT '{RUN}', 'model.layers.' || (t / 3 / 8) || '.linear' || (t / 3 % 8), "
            "(ARRAY['input', 'weight', 'grad_output'])[t % 3 + 1], s, 'e4m3', 3.5, "
            "0.5 + ((t * 7919 + s::bigint * 104729) % 1000) * 0.005 - 0.3, 0.01, 2, 0.0, 0.0, 4.0, 0, false "
            f"FROM generate_series({last - tensor_steps + 1}, {last}) s, generate_series(0, {SERIES - 1}) t"
        ),
        "rank_windows": (
            "INSERT INTO rank_windows (run_id, window_start, rank, steps, pp_stage, step_seconds_mean, "
            "step_seconds_p50, step_seconds_max, compute_seconds_mean, wait_seconds_mean) "
            f"SELECT '{RUN}', w * {WINDOW}, r, {WINDOW}, (r / 8) % 8, 1.0 + (r % 97) * 0.0005, 1.0, 1.1, "
            f"0.8 + (r % 89) * 0.001, 0.2 FROM generate_series({STEPS // WINDOW - window_count}, "
            f"{STEPS // WINDOW - 1}) w, generate_series(0, {WORLD_SIZE - 1}) r"
        ),
        "steps": (
            "INSERT INTO steps (run_id, rank, incarnation, step, ts, step_seconds, compute_seconds, "
            "wait_seconds, loss, tokens, flops, pp_stage, tp_rank, dp_rank) "
            f"SELECT '{RUN}', r, 1, s, {now} - ({last} - s) * 1.05, 1.0 + (r % 97) * 0.0005, 0.8, 0.2, "
            f"2.5, 8192, 3.6e14, (r / 8) % 8, r % 8, r / 64 FROM generate_series({last - raw_steps + 1}, "
            f"{last}) s, generate_series(0, {WORLD_SIZE - 1}) r"
        ),
        "checkpoints": (
            "INSERT INTO checkpoints (run_id, rank, incarnation, step, generation, status, ts, path, bytes, "
            "stall_seconds, persist_seconds, checksum) "
            f"SELECT '{RUN}', r, 1, {last} - ({GENERATIONS} - g) * 5000, g, "
            "(ARRAY['started', 'persisted'])[k + 1], "
            f"{now} - ({GENERATIONS} - g) * 5250.0 + k * 30, '/ckpt/gen' || g, 2000000000, "
            "CASE k WHEN 0 THEN NULL ELSE 4.5 END, CASE k WHEN 0 THEN NULL ELSE 30.0 END, "
            "CASE k WHEN 0 THEN NULL ELSE md5(g::text || '-' || r::text) END "
            f"FROM generate_series(0, {GENERATIONS - 1}) g, generate_series(0, {WORLD_SIZE - 1}) r, "
            "generate_series(0, 1) k"
        ),
        "reduction_state": f"INSERT INTO reduction_state (run_id, reduced_upto) VALUES ('{RUN}', {last})",
        "ingest_counts": (
            "INSERT INTO ingest_counts (run_id, outcome, writer, batches, records, step_records, tensor_records, "
            "grad_records, checkpoint_records, event_records) "
            f"VALUES ('{RUN}', 'stored', 'bench:1:0', 0, 0, {STEPS * WORLD_SIZE}, 0, 0, 0, 0)"
        ),
        "findings": (
            "INSERT INTO findings (run_id, kind, severity, subject_kind, subject, onset_step, last_step, "
            "magnitude, summary, active, first_seen_at, updated_at) "
            f"SELECT '{RUN}', (ARRAY['straggler', 'fp8_headroom', 'grad_spike', 'loss_spike'])[f % 4 + 1], "
            f"(ARRAY['page', 'ticket', 'info'])[f % 3 + 1], 'rank', 'r' || f, f * 2000, f * 2000 + 100, "
            f"2.0, 'generated', f % 2 = 0, {now}, {now} FROM generate_series(0, {FINDINGS - 1}) f"
        ),
    }


def build(engine: Engine, *, tensor_steps: int, window_count: int, raw_steps: int) -> dict[str, tuple[int, str]]:
    """Load every table with its indexes dropped, rebuild them; returns (rows, size) per table."""
    import json

    now = time.time()
    out: dict[str, tuple[int, str]] = {}
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.execute(text("SET maintenance_work_mem = '512MB'"))
        conn.execute(text("SET synchronous_commit = off"))  # a scratch build: durability not needed
        conn.execute(
            text(
                "INSERT INTO runs (run_id, project, registration, world_size, status, created_at, last_seen_at) "
                f"VALUES ('{RUN}', 'bench', :reg, {WORLD_SIZE}, 'finished', {now - 110_000}, {now})"
            ),
            {"reg": json.dumps(registration(RUN))},
        )
        sqls = _tables_sql(tensor_steps=tensor_steps, window_count=window_count, raw_steps=raw_steps, now=now)
        for table, sql in sqls.items():
            t0 = time.perf_counter()
            constraints = conn.execute(
                text(
                    "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                    "WHERE conrelid = CAST(:t AS regclass) AND contype = 'p'"
                ),
                {"t": table},
            ).all()
            indexes = conn.execute(
                text(
                    "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = :t "
                    "AND indexname NOT IN (SELECT conname FROM pg_constraint WHERE contype = 'p')"
                ),
                {"t": table},
            ).all()
            for name, _ in indexes:
                conn.execute(text(f'DROP INDEX "{name}"'))
            for name, _ in constraints:
                conn.execute(text(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"'))
            conn.execute(text(sql))
            for name, definition in constraints:
                conn.execute(text(f'ALTER TABLE {table} ADD CONSTRAINT "{name}" {definition}'))
            for _, definition in indexes:
                conn.execute(text(definition))
            conn.execute(text(f"VACUUM ANALYZE {table}"))
            rows = int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar() or 0)
            size = str(conn.execute(text(f"SELECT pg_size_pretty(pg_total_relation_size('{table}'))")).scalar())
            out[table] = (rows, size)
            print(f"  {table:<17}{rows:>12,} rows {size:>9} (with indexes) in {time.perf_counter() - t0:5.1f} s",
                  flush=True)
    return out


@dataclass(kw_only=True, slots=True)
class QueryResult:
    name: str
    rows: int
    function_ms: float | None
    server_ms: float
    index: str


def _explain(engine: Engine, sql: str, params: dict[str, Any]) -> tuple[float, str]:
    with engine.connect() as conn:
        plan = [r[0] for r in conn.execute(text(f"EXPLAIN (ANALYZE, BUFFERS) {sql}"), params)]
    ms = next(float(m.group(1)) for line in plan if (m := re.search(r"Execution Time: ([\d.]+) ms", line)))
    scans = [m.group(0) for line in plan if (m := re.search(r"(Index Only Scan|Index Scan|Bitmap Index Scan|Seq Scan)"
                                                             r"( Backward)?( using| on) (\S+)", line))]
    return ms, "; ".join(dict.fromkeys(s.replace(" using ", " ") for s in scans)) or "-"


def _time(fn: Callable[[], Any], repeats: int) -> tuple[float, int]:
    times, n = [], 0
    for _ in range(repeats):
        if sum(times) > 10.0:
            break  # a slow function is reported from fewer runs rather than holding the benchmark
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        if isinstance(out, dict):
            n = len(out["steps"]) * len(out["ranks"])
        else:
            n = len(out) if hasattr(out, "__len__") else 1  # the run overview is one object
    return statistics.median(times) * 1e3, n


def run_queries(engine: Engine, *, repeats: int, tensor_steps: int, window_count: int, raw_steps: int
                ) -> list[QueryResult]:
    sessions = db.make_sessionmaker(engine)
    last = STEPS - 1
    tensor, role = "model.layers.42.linear3", "weight"
    p = {"run": RUN}
    cases: list[tuple[str, Callable[[Any], Any] | None, str, dict[str, Any]]] = [
        (
            "tensor timeline, 1,000 steps",
            lambda s: queries.tensor_timeline(s, run_id=RUN, tensor=tensor, role=role, start=last - 999, end=last),
            "SELECT * FROM tensor_summaries WHERE run_id = :run AND tensor = :tensor AND role = :role "
            "AND step >= :lo AND step <= :hi ORDER BY role, step",
            {**p, "tensor": tensor, "role": role, "lo": last - 999, "hi": last},
        ),
        (
            f"tensor timeline, all {tensor_steps:,} steps",
            lambda s: queries.tensor_timeline(s, run_id=RUN, tensor=tensor, role=role),
            "SELECT * FROM tensor_summaries WHERE run_id = :run AND tensor = :tensor AND role = :role "
            "ORDER BY role, step",
            {**p, "tensor": tensor, "role": role},
        ),
        (
            "worst tensors, 100 steps",
            lambda s: queries.worst_tensors(s, run_id=RUN, start=last - 99, end=last, k=10),
            "SELECT tensor, role, min(headroom_bits), max(amax), sum(CASE WHEN headroom_bits < 0 THEN 1 ELSE 0 END), "
            "max(sat_frac), min(step), max(step) FROM tensor_summaries WHERE run_id = :run AND headroom_bits IS NOT "
            "NULL AND step >= :lo AND step <= :hi GROUP BY tensor, role ORDER BY min(headroom_bits) LIMIT 10",
            {**p, "lo": last - 99, "hi": last},
        ),
        (
            "worst tensors, 1,000 steps",
            lambda s: queries.worst_tensors(s, run_id=RUN, start=last - 999, end=last, k=10),
            "SELECT tensor, role, min(headroom_bits), max(amax), sum(CASE WHEN headroom_bits < 0 THEN 1 ELSE 0 END), "
            "max(sat_frac), min(step), max(step) FROM tensor_summaries WHERE run_id = :run AND headroom_bits IS NOT "
            "NULL AND step >= :lo AND step <= :hi GROUP BY tensor, role ORDER BY min(headroom_bits) LIMIT 10",
            {**p, "lo": last - 999, "hi": last},
        ),
        (
            "step-time matrix (raw steps), 10 steps",
            lambda s: queries.step_time_matrix(s, run_id=RUN, start=last - 9, end=last),
            "SELECT step, rank, incarnation, step_seconds FROM steps WHERE run_id = :run AND step >= :lo "
            "AND step <= :hi ORDER BY step, rank, incarnation LIMIT 2000000",
            {**p, "lo": last - 9, "hi": last},
        ),
        (
            "rank-window matrix, 1,000 steps (20 windows)",
            None,
            "SELECT window_start, rank, step_seconds_mean FROM rank_windows WHERE run_id = :run "
            "AND window_start >= :lo AND window_start <= :hi ORDER BY window_start, rank",
            {**p, "lo": last - 999, "hi": last},
        ),
        (
            "one rank's windows, all",
            None,
            "SELECT window_start, step_seconds_mean FROM rank_windows WHERE run_id = :run AND rank = :rank "
            "ORDER BY window_start",
            {**p, "rank": 4242},
        ),
        (
            "step summaries, 1,000 steps",
            None,
            "SELECT * FROM step_summaries WHERE run_id = :run AND step >= :lo AND step <= :hi ORDER BY step",
            {**p, "lo": last - 999, "hi": last},
        ),
        (
            f"checkpoint generations ({GENERATIONS} x {WORLD_SIZE:,} ranks)",
            lambda s: queries.checkpoint_generations(s, run_id=RUN),
            "SELECT * FROM checkpoints WHERE run_id = :run ORDER BY ts",
            p,
        ),
        (
            "run overview (GET /v1/runs/{run}, query runs)",
            lambda s: queries.run_overview(s, run_id=RUN),
            # Its largest statement: per-rank means over the newest 20 rank windows.
            "SELECT rank, sum(step_seconds_mean * steps), sum(steps) FROM rank_windows WHERE run_id = :run "
            "AND window_start >= :lo GROUP BY rank",
            {**p, "lo": (STEPS // WINDOW - 20) * WINDOW},
        ),
        (
            "findings",
            lambda s: queries.findings(s, run_id=RUN),
            "SELECT * FROM findings WHERE run_id = :run ORDER BY onset_step",
            p,
        ),
    ]
    results = []
    for name, fn, sql, params in cases:
        server_ms, index = _explain(engine, sql, params)
        function_ms, rows = None, -1
        if fn is not None:
            with sessions() as session:
                function_ms, rows = _time(lambda fn=fn, session=session: fn(session), repeats)  # type: ignore[misc]
        else:
            with engine.connect() as conn:
                rows = len(conn.execute(text(sql), params).all())
        results.append(QueryResult(name=name, rows=rows, function_ms=function_ms, server_ms=server_ms, index=index))
        print(f"  timed: {name}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor-steps", type=int, default=2_500)
    parser.add_argument("--window-count", type=int, default=250)
    parser.add_argument("--raw-steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    add_shared_args(parser, server=False)
    args = parser.parse_args()
    print(f"$ {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"machine: {os.cpu_count()} cores, load average before {os.getloadavg()[0]:.2f}; PostgreSQL; run of "
          f"{WORLD_SIZE:,} ranks, {STEPS:,} steps\n")
    with pg_scratch_db(f"{args.db_prefix}_postmortem") as url:
        db.upgrade(url)
        engine = db.make_engine(url)
        try:
            t0 = time.perf_counter()
            sizes = build(engine, tensor_steps=args.tensor_steps, window_count=args.window_count,
                          raw_steps=args.raw_steps)
            print(f"built {sum(r for r, _ in sizes.values()):,} rows in {time.perf_counter() - t0:.0f} s\n")
            results = run_queries(engine, repeats=args.repeats, tensor_steps=args.tensor_steps,
                                  window_count=args.window_count, raw_steps=args.raw_steps)
        finally:
            engine.dispose()
    header = f"{'query':<46}{'rows':>10}{'function ms':>13}{'server ms':>11}  plan (scans)"
    print("\n" + header)
    print("-" * (len(header) + 40))
    for r in results:
        fn = "-" if r.function_ms is None else f"{r.function_ms:.1f}"
        print(f"{r.name:<46}{r.rows:>10,}{fn:>13}{r.server_ms:>11.1f}  {r.index}")
    print("\nfunction ms: the queries.py function as the HTTP API and CLI call it (median of "
          f"{args.repeats}, fewer past 10 s; rows = cells for the matrix); server ms: EXPLAIN ANALYZE "
          "execution time.")


if __name__ == "__main__":
    main()
