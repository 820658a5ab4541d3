"""benchmarks/sqlite_bind_cost.py and ingest_record_forms.py: short real runs of the store's
writer path print every form they compare (each exits non-zero if a form stores other rows)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_bind_cost_runs_the_three_forms_and_the_writers_preparation_over_the_same_rows() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "sqlite_bind_cost.py"), "--rows", "64", "--rounds", "3"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    rows = re.findall(r"^(\S.*?)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == [
        "NULLs as literals, the rest bound",
        "and shadow as a literal",
        "and the run key bound once (?1)",
    ], out
    assert all(float(r[1]) > 0 for r in rows) and float(rows[0][3]) == 1.0, out
    # The writer's own preparation gave the third form (the script exits non-zero when it does not).
    assert re.search(r"^before binding, the writer's chunk preparation .*: [\d.]+ us a row median", out, re.M), out


def test_the_record_forms_run_through_the_writer_and_the_json_extraction() -> None:
    """The json_each form must store what the writer stores: it checks, and fails, when a column of
    the tables is not extracted (as `skipped` was not, unnoticed, until session 61)."""
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "ingest_record_forms.py"), "--repeats", "1", "--db-prefix", "tv_test"],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout  # fmt: skip
    assert re.search(r"^today: decode \+ rows \+ multi-row INSERT\s+[\d.]+", out, re.M), out
    assert re.search(r"^json_each: decode \+ INSERT \.\.\. SELECT\s+[\d.]+", out, re.M), out
