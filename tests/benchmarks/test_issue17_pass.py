"""Issue 17's pass in one command (benchmarks/issue17_pass.py): the benchmarks' `--json` files, and
the table that puts each target beside what was measured."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_results  # noqa: E402 - benchmarks/ is a directory of scripts, not a package
import issue17_pass as pass17  # noqa: E402


def _ingest_json(tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    """One real ingest_throughput.py run (collector, SQLite, load generators), its --json file."""
    path = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(BENCHMARKS / "ingest_throughput.py"), "--backends", "sqlite", "--clients", "2",
           "--seconds", "3", "--warmup", "1", "--db-prefix", "tv_test", "--json", str(path), *args]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(path.read_text())


def test_a_real_closed_and_open_loop_give_item_3_its_numbers(tmp_path: Path) -> None:
    closed = _ingest_json(tmp_path, "closed", "--floor-seconds", "1")
    open_loop = _ingest_json(tmp_path, "open", "--floor-seconds", "0", "--rate", "2000", "--journal")
    assert closed["benchmark"] == "ingest_throughput" and "--json" in closed["command"]
    assert isinstance(closed["machine"]["cores_usable"], int) and closed["machine"]["cpu"]

    [c] = closed["results"]["backends"]
    assert c["loop"] == "closed" and c["records_per_s"] > 0 and c["errors"] == 0
    assert c["ratio_to_floor"] == pytest.approx(c["records_per_s"] / c["floor"]["records_per_s"])
    floor = c["floor"]
    assert floor["records_per_s"] == pytest.approx((floor["records_per_s_before"] + floor["records_per_s_after"]) / 2)
    [o] = open_loop["results"]["backends"]
    assert o["loop"] == "open" and o["offered_per_s"] == 2000 and "floor" not in o
    assert o["kept_up"], o  # 9 batches a second: far below what the collector takes
    assert c["journal_acks"] == 0 and o["journal_acks"] > 0  # with --journal, answered before their commits

    ratio, _, open_sqlite, _ = pass17.ingest_verdicts(closed["results"], {"sqlite": open_loop["results"]})
    assert ratio.met == (c["ratio_to_floor"] >= 0.7) and f"{c['ratio_to_floor']:.2f}" in ratio.measured
    assert open_sqlite.met == (o["p99_ms"] < 50) and open_sqlite.measured.startswith(
        f"{o['p99_ms']:.1f} ms, kept up (sends up to"
    )


def test_a_real_step_to_screen_run_with_the_journal_gives_item_5_its_numbers(tmp_path: Path) -> None:
    """latency.py --journal: real agents on a collector that answers from its ingest journal; every
    step still reaches the screen (shown only once committed), and the pass reads the file."""
    path = tmp_path / "latency.json"
    cmd = [sys.executable, str(BENCHMARKS / "latency.py"), "--backend", "sqlite", "--journal", "--ranks", "2",
           "--seconds", "6", "--warmup", "2", "--db-prefix", "tv_test", "--json", str(path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    r = json.loads(path.read_text())["results"]
    assert r["journal_acks"] > 0  # batches were answered before their commits
    complete = r["complete_step"]
    assert complete["steps"] == complete["steps_expected"] == 8  # steps 4..11 of 12, each one seen
    [row, _] = pass17.latency_verdicts({"sqlite": r}, ", ingest journal")
    assert row.item == "5. step to screen, sqlite, ingest journal"
    assert row.met == (complete["max_s"] <= r["bound_s"]) and f"max {complete['max_s']:.2f} s against" in row.measured


def _pass(**changes: Any) -> dict[str, dict[str, Any] | None]:
    """The results files of a pass that meets every target; `changes` replaces whole files."""

    def ingest(backend: str, **fields: Any) -> dict[str, Any]:
        timing = {"p99_ms": 30.0, "p99_lower_bound": False, "late_max_ms": 12.0, "answer_p99_ms": 25.0}
        return {"backend": backend, "records_per_s": 210_000.0, **timing, **fields}

    def closed(backend: str) -> dict[str, Any]:
        floor = {"records_per_s": 280_000.0}
        return ingest(backend, floor=floor, ratio_to_floor=0.75, cpu_ceiling_of_floor=0.9, busy=0.8)

    def latency(backend: str) -> dict[str, Any]:
        complete = {"median_s": 2.5, "max_s": 3.5, "steps": 100, "steps_expected": 100}
        return {"backend": backend, "bound_s": 4.1, "complete_step": complete, "run_overview": {"median_s": 0.3}}

    agent = {
        "amortised": {
            "amortised_pct": 0.25,
            "amortised_ms": 0.28,
            "baseline_step_ms": 112.5,
            "amortised_cpu_pct": 0.26,
        },
        "per_step_cost": [
            {"name": "trainvitals agent, default config", "diff_pct": 0.3, "direct_pct": 0.26},
            {"name": "hand-written JSON-line logger", "diff_pct": 0.2, "direct_pct": 0.11},
            {"name": "wandb.watch, gradients every step", "diff_pct": 46.9, "direct_pct": None},
        ],
    }
    cycle = {"reduce": 1.5, "inputs": 2.4, "detect": 1.4, "total": 5.4}
    files: dict[str, Any] = {
        "agent": agent,
        "closed": {"backends": [closed("sqlite"), closed("postgresql")]},
        "open-sqlite": {"backends": [ingest("sqlite", kept_up=True)]},
        "open-postgresql": {"backends": [ingest("postgresql", kept_up=True)]},
        "latency-sqlite": latency("sqlite"),
        "latency-postgresql": latency("postgresql"),
        "16k": {"cycles": {"restart: first cycle": [cycle]}, "peak_mb": 2070.0},
    }
    files.update(changes)
    return {name: None if results is None else {"results": results} for name, results in files.items()}


def test_a_pass_that_meets_every_target_says_so_for_each() -> None:
    rows = pass17.verdicts(_pass())
    assert [v.met for v in rows] == [True] * 9
    assert rows[0].measured.startswith("+0.25% (0.280 ms of a 112.5 ms step)")
    assert "wandb.watch, gradients every step +46.90%" in rows[1].measured  # its step difference: no calls of its own
    assert "hand-written JSON-line logger +0.11%" in rows[1].measured  # the time inside its own calls


def test_each_miss_is_named_where_it_happens() -> None:
    files = _pass()
    closed = files["closed"]["results"]  # type: ignore[index]
    closed["backends"][1] |= {"ratio_to_floor": 0.43}
    files["open-postgresql"]["results"]["backends"][0] |= {"kept_up": False, "records_per_s": 89_307.0}  # type: ignore[index]
    files["open-sqlite"]["results"]["backends"][0] |= {"p99_ms": 301.1}  # type: ignore[index]
    files["latency-sqlite"]["results"]["complete_step"] |= {"steps": 99}  # type: ignore[index]
    by_item = {v.item: v for v in pass17.verdicts(files)}
    assert by_item["3. ingest / raw-insert floor, postgresql, closed loop of 16"].met is False
    assert by_item["3. ingest / raw-insert floor, sqlite, closed loop of 16"].met is True
    closed["backends"][0] |= {"ratio_to_floor": 0.6959}
    sqlite = {v.item: v for v in pass17.verdicts(files)}["3. ingest / raw-insert floor, sqlite, closed loop of 16"]
    assert sqlite.met is False and sqlite.measured.startswith("0.696 (")  # not "0.70", which reads as met
    not_kept = by_item["3. p99 at 100,000 records/s, postgresql"]
    assert not_kept.met is False and not_kept.measured.startswith("did not keep up (89,307 records/s")
    assert by_item["3. p99 at 100,000 records/s, sqlite"].met is False
    assert by_item["5. step to screen, sqlite"].met is False  # a step never shown is not within the bound


def test_a_benchmark_that_did_not_run_is_not_measured_not_missed() -> None:
    rows = pass17.verdicts(_pass(agent=None, closed=None, **{"16k": None}))
    unmeasured = [v.item for v in rows if v.met is None]
    assert unmeasured == [
        "1. agent overhead, amortised",
        "2. peers in the same run",
        "3. ingest / raw-insert floor, sqlite, closed loop of 16",
        "3. ingest / raw-insert floor, postgresql, closed loop of 16",
        "4. first analysis cycle after a restart, 16,384 ranks",
    ]
    assert all(v.measured == "not measured" for v in rows if v.met is None)


def test_the_pass_runs_each_benchmark_with_its_own_names_and_writes_the_table(tmp_path: Path) -> None:
    """The orchestration alone: a runner in place of the benchmarks (each takes minutes; the real
    --json files are the test above's), which writes a pass's files where the commands say."""
    files = _pass()
    commands: dict[str, list[str]] = {}

    def runner(b: pass17.Benchmark, cmd: list[str], log: Path) -> int:
        commands[b.name] = cmd
        log.write_text("report\n")
        if b.name == "16k":
            return 1  # failed: its file is not read even where one exists
        # The journal's runs write what their plain counterparts do.
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(files[b.name.removesuffix("-journal")]))
        return 0

    out = tmp_path / "pass"
    status = pass17.main(["--out", str(out), "--db-prefix", "tv_x", "--port", "18123"], runner=runner)
    assert status == 1  # one benchmark did not finish
    assert list(commands) == [b.name for b in pass17.BENCHMARKS]
    assert commands["closed"][-4:] == ["--db-prefix", "tv_x_closed", "--port", "18123"]
    assert commands["open-postgresql"][-4:-2] == ["--db-prefix", "tv_x_open_postgresql"]
    assert "--port" not in commands["16k"] and "--db-prefix" not in commands["agent"]
    assert "--journal" in commands["closed-journal"] and "--journal" not in commands["closed"]
    assert commands["open-sqlite-journal"][-4:-2] == ["--db-prefix", "tv_x_open_sqlite_journal"]
    assert "--journal" in commands["latency-postgresql-journal"] and "--journal" not in commands["latency-postgresql"]
    summary = (out / "summary.md").read_text()
    assert "| 4. first analysis cycle after a restart, 16,384 ranks | < 10 s | not measured | not measured |" in summary
    assert "| 3. p99 at 100,000 records/s, postgresql, ingest journal | < 50 ms | 30.0 ms, kept up" in summary
    assert "| 5. step to screen, postgresql, ingest journal | a reduced complete step within" in summary
    # Item 3's four rows and item 5's two, twice: acknowledged at commit, and from the journal.
    assert summary.count("| MET |") == 14


def test_only_runs_the_benchmarks_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[str] = []

    def runner(b: pass17.Benchmark, cmd: list[str], log: Path) -> int:
        ran.append(b.name)
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(_pass()[b.name]))
        return 0

    assert pass17.main(["--out", str(tmp_path), "--only", "16k,agent"], runner=runner) == 0
    assert ran == ["agent", "16k"]
    with pytest.raises(SystemExit) as exc:
        pass17.main(["--out", str(tmp_path), "--only", "closed,ingest"], runner=runner)
    assert exc.value.code == 2
    assert "--only: no benchmark named ingest; choose from agent,closed," in capsys.readouterr().err


def test_results_files_name_the_cpu_by_family_and_model_and_hold_no_nan(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    bench_results.write_results(
        str(path), benchmark="x", command=["x"], results={"a": math.nan, "b": [math.inf, 1.5], "c": {"d": -math.inf}}
    )
    payload = json.loads(path.read_text())  # strict JSON: no NaN or Infinity tokens
    assert payload["results"] == {"a": None, "b": [None, 1.5], "c": {"d": None}}
    m = payload["machine"]
    assert isinstance(m["family"], int) and isinstance(m["model"], int)  # a Linux x86 machine's /proc/cpuinfo
    assert f"family {m['family']} model {m['model']}" in bench_results.describe(m)
