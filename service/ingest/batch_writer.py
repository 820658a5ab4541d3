"""Group commit: writer threads store the queued batches, many per transaction.

A commit has a fixed cost (PostgreSQL flushes its WAL, SQLite writes its WAL frames), and with
one transaction per request the collector spent most of its time there: request threads queued on
commits while both cores sat half idle. Here request handlers parse and validate, then hand the
batch over and wait; the writer takes whatever has queued up while the previous commit ran and
stores it with one COPY per record kind and one commit. A request is acknowledged only after the
commit that holds its batch.

Waiting for a group (`group_wait_s`, PostgreSQL's default 5 ms): a writer that finds fewer than
`full_group_records` queued waits up to that long for more before it writes, as long as each next
batch comes within half of it (`_NEXT_BATCH_WAIT`). A transaction costs PostgreSQL and the writer
fixed work whatever it holds (two round trips per COPY, the claim, the tail, the commit: the server
spent 5.2 us a record on groups of one batch, 3.1 on groups of 16), and two writers splitting a
moderate flow between them write groups of a few batches each. A lone batch waits half the wait
(2.5 ms) longer for its answer. SQLite's one writer, whose groups fill while its previous commit
runs, does not wait (0).

On PostgreSQL two writer threads (own connections) overlap: one builds and sends a group while
the server indexes and commits the other's. Idempotency holds across them (and across collector
replicas) because the database decides duplicates (ON CONFLICT DO NOTHING); rows shared by
transactions (a run's `runs` and `reduction_state` rows) are updated in run-id order, so two
groups cannot deadlock on them. SQLite has one writer at a time, so one thread.

Answers: a batch submitted on an event loop (the route) gets an asyncio future, and the writer
settles all of a group's with one `call_soon_threadsafe` on that loop. A concurrent.futures
Future per batch (wrapped for the loop) cost a condition variable each and one cross-thread
callback per batch, taken on both threads under the GIL. Elsewhere (tests, tools) `submit` returns
a concurrent.futures Future.

Backpressure: at most `max_pending_records` records wait; beyond that `submit` refuses and the
route answers 503, which the agent treats like an outage (spool, retry later).

Acknowledged from the journal (`ingest_journal_dir`, service/ingest/journal.py): with one request in
flight per sender, a sender that waits for its group's commit leaves the writers idle while it
sends the next, and the cores with them (on PostgreSQL a 16-sender closed loop kept them 57% busy).
With a journal, a batch is appended to it and acknowledged at once when (a) the writers' backlog is
under `journal_ack_records`, (b) the last group committed, and (c) a batch of the same run key and
incarnation was stored before by this process: so a first batch, an unknown run, another project's
run and a fenced incarnation are still answered by the database, as without the journal. The
writer then stores it in a fuller group and marks its entry committed. Such a batch the database
refuses later (its incarnation fenced meanwhile, a value it cannot store) is counted in
ingest_counts as it would have been, and logged; one that fails for the database's sake (down,
locked) is retried every second until stored, or replayed from the journal by the next start. Its
acknowledgement says `duplicate: false`; the database still decides, and counts, duplicates.

Nobody waits for the commit of a group of batches acknowledged from the journal, so its writer
waits for a fuller group (`journal_group_wait_s`, 50 ms, to `full_group_records`, as long as each
next batch comes within half of it) whatever the backend: below capacity the writers otherwise
commit a batch or two at a time, and a transaction's fixed work is most of what they spend (SQLite
at 100k records/s offered on a 2-core EPYC: groups of 1.6-3.8 batches and the writer 88-95% busy
without the wait, 19-20 batches and 52-64% busy with it). The first batch in the group that waits
for its commit ends that wait as `group_wait_s` would (docs/performance.md, session 69).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeAlias

import psycopg
import sqlalchemy.exc
from sqlalchemy.orm import Session

from trainvitals.service.ingest.journal import IngestJournal
from trainvitals.service.store import batches, run_keys
from trainvitals.service.store.batches import AnyBatch
from trainvitals.service.thread_names import name_this_thread
from trainvitals.wire import BatchAck

log = logging.getLogger(__name__)


_INLINE_ROWS_MAX = 4096
_NEXT_BATCH_WAIT = 0.5
"""Of the group wait (group_wait_s; journal_group_wait_s for batches acknowledged from the journal):
the longest a waiting writer waits for the next batch. A flow that pauses this long (a closed loop
whose senders all wait for answers) is written at once instead of idling to the end of the wait,
which cost such a loop 12% of its throughput; 0.5 kept most of the wait's saving at 100k records/s
offered (docs/performance.md, session 51). Journaled batches at a low rate (a few ranks every 2 s)
reach the database 25 ms after the last of them instead of 50 ms after the first (session 73)."""
FULL_GROUP_RECORDS = 4096
"""A group this large is written at once, without waiting for more: about 19 of the benchmark's
batches (a rank's 4 steps of 48 FP8 tensors), past the 16 at which a group's fixed work is about a
fifth of what the server spends on it."""
JOURNAL_GROUP_WAIT_S = 0.05
"""How long a writer whose group holds only batches acknowledged from the journal waits for more (the
module docstring), while each next batch comes within half of it: a step reaches the database, the
analysis and the screen up to this much later, against the agents' 2 s send interval."""
JOURNAL_ACK_RECORDS = 65_536
"""Default backlog under which a batch is acknowledged from the journal: about 300 of the benchmark's
batches, two thirds of a second at 100k records/s, so a crash of the host loses at most that."""
_RETRY_S = 1.0
"""A journaled batch whose write failed for the database's sake is tried again after this."""
_MAX_ATTEMPTS = 10
"""Failed writes of one journaled batch, the database reachable each time, before it is refused."""
_STORED_KEYS_MAX = 100_000
"""(run key, incarnation) pairs remembered as stored, at most: each rank's process is an incarnation,
so a collector that lives through many large jobs would otherwise keep every one of them. Past this
the memory is emptied (about 10 MB), and each pair's next batch waits for its commit once more."""


class WriterBusyError(RuntimeError):
    """Too many records are waiting to be written; the sender should retry later."""


Answer: TypeAlias = "Future[batches.BatchOutcome] | asyncio.Future[batches.BatchOutcome]"


@dataclass(slots=True)
class _Pending:
    batch: AnyBatch
    project: str | None
    rows: batches.BatchRows | None
    loop: asyncio.AbstractEventLoop | None  # the submitter's, when it submitted on one
    future: Answer | None  # None: acknowledged from the journal, nobody waits
    segment: int | None = None  # its journal segment, when journaled
    attempts: int = 0  # failed writes of a journaled batch


class BatchWriter:
    """Usage::

    writer = BatchWriter(sessionmaker)
    writer.start()
    outcome = writer.submit(batch, project=None).result()  # BatchAck or a refusal
    outcome = await asyncio.wrap_future(writer.submit(batch, project=None))  # on an event loop
    writer.stop()
    """

    def __init__(
        self,
        sessions: Callable[[], Session],
        *,
        threads: int = 1,
        max_group_records: int = 50_000,
        max_pending_records: int = 2_000_000,
        synchronous_commit: bool = True,
        group_wait_s: float = 0.0,
        full_group_records: int = FULL_GROUP_RECORDS,
        observe_group: Callable[[int, float], None] | None = None,
        journal: IngestJournal | None = None,
        journal_ack_records: int = JOURNAL_ACK_RECORDS,
        journal_group_wait_s: float = JOURNAL_GROUP_WAIT_S,
    ) -> None:
        self._sessions = sessions
        self._observe_group = observe_group  # (batches, seconds) of each group written: /metrics
        self._group_wait_s = group_wait_s  # the module docstring, "Waiting for a group"
        self._full_group_records = full_group_records
        self._synchronous_commit = synchronous_commit  # PostgreSQL: wait for the WAL flush (store_batches)
        self._threads = threads
        self._max_group_records = max_group_records
        self._max_pending_records = max_pending_records
        self._journal = journal  # the module docstring, "Acknowledged from the journal"
        self._journal_ack_records = journal_ack_records
        self._journal_group_wait_s = max(journal_group_wait_s, group_wait_s)
        self._stored_keys: set[tuple[str, int]] = set()  # (run key, incarnation) this process stored a batch of
        self._last_group_committed = True
        self._retry_at = 0.0  # monotonic time before which no group is written (after a database failure)
        self.journal_acks = 0  # batches acknowledged from the journal (/metrics, tests)
        self._journal_failed = False  # the last append failed (logged once until one succeeds)
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._pending_records = 0
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        self.groups = 0  # transactions committed (tests and benchmarks read the batching factor)

    def start(self) -> None:
        with self._lock:
            if not self._workers:
                # Each thread's name is also its ingest_counts row key: unique across processes/hosts.
                prefix = f"{socket.gethostname()}:{os.getpid()}"
                self._workers = [
                    threading.Thread(
                        target=self._run, args=(f"{prefix}:{i}",), name=f"trainvitals-batch-writer-{i}", daemon=True
                    )
                    for i in range(self._threads)
                ]
                for thread in self._workers:
                    thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Write everything already submitted, then stop the threads."""
        with self._lock:
            workers, self._workers = self._workers, []
        for _ in workers:
            self._queue.put(None)  # one stop mark per thread, queued behind every pending batch
        for thread in workers:
            thread.join(timeout)

    @property
    def pending_records(self) -> int:
        """Records accepted and not yet committed (the /metrics queue depth)."""
        return self._pending_records

    def submit(self, batch: AnyBatch, *, project: str | None, body: bytes | None = None) -> Answer:
        """Queue a validated batch; the future resolves after the commit that stores it: an asyncio
        future when called on a running event loop, else a concurrent.futures one (both can be
        awaited through `asyncio.wrap_future`). With a journal and the batch's `body` (as received),
        it may resolve at once instead (the module docstring, "Acknowledged from the journal")."""
        if not self._workers:
            self.start()  # lazily too: an app used without its lifespan (plain TestClient) still writes
        n = len(batch.records)
        with self._lock:
            if self._pending_records + n > self._max_pending_records and self._pending_records:
                raise WriterBusyError(f"{self._pending_records} records are waiting to be written; retry shortly")
            self._pending_records += n
        # Rows are built here, on the request's thread: the writer thread is the bound on ingest
        # (busy all the time under load), the event loop is not. Not for a large batch, which would
        # stall the event loop (0.3-1 us per record): the writer builds those.
        if project is not None:  # under its run's key (store/run_keys.py), so the rows built here carry it
            batch = run_keys.with_key(batch, run_keys.key_for(project, batch.run))
        rows = None
        if n <= _INLINE_ROWS_MAX:
            try:
                rows = batches.batch_rows(batch)
            except Exception:  # noqa: BLE001 - the writer builds them again and answers this batch alone
                rows = None  # (raising here would leave its records counted as pending for good)
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        future: Answer = Future() if loop is None else loop.create_future()
        if body is not None and (segment := self._journaled(batch, n, project, body)) is not None:
            self._queue.put(_Pending(batch, project, rows, loop, None, segment))
            future.set_result(BatchAck(accepted=n, duplicate=False))
            return future
        self._queue.put(_Pending(batch, project, rows, loop, future))
        return future

    def _journaled(self, batch: AnyBatch, n: int, project: str | None, body: bytes) -> int | None:
        """The journal segment this batch (keyed to its project) went to, when it is acknowledged
        from the journal; None when it waits for its commit."""
        if not (
            self._journal is not None
            and self._last_group_committed
            and (batch.run, batch.incarnation) in self._stored_keys
            and self._pending_records <= self._journal_ack_records
        ):
            return None
        try:
            segment = self._journal.append(project, body)
        except OSError as exc:  # a full or failing disk: answered after the commit instead, as without a journal
            if not self._journal_failed:
                log.error(
                    "ingest journal %s: %s; batches wait for their commit until it takes writes",
                    self._journal.slot,
                    exc,
                )
            self._journal_failed = True
            return None
        self._journal_failed = False
        self.journal_acks += 1
        return segment

    def _run(self, name: str) -> None:
        name_this_thread()
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                break
            group, records = [first], len(first.batch.records)
            gathering = time.monotonic()
            # The module docstring, "Waiting for a group"; longer while nobody waits for this commit.
            acked = first.future is None  # every batch so far acknowledged from the journal
            deadline = gathering + (self._journal_group_wait_s if acked else self._group_wait_s)
            while records < self._max_group_records:
                wait = 0.0
                if records < self._full_group_records:  # wait while batches keep coming, to the deadline
                    wait = min(deadline - time.monotonic(), self._next_batch_wait_s(acked))
                try:
                    item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                group.append(item)
                records += len(item.batch.records)
                if acked and item.future is not None:  # someone waits for this commit now
                    acked = False
                    deadline = min(deadline, gathering + self._group_wait_s)
            if (backoff := self._retry_at - time.monotonic()) > 0:  # the database failed a moment ago
                time.sleep(backoff)
            started = time.perf_counter()
            self._write(group, name)
            if self._observe_group is not None:
                with contextlib.suppress(Exception):  # a metric must never stop a writer
                    self._observe_group(len(group), time.perf_counter() - started)
            with self._lock:
                self._pending_records -= records

    def _next_batch_wait_s(self, acked: bool) -> float:
        """How long a gathering writer waits for the next batch (the module docstring, "Waiting for a
        group"): a flow that pauses longer is written, whether or not anyone waits for the commit."""
        return (self._journal_group_wait_s if acked else self._group_wait_s) * _NEXT_BATCH_WAIT

    def _write(self, group: list[_Pending], name: str) -> Exception | None:
        """Store the group and answer it; the database's failure, when it failed for its own sake
        (not a batch's value)."""
        try:
            with self._sessions() as session:
                outcomes = batches.store_batches(
                    session,
                    [(p.batch, p.project) for p in group],
                    writer=name,
                    rows=[p.rows for p in group],
                    synchronous_commit=self._synchronous_commit,
                )
            self.groups += 1
        except Exception as exc:  # noqa: BLE001 - the database refused the group: isolate the cause
            if len(group) > 1:
                # One transaction for all of them failed; store them one by one so a single
                # batch the database rejects does not take the others down with it.
                for i, item in enumerate(group):
                    failure = self._write([item], name)
                    if failure is not None and _unavailable(failure):  # the rest would wait and fail alike
                        self._retry_or_fail(group[i + 1 :], failure, name)
                        return failure
                return None
            if _refused_value(exc):  # this batch's values, not the database's state
                self._refused(group[0], batches.UnstorableBatchError(database_reason(exc)), name)
                return None
            log.exception("storing batch %s failed", _describe(group[0].batch))
            self._retry_or_fail(group, exc, name)
            return exc
        self._last_group_committed = True
        self._settled(group, outcomes)
        return None

    def _refused(self, item: _Pending, outcome: batches.UnstorableBatchError, name: str) -> None:
        self._settled([item], [outcome])
        with contextlib.suppress(Exception), self._sessions() as session:
            batches.count_unstorable(session, item.batch, writer=name, project=item.project)

    def _retry_or_fail(self, group: list[_Pending], exc: Exception, name: str) -> None:
        """The database failed these batches: those acknowledged from the journal go back in the
        queue (written again after `_RETRY_S`), the others are answered with the failure (503). A
        journaled batch that keeps failing while the database is reachable (`_MAX_ATTEMPTS`) is
        refused instead, so one batch no retry can store does not come back for ever."""
        self._last_group_committed = False
        self._retry_at = time.monotonic() + _RETRY_S
        again: list[_Pending] = []
        for item in (p for p in group if p.segment is not None):
            item.attempts += 1
            if item.attempts >= _MAX_ATTEMPTS and not _unavailable(exc):
                self._refused(item, batches.UnstorableBatchError(database_reason(exc)), name)
            else:
                again.append(item)
        with self._lock:
            self._pending_records += sum(len(p.batch.records) for p in again)  # _run counts them done once more
        for item in again:
            self._queue.put(item)
        waiting = [p for p in group if p.segment is None]
        _answer(waiting, [None] * len(waiting), failure=exc)

    def _settled(self, group: list[_Pending], outcomes: Sequence[batches.BatchOutcome]) -> None:
        """Answer the group; with a journal, first learn which runs' batches are stored (so a
        sender's next batch, sent on this answer, finds its run known), and close the group's
        journal entries."""
        if self._journal is None:
            _answer(group, outcomes)
            return
        for item, outcome in zip(group, outcomes, strict=True):
            key = (item.batch.run, item.batch.incarnation)
            if isinstance(outcome, BatchAck):
                if len(self._stored_keys) >= _STORED_KEYS_MAX and key not in self._stored_keys:
                    self._stored_keys.clear()
                self._stored_keys.add(key)
            else:
                self._stored_keys.discard(key)  # its next batches are answered by the database
                if item.segment is not None:
                    log.warning(
                        "batch %s, acknowledged from the ingest journal, was refused: %s (counted in "
                        "trainvitals_ingest_batches_total)", _describe(item.batch), outcome,
                    )  # fmt: skip
        _answer(group, outcomes)
        if segments := [p.segment for p in group if p.segment is not None]:
            self._journal.committed(segments)


def _answer(
    group: list[_Pending], outcomes: Sequence[batches.BatchOutcome | None], failure: Exception | None = None
) -> None:
    """Settle the group's futures with their outcomes (or all with `failure`, nothing stored):
    concurrent ones here, asyncio ones on their loop, one callback per loop for the group."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Answered]] = {}
    for item, outcome in zip(group, outcomes, strict=True):
        if item.future is None:  # acknowledged from the journal
            continue
        answered = (item.future, outcome, failure)
        if item.loop is None:
            _settle([answered])
        else:
            by_loop.setdefault(item.loop, []).append(answered)
    for loop, answers in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for these any more
            loop.call_soon_threadsafe(_settle, answers)


_Answered: TypeAlias = "tuple[Answer, batches.BatchOutcome | None, Exception | None]"


def _settle(answers: list[_Answered]) -> None:
    for future, outcome, failure in answers:
        if future.cancelled():  # its request went away (the client disconnected); stored all the same
            continue
        if failure is not None:
            future.set_exception(failure)
        else:
            future.set_result(outcome)  # type: ignore[arg-type]  # an outcome whenever failure is None


# Refusals caused by a value in the batch: psycopg's DataError (numeric value out of range, also
# raised by binary COPY), SQLAlchemy's wrapper of it, sqlite3 binding an int beyond 64 bits, and a
# string no UTF-8 holds (a lone surrogate, which a large body's lax decode lets through).
_DATA_ERRORS = (psycopg.DataError, sqlalchemy.exc.DataError, OverflowError, UnicodeEncodeError)


# The database cannot be reached or is locked: nothing about one batch (psycopg's, SQLAlchemy's
# wrapper of it, and sqlite3's "database is locked").
_UNAVAILABLE = (psycopg.OperationalError, sqlalchemy.exc.OperationalError, sqlite3.OperationalError)


def _unavailable(exc: BaseException) -> bool:
    """Whether a failed write says the database is down or locked, not that a batch cannot be stored."""
    return isinstance(exc, _UNAVAILABLE) or isinstance(getattr(exc, "orig", None), _UNAVAILABLE)


def _refused_value(exc: BaseException) -> bool:
    """A refusal of a value of the batch, also as SQLAlchemy wraps one it did not expect from the
    driver (a lone surrogate in a checkpoint path, bound through the ORM's insert)."""
    return isinstance(exc, _DATA_ERRORS) or isinstance(getattr(exc, "orig", None), _DATA_ERRORS)


def database_reason(exc: BaseException) -> str:
    """What a client is told of a database error: the driver's class and first line, e.g.
    "DataError: invalid byte sequence for encoding UTF8: 0x00". Never SQLAlchemy's text, which
    carries the statement and every bound parameter (the log has them)."""
    cause = getattr(exc, "orig", None) or exc
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else 'no message'}"[:300]


def _describe(batch: AnyBatch) -> str:
    return f"run={batch.run} rank={batch.rank} incarnation={batch.incarnation} seq={batch.seq}"
