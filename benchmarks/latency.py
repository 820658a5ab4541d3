"""Latency from step to screen: how long after a rank finishes a step it shows in the run overview
and in /metrics, and how long until it is a reduced complete step.

    python benchmarks/latency.py [--backend sqlite|postgresql] [--ranks 4] [--step-seconds 0.5]
        [--seconds 60] [--journal] [--port P] [--db-prefix tv_bench] [--json PATH]

Starts `trainvitals serve` (auth on, analysis on, every default; with --journal, the ingest journal
in a scratch directory, so batches are answered before their commit) on a scratch database and
`--ranks` processes that each attach the real agent (`trainvitals.agent.attach`, its default 2 s
send interval, no model) and call `agent.step()` on a shared clock: step k ends at t0 +
(k + 1) x --step-seconds on every rank. Meanwhile this process polls the run overview
(`GET /v1/runs/{run}`: last_step) and `/metrics` (trainvitals_run_latest_step,
trainvitals_run_complete_step) every 50 ms and notes when each step first shows. Latency of a step
= when it showed - when it ended. Reported: median and max over the steps of the measurement window,
and the bound the collector is held to: the send interval plus one analysis cycle (the analysis
interval plus the longest cycle the collector recorded, trainvitals_analysis_last_cycle_seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_results import add_json_arg, write_results
from ingest_throughput import add_shared_args, collector, create_token, scratch_db

RUN = "bench-latency"
SEND_INTERVAL_S = 2.0  # AgentConfig's default, which the ranks keep
POLL_S = 0.05


def rank_main(rank: int, world: int, base: str, token: str, t0: float, period: float, steps: int) -> None:
    """One rank: the real agent, one step per period on the shared clock."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), TRAINVITALS_RUN=RUN)
    from trainvitals.agent import AgentConfig, attach

    agent = attach(config=AgentConfig(collector=base, token=token, project="bench"))
    for k in range(steps):
        time.sleep(max(0.0, t0 + (k + 1) * period - time.time()))
        agent.step(loss=2.0 - k * 1e-4, tokens=4096, step=k)
    agent.close(timeout=30)


def _get(url: str, token: str) -> bytes:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.read()


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and f'run="{RUN}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def _first_seen(seen: dict[int, float], newest: float | None, at: float) -> None:
    """Every step up to `newest` not seen before is seen at `at`."""
    if newest is None:
        return
    for k in range(max(seen, default=-1) + 1, int(newest) + 1):
        seen[k] = at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="sqlite", choices=("sqlite", "postgresql"))
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--step-seconds", type=float, default=0.5)
    parser.add_argument("--seconds", type=float, default=60.0, help="steps made for this long")
    parser.add_argument("--warmup", type=float, default=10.0, help="steps of the first seconds are not counted")
    parser.add_argument(
        "--journal", action="store_true", help="serve --ingest-journal (a scratch directory): answered once journaled"
    )
    add_shared_args(parser)
    add_json_arg(parser)
    parser.add_argument("--rank-child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_child:
        rank, world, base, token, t0, steps = args.rank_child
        rank_main(int(rank), int(world), base, token, float(t0), args.step_seconds, int(steps))
        return
    print("$ python benchmarks/latency.py " + " ".join(sys.argv[1:]), flush=True)
    steps = int(args.seconds / args.step_seconds)
    journal_scratch = tempfile.TemporaryDirectory(prefix=f"{args.db_prefix}_journal_") if args.journal else None
    with scratch_db(args.backend, f"{args.db_prefix}_latency") as url, journal_scratch or contextlib.nullcontext():
        ingest = create_token(url, project="bench", scope="ingest")
        read = create_token(url, project="bench", scope="read")
        extra = ("--ingest-journal", journal_scratch.name) if journal_scratch else ()
        with collector(url, port=args.port, extra_args=extra) as col:
            print(f"collector: {col.command}", flush=True)
            t0 = time.time() + 8.0  # the ranks import torch and attach meanwhile
            ranks = [
                subprocess.Popen([sys.executable, __file__, "--step-seconds", str(args.step_seconds),
                                  "--rank-child", str(r), str(args.ranks), col.base, ingest, str(t0), str(steps)])
                for r in range(args.ranks)
            ]  # fmt: skip
            overview: dict[int, float] = {}
            latest: dict[int, float] = {}
            complete: dict[int, float] = {}
            cycle_max = 0.0
            journal_acks = 0.0  # batches answered before their commit (--journal)
            try:
                deadline = t0 + steps * args.step_seconds + 60.0
                while time.time() < deadline and (not complete or max(complete) < steps - 1):
                    at = time.time()
                    try:
                        last = json.loads(_get(f"{col.base}/v1/runs/{RUN}", read)).get("last_step")
                    except OSError:  # 404 until the run registers
                        last = None
                    _first_seen(overview, last, at)
                    text = _get(f"{col.base}/metrics", read).decode()
                    _first_seen(latest, _metric(text, "trainvitals_run_latest_step"), at)
                    _first_seen(complete, _metric(text, "trainvitals_run_complete_step"), at)
                    for line in text.splitlines():
                        if line.startswith("trainvitals_analysis_last_cycle_seconds "):
                            cycle_max = max(cycle_max, float(line.split()[1]))
                        elif line.startswith("trainvitals_ingest_journal_acks_total "):
                            journal_acks = float(line.split()[1])
                    time.sleep(max(0.0, POLL_S - (time.time() - at)))
            finally:
                for p in ranks:
                    try:
                        p.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
            interval = _analysis_interval()
    first = int(args.warmup / args.step_seconds)
    journal = f"; {journal_acks:.0f} batches acknowledged from the ingest journal" if args.journal else ""
    print(f"\n{args.ranks} ranks, a step every {args.step_seconds} s, send interval {SEND_INTERVAL_S} s, "
          f"{args.backend}; steps {first}..{steps - 1} counted (after {args.warmup:.0f} s of warm-up)"
          + journal)  # fmt: skip
    print(f"{'shown in':<34}{'median s':>10}{'max s':>10}{'steps':>8}")
    shown: dict[str, dict[str, float | int | None]] = {}
    for key, label, seen in (
        ("run_overview", "run overview (last_step)", overview),
        ("latest_step", "/metrics (run_latest_step)", latest),
        ("complete_step", "/metrics (run_complete_step)", complete),
    ):
        lat = [seen[k] - (t0 + (k + 1) * args.step_seconds) for k in range(first, steps) if k in seen]
        if lat:
            print(f"{label:<34}{statistics.median(lat):>10.2f}{max(lat):>10.2f}{len(lat):>8}")
        else:
            print(f"{label:<34}{'-':>10}{'-':>10}{0:>8}")
        shown[key] = {"median_s": statistics.median(lat) if lat else None, "max_s": max(lat, default=None),
                      "steps": len(lat), "steps_expected": steps - first}  # fmt: skip
    bound = SEND_INTERVAL_S + interval + cycle_max
    print(f"\nbound: send interval {SEND_INTERVAL_S} s + one analysis cycle (interval {interval} s + longest "
          f"cycle seen {cycle_max:.2f} s) = {bound:.2f} s")  # fmt: skip
    write_results(args.json, benchmark="latency", command=sys.argv,
                  results={"backend": args.backend, "ranks": args.ranks, "bound_s": bound,
                           "journal_acks": journal_acks if args.journal else None, **shown})  # fmt: skip


def _analysis_interval() -> float:
    from trainvitals.service.settings import Settings

    return float(Settings().analysis_interval_seconds)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
