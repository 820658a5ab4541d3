"""`trainvitals demo` as `make demo` runs it: the injected straggler is found on the injected rank
and on no other, also with a busy loop taking a core; a port already served is refused."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def _demo(tmp: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "trainvitals"), "demo", "--ranks", "4", "--workdir", str(tmp / "demo-out"), *args],
        cwd=tmp, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_demo_refuses_a_port_it_did_not_start(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _demo(tmp_path, "--port", str(port), timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"port {port} is in use" in out.stderr
    assert "training" not in out.stdout  # nothing was started against it
    assert not (tmp_path / "demo-out" / "trainvitals.db").exists()


@pytest.mark.slow
def test_demo_finds_the_injected_straggler_only_under_load(tmp_path: Path) -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        out = _demo(tmp_path, "--port", "0")
    finally:
        busy.kill()
        busy.wait()
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "injected   rank 3 slowed 0.1 s a step from step 20: found, and on no other rank" in out.stdout, text
    findings = re.findall(r"^  \[(page|ticket|info)\] (.*)$", out.stdout, re.M)
    on_ranks = [summary for _, summary in findings if summary.startswith("rank ")]
    assert on_ranks and all(s.startswith("rank 3 ") for s in on_ranks), text
    assert "detection  detecting since step 20" in out.stdout
    assert "[demo] training   step " in out.stdout  # progress while it trains
    # The closing commands work when pasted (the virtualenv's trainvitals, the read token), here in
    # one shell from the directory the demo ran in.
    lines = out.stdout.splitlines()
    block = [line.strip() for line in lines[lines.index("Look at it again (the database stays; paste these):") + 1 :]]
    assert block[0].startswith(str(BIN / "trainvitals")) or block[0].startswith(".venv/bin/trainvitals")
    script = "set -e\n" + "\n".join(block[: block.index("kill %1")]) + "\nkill %1\nwait\n"
    res = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert '"straggler"' in res.stdout, res.stdout + res.stderr
    assert 'trainvitals_finding_active{kind="straggler"' in res.stdout, res.stdout + res.stderr
