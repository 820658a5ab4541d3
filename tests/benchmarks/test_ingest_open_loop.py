"""The ingest benchmark's open-loop accounting (benchmarks/ingest_throughput.py): latency from the
scheduled send time, and the --timeline file that lines a stall up with other events."""

from __future__ import annotations

import csv
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ingest_throughput as bench  # noqa: E402 - benchmarks/ is a directory of scripts, not a package


def _stalled_schedule() -> tuple[tuple[float, float], list[tuple[int, float, float, bool]]]:
    """10 batches/s from t=100 (monotonic); slots 0-9 sent on time and answered in 5 ms, except
    slot 4, whose send started 300 ms late (a stall) and whose answer took 20 ms."""
    schedule = (100.0, 10.0)
    timed = []
    for slot in range(10):
        due = 100.0 + slot / 10.0
        sent = due + (0.3 if slot == 4 else 0.0)
        timed.append((slot, sent, sent + (0.02 if slot == 4 else 0.005), True))
    return schedule, timed


def test_latency_runs_from_the_scheduled_send_so_a_stall_counts() -> None:
    schedule, timed = _stalled_schedule()
    stats = bench._open_loop_stats(timed, schedule, t_start=100.0, t_end=101.0, t_stop=101.5, clients=1)
    assert stats["scheduled"] == 10 and stats["unsent"] == 0
    assert stats["late_max_ms"] == pytest.approx(300.0)
    assert stats["p99"] == pytest.approx(0.32)  # the stalled batch: 300 ms late + its 20 ms answer
    assert stats["p50"] == pytest.approx(0.005)


def test_timeline_has_one_row_per_batch_on_the_wall_clock(tmp_path: Path) -> None:
    schedule, timed = _stalled_schedule()
    path = tmp_path / "tl-sqlite.csv"
    before = time.time() - time.monotonic()
    bench._write_timeline(str(path), list(reversed(timed)), schedule)
    after = time.time() - time.monotonic()
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert [float(r["late_ms"]) for r in rows] == [0.0] * 4 + [300.0] + [0.0] * 5  # in due order
    assert [float(r["answer_ms"]) for r in rows] == [5.0] * 4 + [20.0] + [5.0] * 5
    assert {r["ok"] for r in rows} == {"1"}
    # due times: monotonic 100.0, 100.1, ... moved to the wall clock by its offset at writing
    dues = [float(r["due_unix"]) for r in rows]
    assert before + 100.0 - 0.01 <= dues[0] <= after + 100.0 + 0.01
    assert [round(b - a, 3) for a, b in zip(dues, dues[1:], strict=False)] == [0.1] * 9


def test_timeline_needs_the_open_loop(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["ingest_throughput.py", "--timeline", "/tmp/x"])
    with pytest.raises(SystemExit) as exc:
        bench.main()
    assert exc.value.code == 2
    assert "--timeline needs --rate" in capsys.readouterr().err
