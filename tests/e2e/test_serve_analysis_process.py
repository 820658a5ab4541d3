"""`trainvitals serve` analyses in a child process (`trainvitals analyse`): the child reduces what
the collector stores, and it dies with the collector even when the collector is SIGKILLed, so
no orphan keeps the analysis lease from the next collector on the same database."""

from __future__ import annotations

import json
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def _post(url: str, body: object) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10):
        pass


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _complete_step(port: int, run: str) -> float | None:
    for line in _get(f"http://127.0.0.1:{port}/metrics").splitlines():
        if line.startswith(f'trainvitals_run_complete_step{{run="{run}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_child_analyses_and_dies_with_the_collector(tmp_path: Path, unused_port: int, serve) -> None:
    db_url = f"sqlite:///{tmp_path / 'tv.db'}"
    log = tmp_path / "serve.log"
    base = f"http://127.0.0.1:{unused_port}"
    env = {"TRAINVITALS_ANALYSIS_INTERVAL_SECONDS": "0.3", "TRAINVITALS_SETTLE_SECONDS": "0"}
    proc = serve.start(db_url, unused_port, log, env=env)
    try:
        children = [c for c in _children(proc.pid) if b"analyse" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(children) == 1, (children, log.read_text())
        _post(base + "/v1/runs", {"run": "a", "parallelism": {"world_size": 1}})
        records = [{"kind": "step", "step": s, "ts": 1.0 + s, "step_seconds": 0.5} for s in range(10)]
        _post(base + "/v1/batches", {"run": "a", "rank": 0, "incarnation": 1, "seq": 0, "records": records})
        deadline = time.monotonic() + 30
        while _complete_step(unused_port, "a") != 9.0:  # reduced by the child, exported by the parent
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)

        proc.send_signal(signal.SIGKILL)  # no cleanup in the parent: the kernel tells the child
        proc.wait()
        deadline = time.monotonic() + 15
        while _alive(children[0]):
            assert time.monotonic() < deadline, "the analysis child outlived its collector"
            time.sleep(0.1)

        # The next collector on the same database gets the lease and analyses again.
        proc = serve.start(db_url, unused_port, log, env=env)
        step_10 = [{"kind": "step", "step": 10, "ts": 11.0, "step_seconds": 0.5}]
        _post(base + "/v1/batches", {"run": "a", "rank": 0, "incarnation": 1, "seq": 1, "records": step_10})
        deadline = time.monotonic() + 30
        while _complete_step(unused_port, "a") != 10.0:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            serve.stop(proc)


def test_an_analysis_child_stops_once_its_collector_is_gone(tmp_path: Path) -> None:
    """serve names itself to its child (TRAINVITALS_ANALYSE_PARENT_PID); a child whose parent is
    another process (serve died and it was re-parented, the death signal lost) stops by itself, at
    once, with exit code 0. Here its parent is this test, never the named pid."""
    import os
    import subprocess

    env = {**os.environ, "TRAINVITALS_ANALYSE_PARENT_PID": "1", "TRAINVITALS_ANALYSIS_INTERVAL_SECONDS": "0.3"}
    child = subprocess.Popen(
        [str(BIN / "trainvitals"), "analyse", "--db", f"sqlite:///{tmp_path / 'tv.db'}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, out
    # numpy's huge pages off unless the operator asks for them: a fresh process's first touch of
    # 2 GB of arrays stalled for up to 6 s with them on a VM (service/analysis/memory_pages.py).
    assert "numpy_huge_pages=off" in out, out


def test_the_operator_can_turn_numpy_huge_pages_back_on_for_the_analysis(tmp_path: Path) -> None:
    import os
    import subprocess

    env = {**os.environ, "TRAINVITALS_ANALYSE_PARENT_PID": "1", "NUMPY_MADVISE_HUGEPAGE": "1"}
    out = subprocess.run(
        [str(BIN / "trainvitals"), "analyse", "--db", f"sqlite:///{tmp_path / 'tv.db'}"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "numpy_huge_pages=on" in out.stdout + out.stderr
