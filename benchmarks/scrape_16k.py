"""How long a Prometheus scrape of a live 16,384-rank run takes, on SQLite and PostgreSQL.

    python benchmarks/scrape_16k.py [--backends sqlite,postgresql] [--scrapes 30] [--raw-steps 200]
        [--port P] [--db-prefix tv_bench]

Builds the run directly in a scratch database (INSERT ... SELECT over recursive CTEs: the rows are
generated inside the database, so building takes seconds, not the minutes ingest would), then
starts a real collector (`trainvitals serve`, auth on, a read token) and times `GET /metrics`.

What is stored (defaults), chosen to be what a run looks like after a few hours:

- steps (raw):            --raw-steps newest steps x 16,384 ranks (what the collector keeps as
                          delivered; the snapshot reads the newest step and its timestamp from it)
- step_summaries:         20,000 steps
- tensor_summaries:       2,000 tensors x 3 roles x the newest 100 steps (600,000 rows)
- grad_summaries:         200 groups x 5,000 steps (1,000,000 rows)
- rank_windows:           16,384 ranks x the newest 20 windows of 50 steps (327,680 rows)
- checkpoints (raw):      20 generations x 16,384 ranks x started + persisted (655,360 rows)
- findings:               12; events: a start and 3 failures

The analysis worker is off (TRAINVITALS_RUN_ANALYSIS=false) so it neither rewrites the generated
summaries nor competes with the scrapes; the first scrape is a warm-up and not counted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ingest_throughput import (
    WORLD_SIZE,
    add_shared_args,
    collector,
    create_token,
    percentile,
    registration,
    scratch_db,
)
from sqlalchemy import Engine, text

from trainvitals.service.store.db import make_engine

RUN = "bench-16k"
STEP_SUMMARIES = 20_000
TENSORS, ROLES, TENSOR_STEPS = 2_000, 3, 100
GROUPS, GRAD_STEPS = 200, 5_000
WINDOWS, WINDOW = 20, 50
GENERATIONS = 20


def _series(name: str, n: int) -> str:
    """A CTE of 0..n-1 that SQLite and PostgreSQL both run (no generate_series in SQLite)."""
    return f"{name}(x) AS (SELECT 0 UNION ALL SELECT x + 1 FROM {name} WHERE x < {n - 1})"


def build(engine: Engine, *, raw_steps: int, last_step: int, now: float) -> None:
    """Generate the run's rows inside the database."""
    import json

    first_raw = last_step - raw_steps + 1
    reg = json.dumps(registration(RUN))
    stmts = {
        "runs": (
            "INSERT INTO runs (run_id, project, registration, world_size, status, created_at, last_seen_at) "
            f"VALUES ('{RUN}', 'bench', :reg, {WORLD_SIZE}, 'running', {now - 86_400}, {now})"
        ),
        "steps": (
            f"WITH RECURSIVE {_series('s', raw_steps)}, {_series('r', WORLD_SIZE)} "
            "INSERT INTO steps (run_id, rank, incarnation, step, ts, step_seconds, compute_seconds, "
            "wait_seconds, loss, tokens, flops, pp_stage, tp_rank, dp_rank) "
            f"SELECT '{RUN}', r.x, 1, {first_raw} + s.x, {now} - ({raw_steps} - s.x) * 1.05 + (r.x % 7) * 0.001, "
            "1.0 + (r.x % 97) * 0.0005, 0.8 + (r.x % 89) * 0.001, 0.2, 2.5, 8192, 3.6e14, "
            "(r.x / 8) % 8, r.x % 8, r.x / 64 FROM s, r"
        ),
        "step_summaries": (
            f"WITH RECURSIVE {_series('s', STEP_SUMMARIES)} "
            "INSERT INTO step_summaries (run_id, step, ranks, ts, step_seconds_min, step_seconds_p50, "
            "step_seconds_p90, step_seconds_p99, step_seconds_max, slowest_rank, compute_seconds_p50, "
            "wait_seconds_p50, data_seconds_p50, loss, loss_nonfinite, grad_norm, agent_grad_norm, "
            "grad_nonfinite, tokens, flops, mfu, peak_flops_total) "
            f"SELECT '{RUN}', {last_step - STEP_SUMMARIES + 1} + s.x, {WORLD_SIZE}, "
            f"{now} - ({STEP_SUMMARIES} - s.x) * 1.05, 1.0, 1.02, 1.04, 1.05, 1.06, s.x % {WORLD_SIZE}, "
            "0.8, 0.2, 0.01, 2.5 + (s.x % 13) * 0.01, 0, 0.9, 0.9, 0, 1.3e8, 5.9e18, 0.41, 1.3576e19 FROM s"
        ),
        "tensor_summaries": (
            f"WITH RECURSIVE {_series('s', TENSOR_STEPS)}, {_series('t', TENSORS * ROLES)} "
            "INSERT INTO tensor_summaries (run_id, tensor, role, step, format, amax, headroom_bits, "
            "lag_bits, staleness_steps, sat_frac, underflow_frac, crest_bits, nonfinite, shadow) "
            f"SELECT '{RUN}', 'model.layers.' || (t.x / {ROLES} / 8) || '.linear' || (t.x / {ROLES} % 8), "
            f"CASE t.x % {ROLES} WHEN 0 THEN 'input' WHEN 1 THEN 'weight' ELSE 'grad_output' END, "
            f"{last_step - TENSOR_STEPS + 1} + s.x, 'e4m3', 3.5, 0.5 + (t.x % 101) * 0.05, 0.01, 2, "
            "0.0, 0.0, 4.0, 0, false FROM s, t"
        ),
        "grad_summaries": (
            f"WITH RECURSIVE {_series('s', GRAD_STEPS)}, {_series('g', GROUPS)} "
            "INSERT INTO grad_summaries (run_id, group_name, step, norm, nonfinite, replica_spread) "
            f"SELECT '{RUN}', CASE WHEN g.x = 0 THEN '__global__' ELSE 'layers.' || g.x END, "
            f"{last_step - GRAD_STEPS + 1} + s.x, 0.1 + (g.x % 17) * 0.01, 0, 1.0 FROM s, g"
        ),
        "rank_windows": (
            f"WITH RECURSIVE {_series('w', WINDOWS)}, {_series('r', WORLD_SIZE)} "
            "INSERT INTO rank_windows (run_id, window_start, rank, steps, pp_stage, step_seconds_mean, "
            "step_seconds_p50, step_seconds_max, compute_seconds_mean, wait_seconds_mean) "
            f"SELECT '{RUN}', {(last_step // WINDOW - WINDOWS + 1) * WINDOW} + w.x * {WINDOW}, r.x, "
            f"{WINDOW}, (r.x / 8) % 8, 1.0 + (r.x % 97) * 0.0005, 1.0, 1.1, 0.8 + (r.x % 89) * 0.001, "
            "0.2 FROM w, r"
        ),
        "checkpoints": (
            f"WITH RECURSIVE {_series('g', GENERATIONS)}, {_series('r', WORLD_SIZE)}, {_series('k', 2)} "
            "INSERT INTO checkpoints (run_id, rank, incarnation, step, generation, status, ts, path, bytes, "
            "stall_seconds, persist_seconds, checksum) "
            f"SELECT '{RUN}', r.x, 1, {last_step} - ({GENERATIONS} - g.x) * 500, g.x, "
            "CASE k.x WHEN 0 THEN 'started' ELSE 'persisted' END, "
            f"{now} - ({GENERATIONS} - g.x) * 525.0 + k.x * 30, '/ckpt/gen' || g.x, 2000000000, "
            "CASE k.x WHEN 0 THEN NULL ELSE 4.5 END, CASE k.x WHEN 0 THEN NULL ELSE 30.0 END, "
            "NULL FROM g, r, k"
        ),
        "findings": (
            f"WITH RECURSIVE {_series('f', 12)} "
            "INSERT INTO findings (run_id, kind, severity, subject_kind, subject, onset_step, last_step, "
            "magnitude, summary, active, first_seen_at, updated_at) "
            f"SELECT '{RUN}', CASE f.x % 3 WHEN 0 THEN 'straggler' WHEN 1 THEN 'fp8_headroom' "
            "ELSE 'grad_spike' END, CASE f.x % 2 WHEN 0 THEN 'ticket' ELSE 'page' END, 'rank', "
            f"'' || (f.x * 1000), {last_step} - 500, {last_step}, 2.0, 'generated', true, {now}, {now} FROM f"
        ),
        "events": (
            f"WITH RECURSIVE {_series('e', 4)} "
            "INSERT INTO events (run_id, rank, incarnation, ts, step, event, detail, domains) "
            f"SELECT '{RUN}', e.x * 4096, 1, {now} - 80000 + e.x * 20000, e.x * 1000, "
            "CASE WHEN e.x = 0 THEN 'start' ELSE 'failure' END, NULL, '{}' FROM e"
        ),
    }
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # The cross joins of the CTEs are materialised; enough work_mem keeps them off disk.
            conn.execute(text("SET LOCAL work_mem = '256MB'"))
        for table, sql in stmts.items():
            conn.execute(text(sql), {"reg": reg} if table == "runs" else {})
    with engine.connect() as conn:
        conn.execute(text("ANALYZE"))
        conn.commit()


# Indexes this benchmark recommends (docs/performance.md): the scrape's per-step probe of
# grad_summaries and its newest-persisted-checkpoint probe. Revision 0003 has them since; the DDL
# is kept (IF NOT EXISTS) so the benchmark also runs against an older schema.
RECOMMENDED_INDEXES = (
    "CREATE INDEX IF NOT EXISTS ix_grad_summaries_run_step ON grad_summaries (run_id, step)",
    "CREATE INDEX IF NOT EXISTS ix_checkpoints_run_status_step ON checkpoints (run_id, status, step)",
)


def add_recommended_indexes(engine: Engine) -> None:
    with engine.begin() as conn:
        for ddl in RECOMMENDED_INDEXES:
            conn.execute(text(ddl))
    # Index-only scans need the visibility map that autovacuum keeps up on a live database.
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.execute(text("VACUUM ANALYZE" if conn.dialect.name == "postgresql" else "ANALYZE"))


def count_rows(engine: Engine) -> int:
    tables = ("runs", "steps", "step_summaries", "tensor_summaries", "grad_summaries", "rank_windows",
              "checkpoints", "findings", "events")
    with engine.connect() as conn:
        return sum(int(conn.execute(text(f"SELECT count(*) FROM {t}")).scalar() or 0) for t in tables)


def in_process_ms(engine: Engine, repeats: int = 3) -> tuple[float, float]:
    """Median ms of the two parts of a scrape that read the database: the run snapshot and the
    checkpoint-cadence advice (service/advice.py), timed directly to attribute the scrape time."""
    from trainvitals.service.store import db, queries, snapshot

    sessions = db.make_sessionmaker(engine)
    snap_t, advice_t = [], []
    with sessions() as session:
        run = queries.get_run(session, run_id=RUN)
        assert run is not None
        for _ in range(repeats):
            t0 = time.perf_counter()
            snapshot.run_snapshot(session, run=run, now=time.time(), top_k=10, max_groups=256)
            snap_t.append(time.perf_counter() - t0)
            try:
                from trainvitals.service.analysis.expectations import checkpoint_advice
            except ImportError:  # a collector without cadence advice in /metrics
                continue
            t0 = time.perf_counter()
            checkpoint_advice(session, run_id=RUN, registration=run.registration)
            advice_t.append(time.perf_counter() - t0)
    return percentile(snap_t, 0.5) * 1e3, percentile(advice_t, 0.5) * 1e3


@dataclass(kw_only=True, slots=True)
class ScrapeResult:
    backend: str
    schema: str
    scrapes: int
    first_ms: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    size_kb: float
    series: int
    families: int
    snapshot_ms: float
    advice_ms: float


def scrape(url: str, token: str) -> tuple[float, bytes]:
    req = urllib.request.Request(url, headers={"authorization": f"Bearer {token}"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        body = resp.read()
    return time.perf_counter() - t0, body


def _scrapes(base: str, token: str, *, backend: str, schema: str, scrapes: int, budget_s: float,
             engine: Engine) -> ScrapeResult:
    snapshot_ms, advice_ms = in_process_ms(engine)
    first, body = scrape(base + "/metrics", token)
    times: list[float] = []
    started = time.monotonic()
    # A time budget as well as a count: a slow scrape path must not make the benchmark take hours.
    while len(times) < scrapes and (len(times) < 3 or time.monotonic() - started < budget_s):
        dt, body = scrape(base + "/metrics", token)
        times.append(dt)
    text_body = body.decode()
    if f'trainvitals_run_world_size_ranks{{run="{RUN}"}}' not in text_body:
        raise RuntimeError("the generated run is missing from /metrics")
    lines = text_body.splitlines()
    return ScrapeResult(
        backend=backend,
        schema=schema,
        scrapes=len(times),
        first_ms=first * 1e3,
        p50_ms=percentile(times, 0.5) * 1e3,
        p99_ms=percentile(times, 0.99) * 1e3,
        max_ms=max(times) * 1e3,
        size_kb=len(body) / 1024,
        series=sum(1 for line in lines if line and not line.startswith("#")),
        families=sum(1 for line in lines if line.startswith("# TYPE")),
        snapshot_ms=snapshot_ms,
        advice_ms=advice_ms,
    )


def measure(
    backend: str, *, scrapes: int, raw_steps: int, budget_s: float, port: int = 0, db_prefix: str = "tv_bench"
) -> list[ScrapeResult]:
    now = time.time()
    last_step = 50_000 - 1
    with scratch_db(backend, f"{db_prefix}_scrape") as url:
        token = create_token(url, project="bench", scope="read")  # also migrates the empty database
        engine = make_engine(url)
        try:
            t0 = time.perf_counter()
            build(engine, raw_steps=raw_steps, last_step=last_step, now=now)
            rows = count_rows(engine)
            print(f"[{backend}] {rows:,} rows generated in {time.perf_counter() - t0:.1f} s", flush=True)
            with collector(url, env={"TRAINVITALS_RUN_ANALYSIS": "false"}, port=port) as col:
                print(f"[{backend}] collector: {col.command}", flush=True)
                args = {"backend": backend, "scrapes": scrapes, "budget_s": budget_s, "engine": engine}
                before = _scrapes(col.base, token, schema="migrated (head)", **args)  # type: ignore[arg-type]
                add_recommended_indexes(engine)
                after = _scrapes(col.base, token, schema="after VACUUM ANALYZE", **args)  # type: ignore[arg-type]
        finally:
            engine.dispose()
    return [before, after]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--scrapes", type=int, default=30)
    parser.add_argument("--budget", type=float, default=45.0, help="seconds of scraping per variant, at most")
    parser.add_argument("--raw-steps", type=int, default=200, help="newest raw steps kept x 16,384 ranks")
    add_shared_args(parser)
    args = parser.parse_args()
    print(f"$ {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"machine: {os.cpu_count()} cores, load average before {os.getloadavg()[0]:.2f}; run of "
          f"{WORLD_SIZE} ranks; up to {args.scrapes} scrapes ({args.budget:.0f} s) after a warm-up scrape\n")
    results: list[ScrapeResult] = []
    for backend in args.backends.split(","):
        results += measure(backend, scrapes=args.scrapes, raw_steps=args.raw_steps, budget_s=args.budget,
                           port=args.port, db_prefix=args.db_prefix)  # fmt: skip
    header = (f"{'backend':<11}{'schema':<15}{'n':>4}{'first ms':>9}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}"
              f"{'size KB':>8}{'series':>7}{'families':>9}{'snapshot ms':>12}{'advice ms':>10}")
    print("\n" + header)
    print("-" * len(header))
    for r in results:
        print(f"{r.backend:<11}{r.schema:<15}{r.scrapes:>4}{r.first_ms:>9.0f}{r.p50_ms:>8.0f}{r.p99_ms:>8.0f}"
              f"{r.max_ms:>8.0f}{r.size_kb:>8.1f}{r.series:>7}{r.families:>9}{r.snapshot_ms:>12.0f}"
              f"{r.advice_ms:>10.0f}")
    print("\ntarget: p99 < 1000 ms. snapshot / advice: median in-process time of run_snapshot() and of the "
          "checkpoint-cadence advice, the two parts of a scrape that read the database.")
    print("the scrape's two indexes (ix_grad_summaries_run_step, ix_checkpoints_run_status_step) are in the schema "
          "since revision 0003; the second pass re-runs their DDL (a no-op) and VACUUM ANALYZE / ANALYZE")


if __name__ == "__main__":
    main()
