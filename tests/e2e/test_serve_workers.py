"""`trainvitals serve --workers 2` on PostgreSQL: two processes share the port and the database.

Every batch is stored once whichever process took it (duplicates included), /metrics gives the
same totals whichever process answers the scrape (the counters live in the database), and only
one process holds the analysis lease.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def _post(base: str, path: str, body: object) -> tuple[int, dict]:
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:  # a new connection per request
        return resp.status, json.loads(resp.read())


@contextlib.contextmanager
def _explained(pg: psycopg.Connection, serve_log: Path) -> Iterator[None]:
    """A request that gets no answer fails with what the database's sessions were doing and the
    collector's log: a duplicate POST once hung for 30 s in CI (session 55) and left nothing to read."""
    try:
        yield
    except OSError as exc:  # urllib's timeout or a refused connection
        sessions = pg.execute(
            "SELECT pid, application_name, state, wait_event_type, wait_event,"
            " round(extract(epoch FROM now() - xact_start)::numeric, 2), left(query, 160)"
            " FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
        waits = pg.execute(
            "SELECT pid, pg_blocking_pids(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND cardinality(pg_blocking_pids(pid)) > 0"
        ).fetchall()
        lines = "\n".join(map(repr, sessions))
        raise AssertionError(
            f"{exc!r}\nsessions:\n{lines}\nblocked (pid, by): {waits}\n"
            f"serve.log (tail):\n{serve_log.read_text(errors='replace')[-6000:]}"
        ) from exc


def _metric(text: str, name: str, labels: str) -> float:
    match = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.M)
    assert match, (name, labels)
    return float(match.group(1))


def test_two_processes_one_truth(empty_pg_url: str, unused_port: int, tmp_path: Path) -> None:
    base = f"http://127.0.0.1:{unused_port}"
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed in finally
    env = {**os.environ, "TRAINVITALS_ANALYSIS_INTERVAL_SECONDS": "0.3", "TRAINVITALS_SETTLE_SECONDS": "0"}
    proc = subprocess.Popen(
        [str(BIN / "trainvitals"), "serve", "--db", empty_pg_url, "--port", str(unused_port),
         "--workers", "2", "--insecure-no-auth"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/healthz", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
                time.sleep(0.2)
        assert _post(base, "/v1/runs", {"run": "w2", "parallelism": {"world_size": 8}})[0] == 201

        def batch(i: int) -> dict:
            rank, seq = i % 8, i // 8
            records = [{"kind": "step", "step": seq, "ts": 1.0, "step_seconds": 0.1 * (rank + 1)}]
            return {"run": "w2", "rank": rank, "incarnation": 1, "seq": seq, "records": records}

        # Send until both processes have stored batches (the kernel spreads new connections over
        # the two accepting processes), every batch twice.
        sent = 0
        writers: set[str] = set()
        with psycopg.connect(empty_pg_url.replace("+psycopg", ""), autocommit=True) as pg:
            while len({w.split(":")[1] for w in writers}) < 2 and sent < 800:
                with ThreadPoolExecutor(8) as pool, _explained(pg, tmp_path / "serve.log"):
                    acks = list(pool.map(lambda i: _post(base, "/v1/batches", batch(i))[1], range(sent, sent + 40)))
                    dups = list(pool.map(lambda i: _post(base, "/v1/batches", batch(i))[1], range(sent, sent + 40)))
                assert all(a == {"accepted": 1, "duplicate": False} for a in acks)
                assert all(d == {"accepted": 0, "duplicate": True} for d in dups)
                sent += 40
                writers = {r[0] for r in pg.execute("SELECT DISTINCT writer FROM ingest_counts")}
            assert len({w.split(":")[1] for w in writers}) == 2, writers  # two processes' writer threads
            assert pg.execute("SELECT count(*) FROM steps").fetchone()[0] == sent

            # Whichever process answers, the same totals.
            for _ in range(6):
                with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
                    text = resp.read().decode()
                assert _metric(text, "trainvitals_ingest_batches_total", 'outcome="stored"') == sent
                assert _metric(text, "trainvitals_ingest_batches_total", 'outcome="duplicate"') == sent
                assert _metric(text, "trainvitals_ingest_records_total", 'run="w2"') == sent

            # One analyser: one advisory lock holder, and the run gets reduced.
            deadline = time.monotonic() + 30
            while pg.execute("SELECT count(*) FROM step_summaries").fetchone()[0] < sent // 8:
                assert time.monotonic() < deadline, "the run was never reduced"
                time.sleep(0.3)
            holders = pg.execute(
                "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
                " WHERE l.locktype = 'advisory' AND l.granted"
                " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            ).fetchall()
            assert holders == [("trainvitals-analyse",)]  # serve's analysis child, by its connection's name
            # Each connection says whose it is (store/db.py): the two processes' and the child's.
            names = {r[0] for r in pg.execute(
                "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid()"
            )}  # fmt: skip
            assert {"trainvitals-serve", "trainvitals-analyse"} <= names, names
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
