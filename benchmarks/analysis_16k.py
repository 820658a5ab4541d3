"""How long one analysis cycle takes for a long 16,384-rank run: reduce the new step, build the
detectors' input, run the detectors, store findings.

    python benchmarks/analysis_16k.py [--backend postgresql] [--cycles 6] [--summary-steps 20000]
        [--modes kept,restart,fresh] [--db-prefix tv_bench] [--profile PATH] [--json PATH]

The run is generated inside a scratch database (as scrape_16k.py does): what the collector holds
after ~20,000 steps of a tp 8 x pp 8 x dp 256 run, with the detectors' full lookbacks populated:

- step_summaries and grad_summaries (32 layer groups + global): --summary-steps steps
- tensor_summaries: 32 layers x 4 Linear x 3 roles = 384 tensors x --summary-steps steps
- steps (raw): the newest 650 steps x 16,384 ranks (the straggler lookback is 600)

Then, per cycle, one new step arrives (outside the timed window): 16,384 step rows, 5 gradient
rows and 48 FP8 tensor rows per rank (885k rows, what ingest_throughput.py sends per step), and
one analysis cycle runs, timed by phase. Two ways of building the detectors' input are compared:
`fresh` reads the whole lookback every cycle (what the worker did before DetectorInputs, and what
replay and the first cycle after a start still do); `kept` keeps one DetectorInputs between
cycles, as the worker does now (its first cycle is the fresh read and is reported apart).
`restart` is the first cycle of a worker that starts (or takes the lease over) after a worker that
ran for a while stored its blocks (store/detector_blocks.py; emulated, untimed, by one read over
lookbacks one block longer): it loads the blocks and reads rows only for the steps no block holds,
then later cycles go on as `kept`'s. In `kept` and `restart`, each cycle with a new step is followed
by one without (a live run whose steps take longer than the 2 s between cycles has such cycles),
reported as "no new step": it keeps the data detectors' answer (pipeline.detect_cycle).
Also timed once: the watermark query the worker ran before (a group-by over every raw step row).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench_results import add_json_arg, write_results
from ingest_throughput import LAYERS, LINEARS, PP, ROLES, TP, WORLD_SIZE, registration, scratch_db
from scrape_16k import _series
from sqlalchemy import Engine, text

from trainvitals.service.analysis import detector_inputs, pipeline
from trainvitals.service.analysis.detector_inputs import DetectorInputs
from trainvitals.service.analysis.memory_pages import small_pages_for_numpy
from trainvitals.service.detectors.run_all import DetectorConfig
from trainvitals.service.detectors.suppression import SuppressionConfig
from trainvitals.service.store import db, queries
from trainvitals.service.store.findings import store_findings

RUN = "bench-16k"
RAW_STEPS = 650
LAYERS_PER_RANK = LAYERS // PP
TENSOR_KEYS = LAYERS * len(LINEARS) * len(ROLES)


def _tensor_name_sql(t: str) -> str:
    """'model.layers.<l>.<linear>' and the role from a 0..383 counter, in SQL."""
    roles = len(ROLES)
    linear = " ".join(f"WHEN {i} THEN '{name}'" for i, name in enumerate(LINEARS))
    role = " ".join(f"WHEN {i} THEN '{r}'" for i, (r, _) in enumerate(ROLES))
    return (
        f"'model.layers.' || ({t} / {roles * len(LINEARS)}) || '.' || "
        f"(CASE ({t} / {roles}) % {len(LINEARS)} {linear} END), (CASE {t} % {roles} {role} END)"
    )


def build(engine: Engine, *, summary_steps: int, last_step: int, now: float) -> None:
    import json

    first_raw = last_step - RAW_STEPS + 1
    stmts = [
        (
            "INSERT INTO runs (run_id, project, registration, world_size, status, created_at, last_seen_at) "
            f"VALUES ('{RUN}', 'bench', :reg, {WORLD_SIZE}, 'running', {now - 86_400}, {now})"
        ),
        f"INSERT INTO reduction_state (run_id, reduced_upto, dirty_from) VALUES ('{RUN}', {last_step}, NULL)",
        (
            f"WITH RECURSIVE {_series('s', RAW_STEPS)}, {_series('r', WORLD_SIZE)} "
            "INSERT INTO steps (run_id, rank, incarnation, step, ts, step_seconds, compute_seconds, "
            "wait_seconds, loss, tokens, flops, pp_stage, tp_rank, dp_rank) "
            f"SELECT '{RUN}', r.x, 1, {first_raw} + s.x, {now} - ({RAW_STEPS} - s.x) * 1.05, "
            f"1.0 + (r.x % 97) * 0.0005, 0.8 + (r.x % 89) * 0.001, 0.2, 2.5, 8192, 3.6e14, "
            f"(r.x / {TP}) % {PP}, r.x % {TP}, r.x / {TP * PP} FROM s, r"
        ),
        (
            f"WITH RECURSIVE {_series('s', summary_steps)} "
            "INSERT INTO step_summaries (run_id, step, ranks, ts, step_seconds_min, step_seconds_p50, "
            "step_seconds_p90, step_seconds_p99, step_seconds_max, slowest_rank, compute_seconds_p50, "
            "wait_seconds_p50, data_seconds_p50, loss, loss_nonfinite, grad_norm, agent_grad_norm, "
            "grad_nonfinite, tokens, flops, mfu, peak_flops_total) "
            f"SELECT '{RUN}', {last_step - summary_steps + 1} + s.x, {WORLD_SIZE}, "
            f"{now} - ({summary_steps} - s.x) * 1.05, 1.0, 1.02, 1.04, 1.05, 1.06, s.x % {WORLD_SIZE}, "
            "0.8, 0.2, 0.01, 2.5 - s.x * 0.00005 + (s.x % 13) * 0.01, 0, 0.9, 0.9, 0, 1.3e8, 5.9e18, 0.41, 1.3576e19 "
            "FROM s"
        ),
        (
            f"WITH RECURSIVE {_series('s', summary_steps)}, {_series('t', TENSOR_KEYS)} "
            "INSERT INTO tensor_summaries (run_id, tensor, role, step, format, amax, headroom_bits, "
            "lag_bits, staleness_steps, sat_frac, underflow_frac, crest_bits, nonfinite, shadow) "
            f"SELECT '{RUN}', {_tensor_name_sql('t.x')}, {last_step - summary_steps + 1} + s.x, 'e4m3', "
            "3.5 + (s.x % 7) * 0.01, 2.0 + (t.x % 11) * 0.05 + (s.x % 5) * 0.01, 0.01, 2, "
            "NULL, NULL, NULL, NULL, false FROM s, t"
        ),
        (
            f"WITH RECURSIVE {_series('s', summary_steps)}, {_series('g', LAYERS + 1)} "
            "INSERT INTO grad_summaries (run_id, group_name, step, norm, nonfinite, replica_spread) "
            f"SELECT '{RUN}', CASE WHEN g.x = {LAYERS} THEN '__global__' ELSE 'layers.' || g.x END, "
            f"{last_step - summary_steps + 1} + s.x, 0.1 + (g.x % 17) * 0.01 + (s.x % 3) * 0.001, 0, 1.0 FROM s, g"
        ),
    ]
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SET LOCAL work_mem = '256MB'"))
        for sql in stmts:
            conn.execute(
                text(sql), {"reg": json.dumps(registration(RUN))} if sql.startswith("INSERT INTO runs") else {}
            )
    with engine.connect() as conn:
        conn.execute(text("ANALYZE"))
        conn.commit()


def add_step(engine: Engine, step: int, now: float) -> None:
    """One new step of every rank, as ingest stores it (not timed)."""
    per_rank_tensors = LAYERS_PER_RANK * len(LINEARS) * len(ROLES)
    stage = f"((r.x / {TP}) % {PP})"
    stmts = [
        (
            f"WITH RECURSIVE {_series('r', WORLD_SIZE)} "
            "INSERT INTO steps (run_id, rank, incarnation, step, ts, step_seconds, compute_seconds, "
            "wait_seconds, loss, tokens, flops, pp_stage, tp_rank, dp_rank) "
            f"SELECT '{RUN}', r.x, 1, {step}, {now}, 1.0 + (r.x % 97) * 0.0005, 0.8, 0.2, 2.4, 8192, 3.6e14, "
            f"{stage}, r.x % {TP}, r.x / {TP * PP} FROM r"
        ),
        (
            f"WITH RECURSIVE {_series('r', WORLD_SIZE)}, {_series('g', LAYERS_PER_RANK + 1)} "
            "INSERT INTO grad_stats (run_id, rank, incarnation, step, group_name, owned_sq, local_sq, nonfinite) "
            f"SELECT '{RUN}', r.x, 1, {step}, CASE WHEN g.x = {LAYERS_PER_RANK} THEN '__global__' "
            f"ELSE 'layers.' || ({stage} * {LAYERS_PER_RANK} + g.x) END, 0.0001, 0.01, 0 FROM r, g"
        ),
        (
            f"WITH RECURSIVE {_series('r', WORLD_SIZE)}, {_series('t', per_rank_tensors)} "
            "INSERT INTO tensor_stats (run_id, rank, incarnation, step, tensor, role, format, amax, scale, "
            "headroom_bits, lag_bits, staleness_steps, shadow) "
            f"SELECT '{RUN}', r.x, 1, {step}, "
            f"{_tensor_name_sql(f'({stage} * {per_rank_tensors} + t.x)')}, 'e4m3', 3.5 + (r.x % 71) * 0.01, 112.5, "
            "1.5, 0.02, 3, false FROM r, t"
        ),
    ]
    with engine.begin() as conn:
        for sql in stmts:
            conn.execute(text(sql))


def cycle(session_factory, *, now: float, config: pipeline.PipelineConfig, inputs: DetectorInputs | None) -> dict:
    """One analysis cycle (pipeline.process_run's steps), timed by phase."""
    out = {}
    with session_factory() as session:
        run = queries.get_run(session, run_id=RUN)
        t0 = time.perf_counter()
        reduced, first = pipeline.reduce_steps(session, run, now=now, config=config)
        t1 = time.perf_counter()
        series = pipeline.build_series(session, run, now=now, config=config, inputs=inputs, rewritten_from=first)
        t2 = time.perf_counter()
        cfg = DetectorConfig(suppression=SuppressionConfig(warmup_steps=config.detector_warmup_steps))
        findings = pipeline.detect_cycle(series, inputs=inputs or DetectorInputs(), config=cfg)
        t3 = time.perf_counter()
        store_findings(session, run_id=RUN, findings=findings, now=now)
        t4 = time.perf_counter()
    out.update(reduced=reduced, reduce=t1 - t0, inputs=t2 - t1, detect=t3 - t2, store=t4 - t3, total=t4 - t0)
    return out


def store_all_blocks(session_factory, *, now: float, config: pipeline.PipelineConfig) -> int:
    """Store every block a worker that has been running for a while holds: its input covered each
    block whole at some cycle, the one the lookback now starts inside included. Emulated by one
    read with each lookback one block longer; returns how many blocks the run has."""
    import dataclasses

    limit = detector_inputs._SAVES_PER_CYCLE
    detector_inputs._SAVES_PER_CYCLE = 10**6
    sizes = detector_inputs.BLOCK_STEPS
    wider = dataclasses.replace(
        config,
        detector_lookback_steps=config.detector_lookback_steps + max(sizes["summaries"], sizes["tensors"]),
        straggler_lookback_steps=config.straggler_lookback_steps + sizes["timing"],
    )
    inputs = DetectorInputs(blocks=True)
    try:
        with session_factory() as session:
            run = queries.get_run(session, run_id=RUN)
            pipeline.build_series(session, run, now=now, config=wider, inputs=inputs, rewritten_from=None)
            session.commit()
            return sum(len(v) for v in (inputs._stored or {}).values())
    finally:
        detector_inputs._SAVES_PER_CYCLE = limit


def block_sizes(engine: Engine) -> str:
    """The stored blocks' payload bytes by source: what a restart's first cycle loads."""
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT source, count(*), sum(length(payload)) FROM detector_blocks GROUP BY source"))
        return ", ".join(f"{src} {n} x {size / n / 1e6:.1f} MB = {size / 1e6:.0f} MB" for src, n, size in sorted(rows))


def profiled(path: str, fn, *args, **kwargs):
    """fn(*args, **kwargs) under cProfile: its stats saved to path, the top 25 by cumulative time printed."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    out = prof.runcall(fn, *args, **kwargs)
    prof.dump_stats(path)
    print(f"profile of the first cycle ({path}; its times include the profiler's overhead):")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(25)
    return out


def old_watermark_seconds(engine: Engine) -> float:
    """The query the worker ran every cycle before: max step per rank over all of the run's rows."""
    t0 = time.perf_counter()
    with engine.connect() as conn:
        conn.execute(text(f"SELECT rank, max(step) FROM steps WHERE run_id = '{RUN}' GROUP BY rank")).all()
    return time.perf_counter() - t0


def rss_mb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MB: the analysis process's memory."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="postgresql", choices=("postgresql", "sqlite"))
    parser.add_argument("--cycles", type=int, default=6, help="timed cycles per mode")
    parser.add_argument("--summary-steps", type=int, default=20_000)
    parser.add_argument("--modes", default="kept,restart,fresh", help="comma-separated: kept, restart, fresh")
    parser.add_argument("--db-prefix", default="tv_bench", help="name prefix of the scratch database")
    parser.add_argument(
        "--profile",
        metavar="PATH",
        help="cProfile each mode's first cycle into PATH-<mode>.pstats "
        "and print its 25 costliest functions (cumulative)",
    )
    add_json_arg(parser)
    args = parser.parse_args()
    modes = [m for m in ("kept", "restart", "fresh") if m in args.modes.split(",")]
    print("$ python benchmarks/analysis_16k.py " + " ".join(sys.argv[1:]))
    # This process stands for `trainvitals analyse`, so it takes that process's memory settings.
    print(f"numpy huge pages: {small_pages_for_numpy()} (as trainvitals analyse; NUMPY_MADVISE_HUGEPAGE=1 compares)")
    config = pipeline.PipelineConfig(settle_seconds=30.0)
    now = time.time()
    last = args.summary_steps - 1
    with scratch_db(args.backend, f"{args.db_prefix}_analysis") as url:
        db.upgrade(url)
        engine = db.make_engine(url)
        t0 = time.perf_counter()
        build(engine, summary_steps=args.summary_steps, last_step=last, now=now)
        print(f"built in {time.perf_counter() - t0:.0f} s: {args.summary_steps:,} steps of summaries "
              f"({TENSOR_KEYS} tensors), {RAW_STEPS} raw steps x {WORLD_SIZE:,} ranks")  # fmt: skip
        print(f"old watermark query (every raw step row): {old_watermark_seconds(engine):.2f} s")
        factory = db.make_sessionmaker(engine)
        step = last
        results: dict[str, list[dict]] = {}
        idle: dict[str, list[dict]] = {}
        memory = {}
        for mode in modes:  # kept first: its peak memory is not the fresh reads
            if mode == "restart":  # the kept worker stores every block it holds (untimed), then stops
                t0 = time.perf_counter()
                saved = store_all_blocks(factory, now=now, config=config)
                print(f"stored {saved} blocks in {time.perf_counter() - t0:.0f} s (untimed): {block_sizes(engine)}",
                      flush=True)  # fmt: skip
            inputs = DetectorInputs(blocks=True) if mode in ("kept", "restart") else None
            rows = []
            for _ in range(args.cycles + (mode != "fresh")):
                step += 1
                now += 1.05
                add_step(engine, step, now)
                if args.profile and not rows:
                    rows.append(profiled(f"{args.profile}-{mode}.pstats", cycle, factory, now=now, config=config,
                                         inputs=inputs))  # fmt: skip
                else:
                    rows.append(cycle(factory, now=now, config=config, inputs=inputs))
                assert rows[-1]["reduced"] == 1, rows[-1]
                if mode != "fresh":  # and a cycle before the next step arrives, as most live cycles are
                    now += 1.05
                    idle.setdefault(mode, []).append(cycle(factory, now=now, config=config, inputs=inputs))
                    assert idle[mode][-1]["reduced"] == 0, idle[mode][-1]
            results[mode] = rows
            memory[mode] = rss_mb()
        engine.dispose()

    print(f"\nbackend {args.backend}; seconds per analysis cycle (one new step of {WORLD_SIZE:,} ranks), median "
          f"[min, max] over {args.cycles} cycles")  # fmt: skip
    print(f"{'inputs':<22}{'reduce':>22}{'detector inputs':>22}{'detectors':>22}{'total':>22}")
    labelled = [
        ("fresh every cycle", results.get("fresh", [])),
        ("kept: first cycle", results.get("kept", [])[:1]),
        ("kept: later cycles", results.get("kept", [])[1:]),
        ("restart: first cycle", results.get("restart", [])[:1]),
        ("restart: later cycles", results.get("restart", [])[1:]),
        ("kept: no new step", idle.get("kept", [])),
        ("restart: no new step", idle.get("restart", [])),
    ]
    for label, rows in labelled:
        if not rows:
            continue
        cells = []
        for key in ("reduce", "inputs", "detect", "total"):
            v = [r[key] for r in rows]
            cells.append(f"{statistics.median(v):.2f} [{min(v):.2f}, {max(v):.2f}]")
        print(f"{label:<22}" + "".join(f"{c:>22}" for c in cells))
    print("\nmemory of this process (the analysis process), after each mode's cycles:")
    for mode, (rss, hwm) in memory.items():
        print(f"  {mode:<8} RSS {rss:.0f} MB, peak so far {hwm:.0f} MB")
    write_results(
        args.json,
        benchmark="analysis_16k",
        command=sys.argv,
        results={
            "backend": args.backend,
            "ranks": WORLD_SIZE,
            # seconds of each timed cycle, by phase, under the table's row labels
            "cycles": {label: [{k: r[k] for k in ("reduce", "inputs", "detect", "total")} for r in rows]
                       for label, rows in labelled if rows},  # fmt: skip
            "peak_mb": max((hwm for _, hwm in memory.values()), default=None),
        },
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
