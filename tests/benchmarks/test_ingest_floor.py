"""The ingest benchmark's raw-insert floor (benchmarks/ingest_throughput.py), measured before and
after the ingest run: the ratio is to their mean, and a floor that moved gets a line with the range."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ingest_throughput as bench  # noqa: E402 - benchmarks/ is a directory of scripts, not a package


def _floor(records_per_s: float, cpu_us: float) -> bench.FloorResult:
    return bench.FloorResult(
        backend="sqlite", records_per_s=records_per_s, method="sqlite3 executemany", client_us=cpu_us, server_us=0.0
    )


def test_the_ratio_is_to_the_mean_of_the_two_floors() -> None:
    floor = bench.BracketedFloor(before=_floor(200_000, 4.0), after=_floor(160_000, 6.0))
    assert floor.records_per_s == 180_000
    assert floor.cpu_us == 5.0
    assert abs(floor.drift - 0.25) < 1e-12


def test_a_floor_that_moved_says_between_which_ratios_ingest_lies() -> None:
    moved = bench.BracketedFloor(before=_floor(200_000, 4.0), after=_floor(160_000, 4.0))
    line = bench._floor_drift_line("sqlite", 100_000, moved)  # noqa: SLF001 - the line under test
    assert line is not None
    assert "moved 25%" in line and "between 0.50 and 0.62" in line


def test_a_steady_floor_gets_no_line() -> None:
    steady = bench.BracketedFloor(before=_floor(200_000, 4.0), after=_floor(190_000, 4.0))
    assert bench._floor_drift_line("sqlite", 100_000, steady) is None  # noqa: SLF001


def test_the_floor_inserts_real_rows_into_a_scratch_sqlite() -> None:
    """A short real floor: records go in and its rate and CPU are measured, not assumed."""
    floor = bench.measure_floor(
        "sqlite", seconds=0.3, steps_per_batch=1, layers_per_rank=1, group_batches=2, db_prefix="tv_test"
    )
    assert floor.records_per_s > 0 and floor.client_us > 0 and floor.server_us == 0.0
