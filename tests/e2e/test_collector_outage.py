"""Collector outage mid-run: a real multi-rank torchrun job of the example keeps training while
its collector process is SIGKILLed and later restarted on the same port and database; afterwards
every step record of every rank is stored exactly once and the agents' spools are empty.

SIGKILL (not a clean shutdown) also proves that what the collector acknowledged before dying
was durable: the agents drop a batch from their spool once it is acknowledged and never send it
again, so a batch the collector acknowledged but lost would show as a gap.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from sqlalchemy import select

from trainvitals.service.store import db, queries
from trainvitals.service.store.models import StepRow

BIN = Path(sys.executable).parent
RANKS = 2  # two CPU cores here; the spool and replay are per rank, so two already cover "every rank"
# Long enough that the job is still running when the collector is back: the restart alone
# (interpreter, imports, migrations check) takes 2 s on an idle machine and over 10 s on a busy one.
TRAIN_SECONDS = 25.0
OUTAGE_SECONDS = 3.0
SEND_INTERVAL = 0.3
FLUSH_TIMEOUT = 10.0  # AgentConfig.flush_timeout_s default: what close() may add to the job's exit
RUN = "outage"


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _start_collector(db_url: str, port: int, log: Path, journal: Path | None) -> subprocess.Popen[bytes]:
    """`trainvitals serve` as its own process (so it can be SIGKILLed), ready when /healthz answers."""
    extra = [] if journal is None else ["--ingest-journal", str(journal)]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [str(BIN / "trainvitals"), "serve", "--db", db_url, "--port", str(port), "--insecure-no-auth", *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while not _healthy(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(log.read_text())
        time.sleep(0.1)
    return proc


def _stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _stored_steps(db_url: str) -> int:
    engine = db.make_engine(db_url)
    try:
        with db.make_sessionmaker(engine)() as session:
            return queries.count_step_rows(session, run_id=RUN)
    except Exception:  # noqa: BLE001 - before the first registration the tables may not exist yet
        return 0
    finally:
        engine.dispose()


def _wait_for(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _spool_bytes(spool: Path) -> int:
    return sum(p.stat().st_size for p in spool.glob("*.jsonl")) if spool.exists() else 0


def _journal_acks(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return float(re.search(r"^trainvitals_ingest_journal_acks_total (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.parametrize("journaled", [False, True], ids=["acknowledged-at-commit", "acknowledged-from-journal"])
def test_job_survives_a_collector_kill_and_every_step_arrives_exactly_once(
    tmp_path: Path, unused_port: int, journaled: bool
) -> None:
    """With the ingest journal (service/ingest/journal.py) the collector acknowledged batches before
    their commit when it was killed; the restarted one stores them from its journal."""
    db_url = f"sqlite:///{tmp_path / 'collector.db'}"
    log = tmp_path / "collector.log"
    spool = tmp_path / "spool"
    journal = tmp_path / "journal" if journaled else None
    collector = _start_collector(db_url, unused_port, log, journal)
    job: subprocess.Popen[str] | None = None
    try:
        job = subprocess.Popen(
            [
                str(BIN / "torchrun"),
                "--standalone",
                f"--nproc_per_node={RANKS}",
                "-m",
                "trainvitals.examples.train_gpt",
                "--run-name",
                RUN,
                "--steps",
                "1000000",  # the job stops on --max-seconds, at a step all ranks agree on
                "--max-seconds",
                str(TRAIN_SECONDS),
                "--send-interval",
                str(SEND_INTERVAL),
                "--collector",
                f"http://127.0.0.1:{unused_port}",
            ],
            env={**os.environ, "TRAINVITALS_SPILL_DIR": str(spool)},
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # Let the job deliver for a while, then kill the collector without any chance to flush.
        _wait_for(lambda: _stored_steps(db_url) > 0 or job.poll() is not None, 120, "the first steps")
        time.sleep(1.0)
        assert job.poll() is None, "the job ended before the outage could start"
        if journal is not None:
            assert _journal_acks(unused_port) > 0, "no batch was acknowledged from the journal"
        collector.kill()
        collector.wait()
        stored_before_kill = _stored_steps(db_url)
        assert stored_before_kill > 0

        # While the collector is down the job keeps training and its batches spill to disk.
        killed_at = time.monotonic()
        time.sleep(OUTAGE_SECONDS)
        assert job.poll() is None, "the job ended during the outage: make TRAIN_SECONDS longer"
        assert _spool_bytes(spool) > 0, "nothing spilled while the collector was down"
        collector = _start_collector(db_url, unused_port, log, journal)
        outage = time.monotonic() - killed_at
        assert job.poll() is None, f"the job ended before the collector came back ({outage:.1f} s outage)"
        # The spool replays into the new collector while the job is still running.
        _wait_for(
            lambda: _stored_steps(db_url) > stored_before_kill,
            15,
            f"the spool to replay after a {outage:.1f} s outage",
        )
        assert job.poll() is None, f"the job ended before replaying ({outage:.1f} s outage)"

        stdout, stderr = job.communicate(timeout=300)
        job_exited_at = time.time()
        assert job.returncode == 0, stdout[-3000:] + stderr[-3000:]
        match = re.search(r"trained (\d+) steps on (\d+) ranks", stdout)
        assert match and int(match.group(2)) == RANKS, stdout[-3000:] + stderr[-3000:]
        steps = int(match.group(1))
        # close() delivered before exit: the restarted collector has it all once the job is gone.
        _wait_for(
            lambda: _stored_steps(db_url) >= RANKS * steps,
            30,
            f"every step to be stored (job stderr: {stderr[-3000:]}; collector log: {log.read_text()[-3000:]})",
        )
    finally:
        if job is not None and job.poll() is None:
            job.kill()
            job.communicate()
        _stop(collector)

    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        keys = queries.step_keys(session, run_id=RUN)
        rows = queries.count_step_rows(session, run_id=RUN)
        step_ends = session.execute(
            select(StepRow.rank, StepRow.step, StepRow.ts).where(StepRow.run_id == RUN)
        ).all()
    engine.dispose()
    # Exactly once: every (rank, step) present, no row stored twice, one incarnation per rank.
    assert {(rank, step) for rank, _inc, step in keys} == {(r, s) for r in range(RANKS) for s in range(steps)}
    assert rows == len(keys) == RANKS * steps
    assert len({(rank, inc) for rank, inc, _step in keys}) == RANKS
    # Delivered means gone: no spool left behind, nothing set aside as rejected.
    assert spool.exists() and sorted(p.name for p in spool.iterdir()) == []
    # Training never waited for the collector: no rank stalled between two steps, outage or not
    # (a step takes milliseconds here; a blocking send would stall for the HTTP timeout, 5 s).
    for rank in range(RANKS):
        ends = sorted(ts for r, _step, ts in step_ends if r == rank)
        assert max(b - a for a, b in zip(ends, ends[1:], strict=False)) < 2.0
    # And exit waited at most the flush timeout after the last step (plus process teardown).
    last_step_end = max(ts for _r, _s, ts in step_ends)
    assert job_exited_at - last_step_end < FLUSH_TIMEOUT + 5.0, job_exited_at - last_step_end
