"""The ingest benchmark's split of the collector's CPU by part (benchmarks/ingest_throughput.py):
the event loop (serve's main thread), the batch writers (named for the OS by the collector), other
threads and the analysis child (its argv says `analyse`), read from /proc per thread."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from trainvitals.service.thread_names import name_this_thread

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ingest_throughput as bench  # noqa: E402 - benchmarks/ is a directory of scripts, not a package


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_each_part_counts_the_cpu_of_its_threads() -> None:
    """A thread named like the batch writer, this process's main thread and a process whose argv
    says `analyse`, each burning CPU, land in their own parts."""
    burnt, done = threading.Event(), threading.Event()

    def writer() -> None:
        name_this_thread()
        _burn(0.4)
        burnt.set()
        done.wait(30)  # alive when read: an ended thread's CPU is no longer listed per thread

    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nwhile time.process_time() < 0.4: pass\ntime.sleep(30)", "analyse"]
    )
    thread = threading.Thread(target=writer, name="trainvitals-batch-writer-9")
    try:
        pids = [os.getpid(), child.pid]
        before = bench.thread_cpu_seconds(pids)
        _burn(0.3)
        thread.start()
        assert burnt.wait(30)
        deadline = time.monotonic() + 30
        while _child_cpu(bench.thread_cpu_seconds([child.pid])) < 0.35 and time.monotonic() < deadline:
            time.sleep(0.05)
        grew = bench.cpu_seconds_by_part(before, bench.thread_cpu_seconds(pids))
    finally:
        done.set()
        thread.join()
        child.kill()
        child.wait()
    assert list(grew) == list(bench.COLLECTOR_PARTS)
    assert grew["batch writer"] >= 0.3
    assert grew["event loop"] >= 0.2
    assert grew["analysis child"] >= 0.2


def _child_cpu(threads: dict[tuple[int, int], tuple[str, float]]) -> float:
    return sum(seconds for part, seconds in threads.values() if part == "analysis child")


def test_a_thread_that_ended_between_the_readings_takes_nothing_away() -> None:
    """Its CPU before the first reading left with it: no part goes negative (a thread pool's worker
    that exits mid-window once made "other threads" read -0.0)."""

    def idle() -> None:
        _burn(0.2)
        time.sleep(0.2)

    pid = os.getpid()
    thread = threading.Thread(target=idle)
    thread.start()
    time.sleep(0.1)
    before = bench.thread_cpu_seconds([pid])
    assert (pid, thread.native_id) in before
    thread.join()
    grew = bench.cpu_seconds_by_part(before, bench.thread_cpu_seconds([pid]))
    assert all(seconds >= 0 for seconds in grew.values())


def test_the_line_gives_each_part_per_record_and_in_cores() -> None:
    parts = {"event loop": 0.45, "batch writer": 0.9, "other threads": 0.05, "analysis child": 0.3}
    result = bench.IngestResult(
        backend="sqlite", records_per_s=150_000.0, batches_per_s=694.4, records_per_batch=216, body_kb=36.8,
        p50_ms=20.0, p99_ms=60.0, errors=0, collector_cpu=1.7, collector_processes=2, collector_parts=parts,
        postgres_cpu=0.0, server_parts=dict.fromkeys(bench.SERVER_PARTS, 0.0), clients_cpu=0.1, rss_mb=500.0,
        hwm_mb=510.0, stored_rows=0, reduced="3/7", command="",
    )  # fmt: skip
    assert bench._collector_parts_line(result) == (  # noqa: SLF001 - the benchmark's own line
        "[sqlite] collector CPU us/rec by part: event loop 3.0, batch writer 6.0, other threads 0.3, "
        "analysis child 2.0 (cores busy: 0.45, 0.90, 0.05, 0.30)"
    )


def test_the_postgresql_line_also_splits_the_server_by_client() -> None:
    """On PostgreSQL a second line: the server's CPU by the collector's process each backend serves."""
    parts = {"event loop": 0.45, "batch writer": 0.3, "other threads": 0.0, "analysis child": 0.03}
    result = bench.IngestResult(
        backend="postgresql", records_per_s=100_000.0, batches_per_s=463.0, records_per_batch=216, body_kb=36.8,
        p50_ms=20.0, p99_ms=60.0, errors=0, collector_cpu=0.78, collector_processes=2, collector_parts=parts,
        postgres_cpu=0.8, server_parts={"serve": 0.6, "analysis child": 0.2, "other": 0.0}, clients_cpu=0.1,
        rss_mb=500.0, hwm_mb=510.0, stored_rows=0, reduced="3/7", command="",
    )  # fmt: skip
    assert bench._collector_parts_line(result).splitlines()[1] == (  # noqa: SLF001 - the benchmark's own line
        "[postgresql] PostgreSQL CPU us/rec by client: serve 6.0, analysis child 2.0, other 0.0 "
        "(cores busy: 0.60, 0.20, 0.00)"
    )


def test_a_backends_cpu_lands_with_the_process_that_named_its_connection(empty_pg_url: str) -> None:
    """A query the analysis worker's connection runs is the server's 'analysis child' CPU; a
    connection the collector did not name is 'other'; serve's, idle here, gets none."""
    import psycopg

    from trainvitals.service.store import db

    dsn = empty_pg_url.replace("postgresql+psycopg://", "postgresql://")
    with (
        psycopg.connect(dsn, application_name=db.ANALYSE_APPLICATION_NAME) as analysis,
        psycopg.connect(dsn, application_name=db.SERVE_APPLICATION_NAME),
        psycopg.connect(dsn, application_name="psql") as stranger,
    ):
        before = bench.postgres_cpu_seconds(bench._postgres_backends(empty_pg_url))  # noqa: SLF001
        assert sorted(part for part, _ in before.values()) == ["analysis child", "other", "serve"]
        analysis.execute("SELECT count(*) FROM generate_series(1, 8000000)").fetchone()
        stranger.execute("SELECT count(*) FROM generate_series(1, 1000000)").fetchone()
        grew = bench.cpu_seconds_by_part(
            before, bench.postgres_cpu_seconds(bench._postgres_backends(empty_pg_url)), bench.SERVER_PARTS  # noqa: SLF001
        )
    assert list(grew) == list(bench.SERVER_PARTS)
    assert grew["analysis child"] >= 0.1
    assert grew["serve"] == 0.0
    assert 0.0 < grew["other"] < grew["analysis child"]


def test_the_writers_line_reads_the_collectors_own_families() -> None:
    """The batch writers over a window, from two /metrics texts of a collector process: here its
    ProcessMetrics told of 3 groups (12 batches, 0.3 s) between the two scrapes, by 2 threads over a
    1 s window: busy 15%, 4 batches and 100 ms a group."""
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from trainvitals.service.self_metrics import ProcessMetrics

    metrics = ProcessMetrics(writer_threads=2)
    registry = CollectorRegistry()
    registry.register(metrics)
    metrics.observe_group(1, 0.05)  # before the window
    start = bench.writer_counters(generate_latest(registry).decode())
    for batches, seconds in ((2, 0.05), (4, 0.1), (6, 0.15)):
        metrics.observe_group(batches, seconds)
    delta = bench.writer_delta(start, bench.writer_counters(generate_latest(registry).decode()))
    assert (delta.threads, delta.groups, delta.batches) == (2, 3, 12)
    assert abs(delta.seconds - 0.3) < 1e-9
    assert delta.line("postgresql", 1.0) == (
        "[postgresql] batch writers (2 threads): busy 15% of the window, 4.0 batches a group, 100.0 ms a group, "
        "3 groups/s"
    )


def test_the_writers_line_counts_the_batches_acknowledged_from_the_journal() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from trainvitals.service.self_metrics import ProcessMetrics

    acks = [5]
    metrics = ProcessMetrics(writer_threads=1, queue_records=lambda: 0, journal_acks=lambda: acks[0])
    registry = CollectorRegistry()
    registry.register(metrics)
    start = bench.writer_counters(generate_latest(registry).decode())
    metrics.observe_group(3, 0.1)
    acks[0] = 8
    delta = bench.writer_delta(start, bench.writer_counters(generate_latest(registry).decode()))
    assert delta.journal_acks == 3
    assert delta.line("sqlite", 1.0).endswith("1 groups/s; 3 batches acknowledged from the journal")
