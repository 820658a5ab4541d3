"""How often a SQLite group's write waits for the GIL: its time alone and beside a thread that holds it.

    python benchmarks/sqlite_group_gil.py            # ~1 minute, one process

On SQLite, `serve`'s batch writer thread shares one GIL with the event loop. sqlite3 releases the
GIL around each statement's work (preparing, stepping, resetting) and must take it back after: when
the event loop holds it, the writer waits. This script stores groups of the ingest benchmark's
batches (`ingest_throughput._floor_batches`: 216 records each) with `store_batches` into a scratch
SQLite already holding `--prefill` batches, the rows built beforehand as the route builds them,
timing each group:

- **alone**: nothing else runs (the baseline, in the same run);
- **contended**: beside a thread that runs Python without pause. CPython hands the GIL back to a
  waiting thread only after the switch interval (5 ms), so each time the writer gives it up costs
  about that much: the extra time over `alone`, divided by the interval, counts the hand-backs.

The event loop releases the GIL far more often than this spinning thread (every socket read and
write), so `serve`'s waits are shorter; their number is what this measures. The statements a group
runs are counted with sqlite3's trace callback.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from ingest_throughput import WORLD_SIZE, _floor_batches, add_shared_args, cpu_model, sqlite_scratch_db  # noqa: E402

from trainvitals.service.ingest.decode import decode_batch  # noqa: E402
from trainvitals.service.store import batches, db  # noqa: E402
from trainvitals.wire import RunRegistration  # noqa: E402

RUN = "bench-gil"
PROJECT = "default"


def _groups(bodies: Iterator[bytes], size: int) -> Iterator[tuple[list[tuple[Any, str]], list[Any]]]:
    """Groups of `size` decoded batches (under the project, as with auth on) and their rows."""
    while True:
        decoded = [decode_batch(next(bodies)) for _ in range(size)]
        yield [(b, PROJECT) for b in decoded], [batches.batch_rows(b) for b in decoded]


def _spin(stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        for _ in range(1000):
            n += 1


def measure(session: Any, bodies: Iterator[bytes], size: int, groups: int, contended: bool) -> list[float]:
    """Seconds per group of `size`, each group new batches."""
    stop = threading.Event()
    spinner = threading.Thread(target=_spin, args=(stop,), daemon=True)
    if contended:
        spinner.start()
    times = []
    try:
        source = _groups(bodies, size)
        for _ in range(groups):
            items, rows = next(source)
            t0 = time.perf_counter()
            batches.store_batches(session, items, rows=rows)
            times.append(time.perf_counter() - t0)
    finally:
        stop.set()
        if contended:
            spinner.join()
    return times


def statements_of(session: Any, bodies: Iterator[bytes], size: int) -> list[str]:
    """The SQL statements one group of `size` runs, by their first words."""
    seen: list[str] = []
    dbapi = session.connection().connection.driver_connection
    dbapi.set_trace_callback(lambda sql: seen.append(" ".join(w.rstrip(",") for w in sql.split()[:3])))
    try:
        items, rows = next(_groups(bodies, size))
        batches.store_batches(session, items, rows=rows)
    finally:
        dbapi.set_trace_callback(None)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,11", help="group sizes in batches (default 1,11: open and closed loop)")
    parser.add_argument("--groups", type=int, default=40, help="timed groups per size and condition")
    parser.add_argument("--prefill", type=int, default=4096, help="batches stored before timing")
    add_shared_args(parser, server=False)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    interval = sys.getswitchinterval()
    print(f"machine: {cpu_model()}; Python {sys.version.split()[0]}, switch interval {interval * 1e3:.1f} ms")
    with sqlite_scratch_db(args.db_prefix) as url:
        db.upgrade(url)
        engine = db.make_engine(url)
        with db.make_sessionmaker(engine)() as session:
            batches.register_run(session, RunRegistration(run=RUN, parallelism={"world_size": WORLD_SIZE}))
            bodies = _floor_batches(RUN, steps_per_batch=4, layers_per_rank=4)
            for _ in range(args.prefill // 16):
                items, rows = next(_groups(bodies, 16))
                batches.store_batches(session, items, rows=rows)
            print(f"prefilled {args.prefill // 16 * 16} batches; {args.groups} groups per size and condition")
            print("batches a group  statements  alone ms (median)  contended ms (median)  ratio  GIL hand-backs")
            for size in sizes:
                statements = statements_of(session, bodies, size)
                alone = statistics.median(measure(session, bodies, size, args.groups, contended=False))
                contended = statistics.median(measure(session, bodies, size, args.groups, contended=True))
                hand_backs = (contended - alone) / interval
                print(
                    f"{size:15d}  {len(statements):10d}  {alone * 1e3:17.2f}  {contended * 1e3:21.2f}"
                    f"  {contended / alone:5.1f}  {hand_backs:14.1f}"
                )
                print(f"    statements: {', '.join(statements)}")
        engine.dispose()


if __name__ == "__main__":
    main()
