"""A daemon thread that calls a function every few seconds until stopped: the one loop behind the
collector's background chores (SQLite WAL checkpoints, the ingest summary log line)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from trainvitals.service.thread_names import name_this_thread


class Periodic:
    """Usage::

    chore = Periodic("trainvitals-wal-checkpoint", 1.0, checkpoint)
    chore.start()   # tick() every interval seconds, first after one interval (or at once: first_now)
    chore.stop()    # wakes the thread and joins it

    `tick` must handle its own errors: an exception that escapes it ends the thread.
    """

    def __init__(self, name: str, interval: float, tick: Callable[[], None], *, first_now: bool = False) -> None:
        self._name = name
        self._interval = interval
        self._tick = tick
        self._first_now = first_now
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        name_this_thread()
        if self._first_now:
            self._tick()
        while not self._stop.wait(self._interval):
            self._tick()
