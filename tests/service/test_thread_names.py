"""The collector's threads carry their names to the OS (`top -H`, `ps -L`, py-spy, the ingest
benchmark's CPU split), which Python 3.11's threading does not do by itself."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from trainvitals.service.ingest.batch_writer import BatchWriter
from trainvitals.service.periodic import Periodic
from trainvitals.service.thread_names import os_thread_name


def _os_name(thread: threading.Thread) -> str:
    return Path(f"/proc/self/task/{thread.native_id}/comm").read_text().strip()


def _named(thread: threading.Thread, name: str) -> bool:
    deadline = time.monotonic() + 5.0
    while _os_name(thread) != name and time.monotonic() < deadline:
        time.sleep(0.01)
    return _os_name(thread) == name


def test_the_os_name_drops_the_shared_prefix_and_fits_linux_15_bytes() -> None:
    assert os_thread_name("trainvitals-wal-checkpoint") == "wal-checkpoint"
    assert os_thread_name("trainvitals-batch-writer-12") == "batch-writer-12"
    assert os_thread_name("trainvitals-batch-writer-123") == "batch-writer-12"
    assert os_thread_name("Thread-7 (worker)") == "Thread-7 (worke"


def test_the_batch_writers_are_named_for_the_os() -> None:
    writer = BatchWriter(lambda: None, threads=2)  # type: ignore[arg-type, return-value] - never writes
    writer.start()
    try:
        threads = [t for t in threading.enumerate() if t.name.startswith("trainvitals-batch-writer-")]
        assert len(threads) == 2
        assert all(_named(t, t.name.removeprefix("trainvitals-")) for t in threads)
        assert _os_name(threading.main_thread()) != "batch-writer-0"
    finally:
        writer.stop()


def test_a_periodic_chore_is_named_for_the_os() -> None:
    chore = Periodic("trainvitals-wal-checkpoint", 60.0, lambda: None)
    chore.start()
    try:
        thread = next(t for t in threading.enumerate() if t.name == "trainvitals-wal-checkpoint")
        assert _named(thread, "wal-checkpoint")
    finally:
        chore.stop()
