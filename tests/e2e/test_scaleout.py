"""Two `trainvitals serve` replicas behind Debian's nginx on one PostgreSQL (docs/deployment.md).

The database's raw tables are first partitioned with the SQL docs/deployment.md gives. Batches go
in through nginx and land on both replicas; afterwards the run overview, the findings and
/metrics read the same whichever replica answers, one replica's analysis child did the analysis
for both, and the doc's retention function drops the partitions of reduced steps. The nginx
config, the replica and nginx processes and the comparison are the ones
benchmarks/scaleout_16k.py runs at 16,384 ranks (imported from there).
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from pathlib import Path

import psycopg
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import scaleout_16k as so  # noqa: E402 - benchmarks/ is a directory of scripts, not a package
from ingest_throughput import create_token, free_port  # noqa: E402

from trainvitals.service.store import run_keys  # noqa: E402
from trainvitals.wire.builders import batch_header, step_record  # noqa: E402

pytestmark = pytest.mark.slow

RUN, WORLD, STEPS, NAN_RANK, NAN_STEP = "scaleout-e2e", 8, 6, 3, 2
# Analysis every 0.3 s, each step reduced as soon as every rank sent it: the test waits seconds, not minutes.
PG_DSN = "postgresql://postgres@127.0.0.1:5432/"
FAST = {"TRAINVITALS_ANALYSIS_INTERVAL_SECONDS": "0.3", "TRAINVITALS_SETTLE_SECONDS": "0"}


def _post(base: str, path: str, body: object, token: str) -> tuple[int, str]:
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {token}"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as resp:  # a new connection per request
        return resp.status, resp.headers.get(so.UPSTREAM_HEADER, "")


def _batch(rank: int, seq: int, steps: range) -> dict[str, object]:
    records = [
        step_record(step=s, ts=time.time(), step_seconds=0.5, compute_seconds=0.4, wait_seconds=0.1,
                    loss=float("nan") if (rank, s) == (NAN_RANK, NAN_STEP) else 2.5, tokens=4096, dp_rank=rank)
        for s in steps
    ]  # fmt: skip
    return {**batch_header(run=RUN, rank=rank, incarnation=1, seq=seq), "records": records}


def test_replicas_behind_nginx_agree(empty_pg_url: str, tmp_path: Path) -> None:
    assert so.nginx_binary(), "nginx is missing: run tools/install-system-deps.sh"
    ingest = create_token(empty_pg_url, project="bench", scope="ingest")  # also migrates, once
    read = create_token(empty_pg_url, project="bench", scope="read")
    dsn = PG_DSN + empty_pg_url.rsplit("/", 1)[1]
    _partition_as_documented(dsn)
    ports = [free_port() for _ in range(3)]
    bases = [f"http://127.0.0.1:{p}" for p in ports[1:]]
    proxy = f"http://127.0.0.1:{ports[0]}"
    with (
        so.replica(empty_pg_url, ports[1], tmp_path / "a.log", env=FAST) as a,
        so.replica(empty_pg_url, ports[2], tmp_path / "b.log", env=FAST) as b,
        so.nginx(ports[0], ports[1:]),
    ):
        assert _post(proxy, "/v1/runs", {"run": RUN, "parallelism": {"world_size": WORLD}}, ingest)[0] == 201
        upstreams = set()
        for seq, steps in enumerate((range(0, 3), range(3, STEPS))):
            for rank in range(WORLD):
                status, upstream = _post(proxy, "/v1/batches", _batch(rank, seq, steps), ingest)
                assert status == 200
                upstreams.add(upstream)
        assert upstreams == {f"127.0.0.1:{p}" for p in ports[1:]}, "nginx should spread batches over both"
        # A batch retried through the proxy (the other replica may take it) is a duplicate, stored once.
        assert _post(proxy, "/v1/batches", _batch(0, 0, range(0, 3)), ingest)[0] == 200

        deadline = time.monotonic() + 40
        while True:  # until the analysis (one replica's child) has reduced every step and found the NaN
            view = so.views(bases[1], read, RUN)
            if view["overview"]["steps"] == STEPS and any(f["kind"] == "loss_nonfinite" for f in view["findings"]):
                break
            assert time.monotonic() < deadline, view
            time.sleep(0.5)

        assert so.agreement(bases, read, RUN) == dict.fromkeys(("overview", "findings", "metrics"), "agree")
        overview = view["overview"]
        assert (overview["ranks"], overview["step_records"], overview["last_step"]) == (WORLD, WORLD * STEPS, STEPS - 1)
        [nan] = [f for f in view["findings"] if f["kind"] == "loss_nonfinite"]
        assert nan["onset_step"] == NAN_STEP
        assert f'trainvitals_ingest_records_total{{run="{RUN}"}} {float(WORLD * STEPS)}' in view["metrics"]
        assert 'trainvitals_ingest_batches_total{outcome="duplicate"} 1.0' in view["metrics"]
        # The analysis lease: exactly one replica's analysis child holds the PostgreSQL advisory lock.
        assert _lease_holders(dsn) == 1, "one analysis child analyses for both replicas"
        assert a.poll() is None and b.poll() is None

        # Retention as documented: once every step is reduced (the overview counts steps as they
        # arrive, so wait for the reduction itself), with keep_steps 0 the partitions that take no
        # more rows go (ids 1-16 and 17-32 of the 48 step rows); the newest stays.
        with psycopg.connect(dsn, autocommit=True) as conn:
            deadline = time.monotonic() + 40
            key = run_keys.run_key("bench", RUN)  # the tokens' project's run (store/run_keys.py)
            while (conn.execute("SELECT reduced_upto FROM reduction_state WHERE run_id = %s", (key,)).fetchone()
                   or (-1,))[0] < STEPS - 1:
                assert time.monotonic() < deadline, "the last steps were never reduced"
                time.sleep(0.5)
            dropped = [r[0] for r in conn.execute("SELECT trainvitals_drop_reduced_partitions('steps', 0)")]
            assert dropped == ["steps_p0", "steps_p1"]
            assert conn.execute("SELECT count(*) FROM steps").fetchone() == (WORLD * STEPS - 32,)
        assert so.view(bases[0], read, RUN, "overview")["last_step"] == STEPS - 1


def test_retention_judges_each_run_by_its_own_state(empty_pg_url: str) -> None:
    """keep_steps > 0 with a stopped run (docs/deployment.md, Retention): its last steps, never
    reduced further, pin no partition once it is idle, and a partition a live run still needs is
    skipped, not the end of the pass."""
    from trainvitals.service.store import db

    db.upgrade(empty_pg_url)
    dsn = PG_DSN + empty_pg_url.rsplit("/", 1)[1]
    _partition_as_documented(dsn)
    now = time.time()
    # (run, last seen, reduced_upto, steps stored in id order): ids 1-16 the stopped run's steps
    # 0-15 (last seen 2 days ago), 17-26 run "slow" (not reduced at all), 27-96 run "live" steps 0-69.
    runs = [("stopped", now - 2 * 86400, 15, range(16)), ("slow", now, -1, range(10)), ("live", now, 69, range(70))]
    with psycopg.connect(dsn, autocommit=True) as conn:
        ident = 0
        for run, seen, reduced, steps in runs:
            conn.execute(
                "INSERT INTO runs (run_id, project, registration, world_size, status, created_at, last_seen_at)"
                " VALUES (%s, 'p', '{}', 1, 'running', %s, %s)", (run, seen, seen))
            conn.execute("INSERT INTO reduction_state (run_id, reduced_upto) VALUES (%s, %s)", (run, reduced))
            for step in steps:
                ident += 1
                conn.execute(
                    "INSERT INTO steps (id, run_id, rank, incarnation, step, ts, step_seconds)"
                    " VALUES (%s, %s, 0, 1, %s, %s, 1.0)", (ident, run, step, now))
        dropped = [r[0] for r in conn.execute("SELECT trainvitals_drop_reduced_partitions('steps', 5)")]
        # p0 (ids 1-16): the stopped run's steps 11-15 are within 5 of its reduced step, but it is
        # idle. p1 (17-32): "slow" is not reduced. p2-p4 (33-80): steps 6-53 of "live", reduced to
        # 69. p5 (81-96): its steps 54-69, some within 5 steps, and p5 may take more rows.
        assert dropped == ["steps_p0", "steps_p2", "steps_p3", "steps_p4"]
        assert conn.execute("SELECT min(id), max(id), count(*) FROM steps").fetchone() == (17, 96, 32)


def _partition_as_documented(dsn: str) -> None:
    """The first SQL block of docs/deployment.md, with 16-id partitions instead of its sizes, and
    partitions created ahead as its cron job does."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "deployment.md").read_text()
    sql = re.search(r"```sql\n(.*?)```", doc, re.S)
    assert sql, "docs/deployment.md has no SQL block"
    procedures = re.sub(r"^CALL trainvitals_partition_by_id.*$", "", sql.group(1), flags=re.M)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(procedures.encode())  # the doc's text, not a literal: bytes, as psycopg takes it
        for table in ("steps", "grad_stats", "tensor_stats"):
            conn.execute(f"CALL trainvitals_partition_by_id('{table}', 16)")
            conn.execute(f"CALL trainvitals_add_partitions('{table}', 16, 200)")
        parts = conn.execute("SELECT count(*) FROM pg_inherits WHERE inhparent = 'steps'::regclass").fetchone()
        assert parts == (15,)  # ids 1 .. 240 (200 // 16 + 2 chunks ahead): more than the test stores


def _lease_holders(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(DISTINCT l.pid) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
            "WHERE l.locktype = 'advisory' AND l.granted AND d.datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0
