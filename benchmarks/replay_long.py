"""Time `trainvitals replay` of a long recording: ingest, then the analysis of the whole run.

    python benchmarks/replay_long.py [--family healthy_long] [--seed 0] [--db sqlite|postgresql]

The recording is a `trainvitals.testing.scenarios` run (healthy_long: 100,000 steps) on the small
layout the replay tests use (2 ranks, 3 layers: 29 records per step), written as wire-format JSONL.
It is replayed into a scratch database in two timed phases, the two halves of `replay_files`:
storing the batches (`replay_files(..., analyse=False)`), then the analysis replay runs for each run
(`pipeline.process_run` as of the recording's end). Prints both times and the stored findings.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from ingest_throughput import add_shared_args, scratch_db

from trainvitals.service.analysis import pipeline
from trainvitals.service.ingest.replay import replay_files
from trainvitals.service.store import db, queries
from trainvitals.testing.scenarios import Layout, make_scenario, to_wire_lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--family", default="healthy_long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--catch-up-steps", type=int, default=None, help="PipelineConfig.catch_up_steps")
    add_shared_args(parser, server=False)
    args = parser.parse_args()

    sc = make_scenario(args.family, args.seed, layout=Layout(pp=2, dp=1, ranks_per_node=2, layers=3))
    work = tempfile.mkdtemp(prefix="tv_replay_long_")
    path = os.path.join(work, "run.jsonl")
    with open(path, "w") as fh:
        fh.writelines(line if line.endswith("\n") else line + "\n" for line in to_wire_lines(sc))
    try:
        with scratch_db(args.db, f"{args.db_prefix}_replay_long") as url:
            db.upgrade(url)
            engine = db.make_engine(url)
            with db.make_sessionmaker(engine)() as session:
                t0 = time.perf_counter()
                report = replay_files(session, [path], analyse=False)
                t1 = time.perf_counter()
                # The run's key as stored: a scenario's registration names its project (`<project>/<run>`).
                (key,) = report.runs
                run = queries.get_run(session, run_id=key)
                assert run is not None
                now = queries.last_step_time(session, run_id=run.run_id) or time.time()
                config = pipeline.PipelineConfig(catch_up_steps=args.catch_up_steps)
                pipeline.process_run(session, run, now=now, config=config)
                t2 = time.perf_counter()
                found = queries.findings(session, run_id=run.run_id)
            engine.dispose()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    steps = len(sc.series.steps.steps)
    print(f"{args.family} seed {args.seed}: {steps:,} steps, {report.records:,} records, {args.db}")
    print(f"ingest {t1 - t0:.1f} s, analysis {t2 - t1:.1f} s, total {t2 - t0:.1f} s")
    for f in sorted(found, key=lambda r: (r["onset_step"], r["kind"])):
        print(f"  {f['severity']:6} {f['kind']:24} {f['subject']:24} onset {f['onset_step']:>7} active {f['active']}")


if __name__ == "__main__":
    main()
