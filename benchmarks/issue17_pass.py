"""Issue 17's measurements in one command, and where each of its targets stands on this machine.

    python benchmarks/issue17_pass.py [--out DIR] [--db-prefix tv_bench] [--port P]
        [--only agent,closed,open-sqlite,open-postgresql,...,16k]  (--help lists every name)

Runs, one after another, the commands docs/performance.md quotes for each target (about 40
minutes on a 2-core machine; run nothing else beside it, the numbers are the machine's):

    agent_overhead.py --rounds 1 --long-steps 600 --configs default
    ingest_throughput.py --backends sqlite,postgresql --clients 16 --seconds 60 --warmup 10
    ingest_throughput.py --backends B --rate 100000 --seconds 90 --warmup 30 --floor-seconds 0 --clients 16
    the same three ingest runs with --journal (the collector's ingest journal on)
    latency.py --backend B
    latency.py --backend B --journal
    analysis_16k.py --cycles 2 --modes kept,restart

(B: sqlite, then postgresql.) Each one's report goes to DIR/<name>.log, and to the terminal without
the collector's info lines; its headline numbers to DIR/<name>.json (`--json`). Then a table of
each target against what was measured, with the machine, printed and written to DIR/summary.md.
Exit status 0 when every benchmark ran (met or not: the table says), 1 when one failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_results import describe, machine

HERE = Path(__file__).resolve().parent

# Issue 17's targets.
AGENT_OVERHEAD_PCT = 0.5
INGEST_RATIO = 0.7
OPEN_LOOP_RATE = 100_000
OPEN_LOOP_P99_MS = 50.0
FIRST_CYCLE_S = 10.0
BACKENDS = ("sqlite", "postgresql")


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str
    args: str
    takes_port: bool = True


OPEN_LOOP = f"--rate {OPEN_LOOP_RATE} --seconds 90 --warmup 30 --floor-seconds 0 --clients 16"
BENCHMARKS = (
    Benchmark("agent", "agent_overhead.py", "--rounds 1 --long-steps 600 --configs default", takes_port=False),
    Benchmark("closed", "ingest_throughput.py", "--backends sqlite,postgresql --clients 16 --seconds 60 --warmup 10"),
    Benchmark("open-sqlite", "ingest_throughput.py", f"--backends sqlite {OPEN_LOOP}"),
    Benchmark("open-postgresql", "ingest_throughput.py", f"--backends postgresql {OPEN_LOOP}"),
    # The same three with the ingest journal (serve --ingest-journal: acknowledged before the commit).
    Benchmark(
        "closed-journal",
        "ingest_throughput.py",
        "--backends sqlite,postgresql --clients 16 --seconds 60 --warmup 10 --journal",
    ),
    Benchmark("open-sqlite-journal", "ingest_throughput.py", f"--backends sqlite {OPEN_LOOP} --journal"),
    Benchmark("open-postgresql-journal", "ingest_throughput.py", f"--backends postgresql {OPEN_LOOP} --journal"),
    Benchmark("latency-sqlite", "latency.py", "--backend sqlite"),
    Benchmark("latency-postgresql", "latency.py", "--backend postgresql"),
    Benchmark("latency-sqlite-journal", "latency.py", "--backend sqlite --journal"),
    Benchmark("latency-postgresql-journal", "latency.py", "--backend postgresql --journal"),
    Benchmark("16k", "analysis_16k.py", "--cycles 2 --modes kept,restart", takes_port=False),
)


@dataclass(frozen=True)
class Verdict:
    item: str
    target: str
    measured: str
    met: bool | None
    """None: not measured (its benchmark was not run or did not finish)."""


def command(b: Benchmark, *, json_path: Path, db_prefix: str, port: int | None) -> list[str]:
    """The benchmark's command line; each gets its own database names (`<prefix>_<name>`)."""
    cmd = [sys.executable, str(HERE / b.script), *b.args.split(), "--json", str(json_path)]
    if b.script != "agent_overhead.py":  # the agent's benchmark makes no database
        cmd += ["--db-prefix", f"{db_prefix}_{b.name.replace('-', '_')}"]
    if port is not None and b.takes_port:
        cmd += ["--port", str(port)]
    return cmd


def run(b: Benchmark, cmd: list[str], log: Path) -> int:
    """Run cmd; its output to log, and to the terminal without the collector's info lines."""
    print(
        f"\n=== {b.name} {time.strftime('%H:%M:%S', time.gmtime())} UTC, load average "
        f"{os.getloadavg()[0]:.2f}: {' '.join(cmd)}",
        flush=True,
    )
    with (
        log.open("w") as fh,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE.parent) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            if "level=info" not in line:
                print(line, end="", flush=True)
        return proc.wait()


# --------------------------------------------------------------------------- verdicts


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def _ratio(value: float) -> str:
    """Two decimals, or three where two would round a miss up to the target (0.696 is not 0.70)."""
    two = f"{value:.2f}"
    return f"{value:.3f}" if value < INGEST_RATIO and float(two) >= INGEST_RATIO else two


def _backend(results: dict[str, Any] | None, backend: str) -> dict[str, Any] | None:
    if results is None:
        return None
    return next((r for r in results["backends"] if r["backend"] == backend), None)


def agent_verdicts(agent: dict[str, Any] | None) -> list[Verdict]:
    amortised = agent["amortised"] if agent else None
    item, target = "1. agent overhead, amortised", f"<= {AGENT_OVERHEAD_PCT}% of the step"
    if amortised is None:
        overhead = Verdict(item, target, "not measured", None)
    else:
        overhead = Verdict(
            item,
            target,
            f"{amortised['amortised_pct']:+.2f}% ({amortised['amortised_ms']:.3f} ms of a "
            f"{amortised['baseline_step_ms']:.1f} ms step); training-thread CPU {amortised['amortised_cpu_pct']:+.2f}%",
            amortised["amortised_pct"] <= AGENT_OVERHEAD_PCT,
        )
    # A peer's cost: the time inside its own calls where it has them (the loggers), else the step's
    # difference (wandb.watch's hooks): what the agent's own table reports.
    peers = [c for c in (agent["per_step_cost"] if agent else []) if not c["name"].startswith("trainvitals")]
    measured = "; ".join(
        f"{c['name']} {_fmt(c['diff_pct'] if c['direct_pct'] is None else c['direct_pct'], '+.2f', '%')}" for c in peers
    )
    wanted = "logger, TensorBoard and wandb.watch measured beside the agent"
    return [overhead, Verdict("2. peers in the same run", wanted, measured or "not measured", bool(peers) or None)]


def ingest_verdicts(
    closed: dict[str, Any] | None, open_loops: dict[str, dict[str, Any] | None], label: str = ""
) -> list[Verdict]:
    """Item 3's rows; `label` follows each row's name (", ingest journal")."""
    out = []
    for backend in BACKENDS:
        item, target = f"3. ingest / raw-insert floor, {backend}, closed loop of 16{label}", f">= {INGEST_RATIO}"
        r = _backend(closed, backend)
        if r is None or r.get("ratio_to_floor") is None:
            out.append(Verdict(item, target, "not measured", None))
            continue
        measured = (
            f"{_ratio(r['ratio_to_floor'])} ({r['records_per_s']:,.0f} of a floor of "
            f"{r['floor']['records_per_s']:,.0f} records/s; CPU ceiling {r['cpu_ceiling_of_floor']:.2f}, "
            f"cores {r['busy']:.0%} busy)"
        )
        out.append(Verdict(item, target, measured, r["ratio_to_floor"] >= INGEST_RATIO))
    for backend in BACKENDS:
        item, target = f"3. p99 at {OPEN_LOOP_RATE:,} records/s, {backend}{label}", f"< {OPEN_LOOP_P99_MS:.0f} ms"
        r = _backend(open_loops.get(backend), backend)
        if r is None:
            out.append(Verdict(item, target, "not measured", None))
            continue
        p99 = f"{'>' if r['p99_lower_bound'] else ''}{r['p99_ms']:.1f} ms"
        if r["kept_up"]:
            # From each batch's scheduled send: a send that started late (the collector's stall, or
            # the client's one request in flight still out) counts, as it would for an agent.
            how = f"sends up to {r['late_max_ms']:.0f} ms late, answers' own p99 {r['answer_p99_ms']:.1f} ms"
            out.append(Verdict(item, target, f"{p99}, kept up ({how})", r["p99_ms"] < OPEN_LOOP_P99_MS))
        else:
            out.append(
                Verdict(item, target, f"did not keep up ({r['records_per_s']:,.0f} records/s; p99 {p99})", False)
            )
    return out


def analysis_verdict(analysis: dict[str, Any] | None) -> Verdict:
    item, target = "4. first analysis cycle after a restart, 16,384 ranks", f"< {FIRST_CYCLE_S:.0f} s"
    first = (analysis or {}).get("cycles", {}).get("restart: first cycle")
    if not first:
        return Verdict(item, target, "not measured", None)
    c = first[0]
    return Verdict(
        item,
        target,
        f"{c['total']:.2f} s (reduce {c['reduce']:.2f}, detector input {c['inputs']:.2f}, "
        f"detectors {c['detect']:.2f}); peak {_fmt(analysis and analysis.get('peak_mb'), ',.0f', ' MB')}",
        c["total"] < FIRST_CYCLE_S,
    )


def latency_verdicts(latency: dict[str, dict[str, Any] | None], label: str = "") -> list[Verdict]:
    """Item 5's rows; `label` follows each row's name (", ingest journal")."""
    out = []
    for backend in BACKENDS:
        r = latency.get(backend)
        item = f"5. step to screen, {backend}{label}"
        target = "a reduced complete step within the send interval + one analysis cycle"
        complete = r["complete_step"] if r else None
        if complete is None or complete["max_s"] is None:
            out.append(Verdict(item, target, "not measured", None))
            continue
        overview = r["run_overview"]
        out.append(
            Verdict(
                item,
                target,
                f"max {complete['max_s']:.2f} s against {r['bound_s']:.2f} (median {complete['median_s']:.2f}, "
                f"{complete['steps']} of {complete['steps_expected']} steps); run overview median "
                f"{_fmt(overview['median_s'], '.2f', ' s')}",
                complete["max_s"] <= r["bound_s"] and complete["steps"] == complete["steps_expected"],
            )
        )
    return out


def verdicts(files: dict[str, dict[str, Any] | None]) -> list[Verdict]:
    """Each target of issue 17 against the results files of one pass, by benchmark name (None:
    not run or no file)."""

    def results(name: str) -> dict[str, Any] | None:
        payload = files.get(name)
        return None if payload is None else payload["results"]

    def by_backend(name: str) -> dict[str, dict[str, Any] | None]:
        """Each backend's results of the benchmark named `name` with "{b}" for the backend."""
        return {b: results(name.format(b=b)) for b in BACKENDS}

    journal_ingest: list[Verdict] = []
    if any(name in files for name in ("closed-journal", *(f"open-{b}-journal" for b in BACKENDS))):  # run or tried
        journal_ingest = ingest_verdicts(results("closed-journal"), by_backend("open-{b}-journal"), ", ingest journal")
    journal_latency: list[Verdict] = []
    if any(f"latency-{b}-journal" in files for b in BACKENDS):
        journal_latency = latency_verdicts(by_backend("latency-{b}-journal"), ", ingest journal")
    return [
        *agent_verdicts(results("agent")),
        *ingest_verdicts(results("closed"), by_backend("open-{b}")),
        *journal_ingest,
        analysis_verdict(results("16k")),
        *latency_verdicts(by_backend("latency-{b}")),
        *journal_latency,
    ]


def summary(rows: list[Verdict], machine_line: str, started: str, commit: str | None) -> str:
    def met(v: Verdict) -> str:
        return "not measured" if v.met is None else ("MET" if v.met else "NOT MET")

    lines = [
        f"Issue 17 pass, started {started}, code {commit or 'unknown'}, on {machine_line}",
        "",
        "| target | wanted | measured | |",
        "|---|---|---|---|",
        *(f"| {v.item} | {v.target} | {v.measured} | {met(v)} |" for v in rows),
        "",
        "6. --port and --db-prefix: every command that makes a database took the prefix, every one that starts a "
        "collector --port when given.",
    ]
    return "\n".join(lines) + "\n"


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None, *, runner: Callable[[Benchmark, list[str], Path], int] = run) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="directory of the logs and results (default: issue17-<UTC time>)")
    parser.add_argument("--db-prefix", default="tv_bench", help="prefix of every scratch database's name")
    parser.add_argument(
        "--port", type=int, help="the collector's port in every benchmark that starts one (default: one the OS picks)"
    )
    names = [b.name for b in BENCHMARKS]
    parser.add_argument("--only", help=f"comma-separated, of {','.join(names)} (default: all)")
    args = parser.parse_args(argv)
    chosen = names if args.only is None else args.only.split(",")
    if unknown := [n for n in chosen if n not in names]:
        parser.error(f"--only: no benchmark named {', '.join(unknown)}; choose from {','.join(names)}")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = args.out or Path(f"issue17-{started.replace(':', '')}")
    out.mkdir(parents=True, exist_ok=True)
    m = machine()
    print(f"{describe(m)}; code {m['commit']}; results in {out}/", flush=True)
    files: dict[str, dict[str, Any] | None] = {}
    failed = []
    for b in BENCHMARKS:
        if b.name not in chosen:
            continue
        json_path = out / f"{b.name}.json"
        json_path.unlink(missing_ok=True)
        code = runner(
            b, command(b, json_path=json_path, db_prefix=args.db_prefix, port=args.port), out / f"{b.name}.log"
        )
        files[b.name] = _load(json_path) if code == 0 else None
        if files[b.name] is None:
            failed.append(f"{b.name} (exit status {code}; its log: {out / (b.name + '.log')})")
    text = summary(verdicts(files), describe(m), started, m["commit"])
    (out / "summary.md").write_text(text)
    print("\n" + text, end="")
    if failed:
        print(f"did not finish: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
