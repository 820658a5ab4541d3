"""The garbage collector's settings while the collector serves.

Under ingest load CPython's defaults were the largest part of the batch latency's tail. Every
request in flight holds a few hundred young container objects (coroutines, closures, the ASGI
scope), so with the default first-generation threshold (700 net allocations) the event loop ran a
collection every request or two, and every ~1.5 s a full one over the whole heap: about 195,000
objects, nearly all of them the modules and app built at start-up, which never become garbage.
A full collection held the GIL for 30-120 ms under load (the writer thread waits on it too), and
the first generation took another 4% of the event loop. Measured with gc.callbacks in
`trainvitals serve`, SQLite, 16 load generators (docs/performance.md, "Against the raw-insert
floor").

The analysis worker's process (`trainvitals analyse`, serve's child by default) runs with the same
settings: its reduction reads hundreds of thousands of rows a cycle, and with the defaults garbage
collection took 12% of its py-spy samples under ingest load, 4% with these (docs/performance.md).

While serving: the start-up heap is frozen (`gc.freeze`: full collections skip it) and the first
generation collects after 10,000 net allocations. Both are undone when serving stops, so an app
started and stopped many times in one process (tests) leaves the collector as it found it:
unfrozen objects are collected again.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_FIRST_GENERATION_THRESHOLD = 10_000


@contextmanager
def serving_gc() -> Iterator[None]:
    """Usage::

    with serving_gc():
        ...  # serve
    """
    before = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(_FIRST_GENERATION_THRESHOLD, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
