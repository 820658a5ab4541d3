"""Delivery: bounded queue, spool on failure, exactly-once across a collector outage.

Uses the real collector (uvicorn in a thread, SQLite or PostgreSQL) and real sockets; the
exporter's thread body (run_once) is driven synchronously so the tests are deterministic.
"""

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from trainvitals.agent import AgentConfig
from trainvitals.agent._delivery import spooling_exporter
from trainvitals.agent._processor import BatchProcessor
from trainvitals.agent._transport import HttpTransport, Reply
from trainvitals.service.store import db
from trainvitals.service.store.models import CheckpointRow, StepRow
from trainvitals.wire import Batch, RunRegistration

REG = RunRegistration(run="r1", parallelism={"world_size": 1}).model_dump(mode="json")


def _exporter(url: str, tmp_path: Path, **cfg: object) -> BatchProcessor:
    settings: dict = {"http_timeout_s": 2.0, "retry_backoff_s": 0.0, **cfg}
    config = AgentConfig(collector=url, spill_dir=str(tmp_path / "spool"), **settings)
    return spooling_exporter(config=config, run="r1", rank=0, incarnation=1, registration=REG)


def _step(i: int) -> dict:
    return {"kind": "step", "step": i, "ts": 1.0, "step_seconds": 0.1}


def _stored_steps(db_url: str) -> list[int]:
    engine = db.make_engine(db_url)
    with engine.connect() as conn:
        steps = [r[0] for r in conn.execute(select(StepRow.step).order_by(StepRow.step))]
    engine.dispose()
    return steps


def test_delivers_in_batches_and_empties_the_spool(collector, tmp_path: Path) -> None:
    exp = _exporter(collector.url, tmp_path, max_batch_records=4, queue_max_records=100)
    for i in range(10):
        exp.emit(_step(i))
    exp.run_once(deadline=time.monotonic() + 10)
    assert _stored_steps(collector.db_url) == list(range(10))
    assert exp.stats.delivered_batches == 3  # 4 + 4 + 2
    assert not (tmp_path / "spool" / "r1.rank0.jsonl").exists()
    exp.shutdown()


def test_a_record_json_cannot_hold_costs_only_itself(collector, tmp_path: Path) -> None:
    """A value the encoder refuses (once: a tensor passed as tokens) aborted the pass: every record
    popped with it was lost, and not counted. Now only its own queue item is left out, and said."""
    exp = _exporter(collector.url, tmp_path, max_batch_records=100)
    for i in range(6):
        exp.emit({**_step(i), "tokens": object()} if i == 3 else _step(i))
    exp.run_once(deadline=time.monotonic() + 10)
    assert _stored_steps(collector.db_url) == [0, 1, 2, 4, 5]
    assert exp.stats.delivered_records == 5 and exp._errors.errors == 1
    exp.shutdown()


def test_a_file_name_that_is_not_utf8_costs_no_record(collector, tmp_path: Path) -> None:
    """os.fsdecode gives a non-UTF-8 file name lone surrogates, which json.dumps escapes as \\udcXX:
    the collector refused the whole batch, the rank's steps with the checkpoint record. The name
    now travels with its bytes as \\xNN text; an emoji (a surrogate pair in JSON) is kept."""
    exp = _exporter(collector.url, tmp_path, max_batch_records=100)
    exp.emit(_step(0))
    odd = os.fsdecode(b"/ck/\xffgen-1/\xf0\x9f\x9a\x80.pt")  # a Latin-1 byte, then a valid emoji
    exp.emit({"kind": "checkpoint", "step": 0, "generation": 1, "status": "persisted", "ts": 1.0, "path": odd})
    exp.emit(_step(1))
    exp.run_once(deadline=time.monotonic() + 10)
    assert _stored_steps(collector.db_url) == [0, 1]
    engine = db.make_engine(collector.db_url)
    with engine.connect() as conn:
        assert conn.execute(select(CheckpointRow.path)).scalars().all() == ["/ck/\\xffgen-1/\U0001f680.pt"]
    engine.dispose()
    exp.shutdown()


def test_outage_spills_then_replays_exactly_once_in_order(collector, tmp_path: Path) -> None:
    exp = _exporter(collector.url, tmp_path, max_batch_records=5)
    for i in range(5):
        exp.emit(_step(i))
    exp.run_once(deadline=time.monotonic() + 10)
    collector.stop()
    for i in range(5, 20):
        exp.emit(_step(i))
        if i % 5 == 4:
            exp.run_once(deadline=time.monotonic() + 10)  # fails: collector down
    spool = tmp_path / "spool" / "r1.rank0.jsonl"
    lines = spool.read_bytes().splitlines()
    assert [json.loads(x)["seq"] for x in lines if b'"records"' in x] == [1, 2, 3]
    assert exp.stats.failed_attempts >= 1
    collector.start()
    exp.run_once(deadline=time.monotonic() + 10)
    assert _stored_steps(collector.db_url) == list(range(20))  # every record, once, in order
    assert not spool.exists()
    exp.shutdown()


def test_spool_left_by_a_dead_process_is_delivered_by_the_next_one(collector, tmp_path: Path) -> None:
    collector.stop()
    first = _exporter(collector.url, tmp_path)
    for i in range(6):
        first.emit(_step(i))
    first.shutdown(timeout=1.0)  # collector down: everything stays spooled
    collector.start()
    second = spooling_exporter(
        config=AgentConfig(collector=collector.url, spill_dir=str(tmp_path / "spool")),
        run="r1",
        rank=0,
        incarnation=2,
        registration=REG,
    )
    second.emit(_step(6))
    second.run_once(deadline=time.monotonic() + 10)
    assert _stored_steps(collector.db_url) == list(range(7))
    second.shutdown()


def test_full_queue_drops_oldest_and_counts() -> None:
    exp = spooling_exporter(
        config=AgentConfig(collector="", queue_max_records=3, max_batch_records=3, spill_dir="/nonexistent"),
        run="r1",
        rank=0,
        incarnation=1,
        registration=REG,
    )
    for i in range(5):
        exp.emit(_step(i))
    assert exp.stats.dropped_records == 2
    assert [r["step"] for r in exp._queue] == [2, 3, 4]


def test_spool_file_is_a_replayable_wire_stream(tmp_path: Path) -> None:
    exp = _exporter("http://127.0.0.1:9", tmp_path)  # nothing listens on port 9
    for i in range(3):
        exp.emit(_step(i))
    exp.shutdown(timeout=0.5)
    lines = (tmp_path / "spool" / "r1.rank0.jsonl").read_bytes().splitlines()
    RunRegistration.model_validate_json(lines[0])
    assert [r.step for r in Batch.model_validate_json(lines[1]).records] == [0, 1, 2]


def test_hung_collector_costs_at_most_the_flush_timeout_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    # A real TCP server that accepts and never answers.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    stop = threading.Event()
    conns: list[socket.socket] = []

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(server.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        exp = _exporter(url, tmp_path, http_timeout_s=30.0, flush_timeout_s=3.0)
        exp.start()
        exp.emit(_step(0))
        t0 = time.monotonic()
        exp.shutdown()
        assert time.monotonic() - t0 < 5.0
        spool = tmp_path / "spool" / "r1.rank0.jsonl"
        assert spool.exists()  # kept for the next attempt
        said = [r.getMessage() for r in caplog.records if r.name == "trainvitals.agent"]
        assert said[0].startswith("trainvitals agent: waiting up to 2.")
        assert said[0].endswith(f"s (flush_timeout_s) for the collector at {url} to take 1 batch(es); "
                                f"what it does not take stays in {spool}")  # fmt: skip
        assert said[-1].startswith(f"trainvitals agent: 1 batch(es) were not delivered to the collector at {url}")
    finally:
        stop.set()
        t.join()
        for c in conns:
            c.close()
        server.close()


def test_rejected_batch_is_set_aside_not_retried_forever(collector, tmp_path: Path) -> None:
    exp = _exporter(collector.url, tmp_path)
    exp.emit({**_step(0), "step_seconds": -1.0})  # invalid: the collector answers 422
    exp.emit(_step(1))
    exp.run_once(deadline=time.monotonic() + 10)
    assert exp.stats.rejected_batches == 1
    assert (tmp_path / "spool" / "r1.rank0.quarantine.jsonl").exists()
    exp.emit(_step(2))
    exp.run_once(deadline=time.monotonic() + 10)
    assert _stored_steps(collector.db_url) == [2]
    exp.shutdown()


def test_spool_is_read_lazily_and_resumes_where_delivery_stopped(tmp_path: Path) -> None:
    """A failed attempt reads only up to the line that failed (a full 512 MiB spool is streamed,
    not loaded), and the next attempt starts at that line; torn last lines wait."""
    from trainvitals.agent._spool import Spool

    spool = Spool(tmp_path / "s.jsonl", max_bytes=1 << 20)
    for i in range(5):
        assert spool.append(b'{"n": %d}' % i)
    lines = spool.pending()
    offset, first = next(lines)  # an iterator: nothing past the first line has been read yet
    assert first == b'{"n": 0}'
    spool.mark_delivered(offset)
    offset, second = next(lines)
    assert second == b'{"n": 1}'
    lines.close()  # the attempt failed here: line 1 stays undelivered
    with open(spool.path, "ab") as fh:
        fh.write(b'{"n": 5')  # a crash mid-append leaves a torn line
    assert [line for _, line in spool.pending()] == [b'{"n": %d}' % i for i in range(1, 5)]


def test_a_healthy_collector_is_sent_batches_from_memory_not_from_disk(collector, tmp_path: Path) -> None:
    exp = _exporter(collector.url, tmp_path, max_batch_records=4)
    for i in range(10):
        exp.emit(_step(i))
    exp.run_once(deadline=time.monotonic() + 10)
    assert _stored_steps(collector.db_url) == list(range(10))
    assert exp.stats.delivered_records == 10
    assert not (tmp_path / "spool").exists()  # nothing was written to disk on the way
    exp.shutdown()


class _SpoolWatchingTransport(HttpTransport):
    """The real HTTP transport, noting whether the spool file existed at each request."""

    def __init__(self, url: str, spool: Path) -> None:
        super().__init__(url)
        self.spool = spool
        self.spooled_at_request: list[bool] = []

    def post(self, path: str, body: bytes, timeout: float) -> Reply:
        self.spooled_at_request.append(self.spool.exists())
        return super().post(path, body, timeout)


def test_the_last_pass_writes_every_batch_to_disk_before_sending(collector, tmp_path: Path) -> None:
    spool = tmp_path / "spool" / "r1.rank0.jsonl"
    transport = _SpoolWatchingTransport(collector.url, spool)
    exp = spooling_exporter(
        config=AgentConfig(collector=collector.url, spill_dir=str(tmp_path / "spool")),
        run="r1",
        rank=0,
        incarnation=1,
        registration=REG,
        transport=transport,
    )
    exp.emit(_step(0))
    exp.shutdown()  # no worker started: shutdown runs the last pass itself
    assert transport.spooled_at_request and all(transport.spooled_at_request)
    assert _stored_steps(collector.db_url) == [0]
    assert not spool.exists()  # delivered, so removed again


def test_a_spooled_lines_kind_comes_from_its_place_in_the_file(collector, tmp_path: Path) -> None:
    # A registration whose bytes contain '"records":' is still a registration: the spool's first
    # line. (Telling the kinds apart by looking for that text sent it to /v1/batches: a 422.)
    reg = RunRegistration(run="r1", tags={"records": "kept"}).model_dump(mode="json")
    collector.stop()
    first = spooling_exporter(
        config=AgentConfig(collector=collector.url, spill_dir=str(tmp_path / "spool")),
        run="r1",
        rank=0,
        incarnation=1,
        registration=reg,
    )
    for i in range(3):
        first.emit(_step(i))
    first.shutdown(timeout=1.0)  # collector down: registration + batch stay spooled
    collector.start()
    second = spooling_exporter(
        config=AgentConfig(collector=collector.url, spill_dir=str(tmp_path / "spool")),
        run="r1",
        rank=0,
        incarnation=2,
        registration=reg,
    )
    second.emit(_step(3))
    second.run_once(deadline=time.monotonic() + 10)
    assert _stored_steps(collector.db_url) == [0, 1, 2, 3]
    assert second.stats.rejected_batches == 0 and second.stats.delivered_batches == 2
    # The leftover batch was the first process's: only this process's record counts as its own.
    assert second.stats.delivered_records == 1
    second.shutdown()


def test_flush_is_held_to_its_timeout_by_a_pass_under_way(tmp_path: Path) -> None:
    """flush() waited for the worker's pass without a bound: against a hung collector (up to 6 x
    http_timeout_s a batch), or with the pass blocked where a sampled step's device work waits on a
    collective stuck on a dead peer, a flush() in the job's error handler never returned."""
    exp = _exporter("http://127.0.0.1:9", tmp_path)  # nothing listens: the pass is held below
    exp.emit(_step(0))
    held = threading.Event()
    release = threading.Event()

    def stuck_pass() -> None:
        with exp._lock:
            held.set()
            release.wait(30)

    threading.Thread(target=stuck_pass, daemon=True).start()
    assert held.wait(5)
    t0 = time.monotonic()
    assert exp.flush(timeout=0.3) is False
    assert time.monotonic() - t0 < 2.0
    release.set()
    assert exp.flush(timeout=5) is False  # nothing listens: spooled, undelivered, and said so in time
    exp.shutdown(timeout=1)


def test_a_forked_child_leaves_the_parents_spool_alone(collector, tmp_path: Path) -> None:
    """A bare os.fork() child that exits normally ran the parent's exporter at exit: it sent the
    parent's spooled lines and removed the spool file under the parent (which then skipped the
    start of the file it recreated)."""
    import os

    exp = _exporter(collector.url, tmp_path)
    collector.stop()
    exp.emit(_step(0))
    exp.run_once(deadline=time.monotonic() + 5)  # the collector is down: the batch is spooled
    spool = tmp_path / "spool" / "r1.rank0.jsonl"
    before = spool.read_bytes()
    collector.start()
    pid = os.fork()
    if pid == 0:  # the child: what its atexit would run
        try:
            exp.shutdown(timeout=5)
            exp.flush(timeout=1)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert spool.read_bytes() == before and _stored_steps(collector.db_url) == []
    exp.run_once(deadline=time.monotonic() + 10)  # the parent delivers its own, once
    assert _stored_steps(collector.db_url) == [0] and not spool.exists()
    exp.shutdown(timeout=1)
