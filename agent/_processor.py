"""The hand-off from the training thread to delivery, after OpenTelemetry's BatchProcessor.

`emit()` is O(1), never blocks and never raises: it appends a record dict (or a step sample that
expands into records later) to a bounded deque; when full, the oldest item is dropped and counted.
A named daemon thread wakes every send interval (`AgentConfig.send_interval_for`: it grows with the
job), cuts the queue into batches with consecutive `seq` numbers, encodes them and hands them to a
`Delivery` (the network and the spool, agent/_delivery.py), whose errors it catches per pass.
`flush()` and `shutdown()` run the same pass synchronously; `shutdown()` is idempotent and bounded.
A forked child (a DataLoader worker) stops exporting: the records are the parent's to send.

Nothing is lost silently: every record that will never reach the collector is counted by reason
(`ExporterStats.dropped`), the counts travel to the collector as a cumulative 'dropped' event with
the next batch after they change, and the delivery says them at exit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainvitals.agent._config import AgentConfig, send_phase
from trainvitals.agent._guard import ErrorBudget
from trainvitals.wire import batch_header, event_record
from trainvitals.wire.conventions import DROP_REASONS as WIRE_DROP_REASONS

_QUIET_EXIT_S = 1.0
"""At exit, a collector that takes the last batches within this is not worth a message."""

# Why a record was dropped (the keys of ExporterStats.dropped, of the 'dropped' event's domains).
QUEUE_FULL = "queue_full"
"""The queue was full (the exporter could not hand batches on as fast as they came): oldest first."""
SPOOL_FULL = "spool_full"
"""Could not be delivered now, the spool had reached spill_max_bytes, and the memory that stands in
for it was full too (or the process ended before the collector took it)."""
SPOOL_ERROR = "spool_error"
"""As SPOOL_FULL, but the spool could not be written (an unwritable directory, a full disk, a quota,
a file-size limit)."""
QUARANTINE_FULL = "quarantine_full"
"""Refused by the collector for good, and the quarantine file had reached spill_max_bytes."""
QUARANTINE_ERROR = "quarantine_error"
"""Refused by the collector for good, and the quarantine file could not be written."""
EXIT_TIMEOUT = "exit_timeout"
"""Still queued when shutdown gave up waiting for the exporter (a hung collector at exit)."""
# The wire names the reasons (the collector exports each by name); the constants above are its members.
DROP_REASONS: tuple[str, ...] = WIRE_DROP_REASONS


def _dumps(obj: Any) -> str:
    """Compact JSON, the wire format's spelling (NaN allowed as in json.dumps' default)."""
    return json.dumps(obj, separators=(",", ":"))


# A file name that is not UTF-8 comes out of os.fsdecode with lone surrogates, which json.dumps
# writes as \udcXX escapes: valid JSON, but no Unicode text, so the collector refused the whole
# batch (and the rank's steps in it) for one checkpoint path. Rewritten only when an escape of a
# surrogate is in the encoded text (a pair, an emoji, comes through unchanged).


def _as_utf8(value: Any) -> Any:
    """value with each string's undecodable bytes as \\xNN text (a surrogate that is no escaped
    byte as its UTF-8 bytes): readable, and what the file name's bytes were."""
    if isinstance(value, str):
        try:
            raw = value.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raw = value.encode("utf-8", "surrogatepass")
        return raw.decode("utf-8", "backslashreplace")
    if isinstance(value, dict):
        return {k: _as_utf8(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_as_utf8(v) for v in value]
    return value


@dataclass(frozen=True, slots=True)
class EncodedBatch:
    """One wire-format `Batch` as the JSON line that is sent (and spooled), without a newline."""

    seq: int
    body: bytes
    records: int
    """Wire records (a step's gradient and FP8 records count one each)."""
    items: int = 0
    """Queue items (a step with its gradient and FP8 records counts one): what a drop counts."""


@dataclass(slots=True)
class DeliveryReport:
    """What one delivery pass did; the processor adds it up into `ExporterStats`."""

    delivered_batches: int = 0
    delivered_records: int = 0
    """Wire records of this process the collector acknowledged: a step's gradient and FP8 records
    count one each (a leftover spool's records were the earlier process's and do not count)."""
    failed_attempts: int = 0
    rejected_batches: int = 0
    """Batches the collector refused for good (agent/_refusals.py): set aside in the quarantine
    file next to the spool, so later batches flow."""
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    """Queue items lost for good, by reason (DROP_REASONS); a batch an earlier process left in the
    spool counts its wire records."""


@dataclass(slots=True)
class ExporterStats(DeliveryReport):
    """Counters a user (or a test) can read from `agent.stats()`."""

    emitted_records: int = 0
    """Queue items: one per step (its gradient and FP8 records travel with it), event or
    checkpoint record."""

    @property
    def dropped_records(self) -> int:
        """Queue items lost for good, all reasons."""
        return sum(self.dropped.values())

    def add(self, report: DeliveryReport) -> None:
        for f in dataclasses.fields(DeliveryReport):
            if f.name == "dropped":
                for reason, n in report.dropped.items():
                    self.dropped[reason] = self.dropped.get(reason, 0) + n
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(report, f.name))


class Delivery(Protocol):
    """Where encoded batches go: the processor's only view of the network and the disk."""

    def deliver(
        self,
        batches: Sequence[EncodedBatch],
        *,
        deadline: float,
        ignore_backoff: bool = False,
        write_ahead: bool = False,
    ) -> DeliveryReport:
        """Take `batches` (consecutive seq, oldest first): deliver them, or keep them for a later
        pass, and retry what earlier passes kept. Returns by `deadline` (time.monotonic()).
        write_ahead: keep every batch on disk before sending any (the process is about to end)."""
        ...

    def undelivered(self) -> bool:
        """Whether anything handed over is still waiting for the collector."""
        ...

    def unsaved(self) -> dict[str, int]:
        """Queue items handed over that wait in memory only (the spool could not take them), by
        the reason they are not on disk: lost when the process ends. Only reads."""
        ...

    def exit_wait(self, seconds: float, queued_batches: int) -> None:
        """The process is ending and the last pass is still waiting for the collector: say how
        long it may wait, rather than hang silently (called from the thread that shuts down)."""
        ...

    def exit_report(self, dropped: Mapping[str, int]) -> None:
        """The process is ending: say what was not delivered and how to deliver it, and what was
        lost (`dropped`: this process's counts by reason)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class _DropEvent:
    """The processor's own 'dropped' event in the queue (told apart from the job's records)."""

    record: dict[str, Any]

    def records(self) -> list[dict[str, Any]]:
        return [self.record]


class BatchProcessor:
    """Bounded queue -> batches -> delivery, in a background thread.

    Usage::

        proc = BatchProcessor(config=cfg, run="r1", rank=0, incarnation=inc, delivery=delivery, world_size=8)
        proc.start()
        proc.emit(step_record(step=1, ts=time.time(), step_seconds=0.4))
        proc.shutdown()          # idempotent; waits at most cfg.flush_timeout_s
    """

    def __init__(
        self,
        *,
        config: AgentConfig,
        run: str,
        rank: int,
        incarnation: int,
        delivery: Delivery,
        errors: ErrorBudget | None = None,
        world_size: int = 1,
    ) -> None:
        self._cfg = config
        # The send interval: the config's, else one that grows with the job (AgentConfig.send_interval_for;
        # wire/conventions.py, JOB_BATCHES_PER_S: a collector's cost is per request).
        self.send_interval_s: float = config.send_interval_for(world_size)
        """Seconds between two passes of the worker thread."""
        self._run = run
        self._rank = rank
        self._incarnation = incarnation
        self._delivery = delivery
        self._errors = errors or ErrorBudget(config.log_every_s)
        # Items are record dicts, or objects whose records() expands them off the training thread.
        self._queue: deque[Any] = deque()
        self._seq = 0
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # serialises passes between the worker, flush and shutdown
        self._closed = False
        self._abandoned = False
        self._held = False
        self._in_forked_child = False
        self.stats = ExporterStats()
        self._reported_drops = dict(self.stats.dropped)  # what the last 'dropped' event said
        ref = weakref.ref(self)

        def after_fork_in_child() -> None:
            processor = ref()
            if processor is not None:
                processor._after_fork()

        os.register_at_fork(after_in_child=after_fork_in_child)

    # ------------------------------------------------------------------ training-thread side

    def emit(self, item: Any) -> None:
        """O(1), never blocks: a full queue drops its oldest item and counts it."""
        if self._closed or self._in_forked_child:
            return
        if len(self._queue) >= self._cfg.queue_max_records:
            self._queue.popleft()
            self.stats.dropped[QUEUE_FULL] += 1  # a key from the start: no resize under the worker
        self._queue.append(item)
        self.stats.emitted_records += 1

    def start(self) -> None:
        if self._thread is not None or self._closed:
            return
        self._thread = threading.Thread(target=self._worker, name="trainvitals-exporter", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = None) -> None:
        """Deliver what is queued within the timeout; what is left stays spooled. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._in_forked_child:
            # A forked child's copy: the spool and the connection are the parent's, which goes on
            # delivering them (a pass from here sent the parent's lines and could remove its spool
            # file under it), and the lock may have been copied mid-pass, held for ever.
            return
        timeout = self._cfg.flush_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self._stopping.set()
        self._wake.set()
        worker = self._thread
        if worker is not None and worker is not threading.current_thread():
            worker.join(min(timeout, _QUIET_EXIT_S))
            if worker.is_alive():
                # A slow or hung collector: the exit delay is stated, not silent.
                queued = -(-len(self._queue) // self._cfg.max_batch_records)
                self._delivery.exit_wait(deadline - time.monotonic(), queued)
                worker.join(max(0.0, deadline - time.monotonic()))
        if worker is None or not worker.is_alive():
            # No worker (or it finished): one last synchronous pass within what is left, and one
            # more for a 'dropped' event when that pass lost something the collector can still hear.
            self.run_once(deadline=deadline, ignore_backoff=True, write_ahead=True)
            if self._drops_changed() and not self._delivery.unsaved():
                self.run_once(deadline=deadline, ignore_backoff=True, write_ahead=True)
            self._delivery.close()
        # What is still only in memory ends with the process: counted, and said.
        self.stats.dropped[EXIT_TIMEOUT] += len(self._queue)
        for reason, n in self._delivery.unsaved().items():
            self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + n
        self._delivery.exit_report(dict(self.stats.dropped))

    def hold(self) -> None:
        """Deliver nothing until release() or abandon(): the process's rank is not known yet
        (Agent: attach() before init_process_group, no RANK in the environment)."""
        self._held = True

    def release(self) -> None:
        self._held = False

    def abandon(self) -> None:
        """Stop without delivering or spooling what is queued: records that name a rank this
        process is not (Agent.step, attach() before init_process_group). Idempotent."""
        with self._lock:  # not mid-pass: what the worker took already is on its way
            self._closed = self._abandoned = True
            self._queue.clear()
        self._stopping.set()
        self._wake.set()

    def flush(self, timeout: float = 10.0) -> bool:
        """Deliver everything queued now; True when nothing is left undelivered afterwards."""
        if self._in_forked_child:
            return False
        self.run_once(deadline=time.monotonic() + timeout, ignore_backoff=True)
        return not self._queue and not self._delivery.undelivered()

    # ------------------------------------------------------------------ background side

    def _worker(self) -> None:
        # The first pass comes at this rank's phase of the interval, so the job's requests arrive
        # spread over it (send_phase); rank 0, and a single process, wait one whole interval.
        wait_s = self.send_interval_s * (1.0 - send_phase(self._rank))
        while not self._stopping.is_set():
            self._wake.wait(wait_s)
            wait_s = self.send_interval_s
            self._wake.clear()
            if self._stopping.is_set():
                break
            if self._held:
                continue
            self.run_once(deadline=time.monotonic() + self.send_interval_s + self._cfg.http_timeout_s)
        if self._abandoned:
            return
        # The last pass: the process is ending, so everything goes to disk before the collector is
        # tried, and a hung request or the interpreter's exit cannot lose it.
        self.run_once(deadline=time.monotonic() + self._cfg.flush_timeout_s, ignore_backoff=True, write_ahead=True)

    def run_once(self, *, deadline: float, ignore_backoff: bool = False, write_ahead: bool = False) -> None:
        """One pass: queue -> batches -> delivery, until done, failing or out of time.

        The thread body; tests call it synchronously. Waits for a pass under way until the deadline
        at most: the worker's pass against a hung collector, or blocked where a sampled step's
        device work waits on a stuck collective, must not hold flush() or close() beyond theirs.
        """
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return
        try:
            if self._drops_changed():
                self._queue_drop_event()
            report = self._delivery.deliver(
                self._cut_batches(), deadline=deadline, ignore_backoff=ignore_backoff, write_ahead=write_ahead
            )
            self.stats.add(report)
        except Exception as exc:  # noqa: BLE001 - the exporter must outlive any bug
            self._errors.record("exporter", exc)
        finally:
            self._lock.release()

    def _drops_changed(self) -> bool:
        return self.stats.dropped != self._reported_drops

    def _queue_drop_event(self) -> None:
        """The counts so far, cumulative for this process: a lost or late event costs nothing, the
        collector keeps the newest (the largest) per (run, rank, incarnation). Not an emitted
        record; may pass the queue's bound by one."""
        counts = dict(self.stats.dropped)
        lost = {reason: n for reason, n in counts.items() if n}
        detail = "records lost by this process so far: " + ", ".join(f"{n} {r}" for r, n in lost.items())
        domains = {r: str(n) for r, n in lost.items()}
        self._queue.append(_DropEvent(event_record(ts=time.time(), event="dropped", detail=detail, domains=domains)))
        self._reported_drops = counts

    def _cut_batches(self) -> list[EncodedBatch]:
        batches: list[EncodedBatch] = []
        while self._queue:
            n = min(len(self._queue), self._cfg.max_batch_records)
            # Encoded one queue item (one step's records) at a time and joined: the same bytes as
            # json.dumps of the whole batch, but the C encoder holds the GIL for one step's worth
            # of records per call instead of a whole send interval's, so the training thread never
            # waits long for the GIL while a batch is being encoded.
            parts: list[str] = []
            count = 0
            items = n
            for _ in range(n):
                item = self._queue.popleft()
                items -= type(item) is _DropEvent  # not an emitted record: not counted if lost
                encoded = self._encode(item)
                if encoded is not None:
                    parts.append(encoded[0])
                    count += encoded[1]
            header = batch_header(
                run=self._run, rank=self._rank, incarnation=self._incarnation, seq=self._seq, sent_at=time.time()
            )
            body = (_dumps(header)[:-1] + ',"records":[' + ",".join(parts) + "]}").encode()
            batches.append(EncodedBatch(self._seq, body, count, items))
            self._seq += 1
        return batches

    def _encode(self, item: Any) -> tuple[str, int] | None:
        """One queue item's records as the inside of a JSON array, and how many; None when it has
        none, or when they cannot be built or encoded (logged): one bad item must not cost the
        batch, as a value JSON cannot hold once cost every record of the pass."""
        try:
            records: list[Any] = [item] if isinstance(item, dict) else item.records()
            if not records:
                return None
            text = _dumps(records)
            if "\\ud" in text:  # an escaped surrogate: re-encoded, which keeps a pair (an emoji) as it was
                text = _dumps(_as_utf8(records))
            return text[1:-1], len(records)
        except Exception as exc:  # noqa: BLE001
            self._errors.record("exporter", exc)
            return None

    def _after_fork(self) -> None:
        # DataLoader workers are forked from the training process: they must not export.
        self._in_forked_child = True
        self._queue = deque()
