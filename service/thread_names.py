"""The operating system's name of the collector's own threads, so `top -H`, `ps -L`, py-spy and the
ingest benchmark's CPU split tell the batch writer from the event loop and the WAL checkpointer.

Python 3.11's `threading` names a thread for Python only: every thread of `trainvitals serve` shows
as `trainvitals` to the OS. Linux lets a thread rename itself by writing its `comm` file (15 bytes
at most); elsewhere this does nothing."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

_PREFIX = "trainvitals-"  # every collector thread's Python name starts so: 15 bytes leave no room for it


def os_thread_name(python_name: str) -> str:
    """The OS name for a thread of this Python name: the prefix dropped, cut to 15 bytes."""
    return python_name.removeprefix(_PREFIX).encode()[:15].decode(errors="ignore")


def name_this_thread() -> None:
    """Give the calling thread its Python name at the OS level (Linux; a no-op elsewhere)."""
    name = os_thread_name(threading.current_thread().name)
    with contextlib.suppress(OSError):
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(name)
