"""benchmarks/sqlite_group_gil.py: a short real run prints each group size's statements and times."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sqlite_group_gil.py"


def test_a_short_run_times_each_size_alone_and_contended_and_lists_its_statements() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes", "1,11", "--groups", "2", "--prefill", "32", "--db-prefix", "tv_test"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(-?[\d.]+)$", out, re.M)
    assert [int(r[0]) for r in rows] == [1, 11], out
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows), out
    statements = re.findall(r"^    statements: (.*)$", out, re.M)
    assert len(statements) == 2, out
    for listed in statements:  # one claim, one commit; each kind's rows in at most two INSERTs
        names = listed.split(", ")
        assert names.count("INSERT INTO batches") == 1 and names.count("COMMIT") == 1, listed
        assert 1 <= names.count("INSERT INTO tensor_stats") <= 2, listed
