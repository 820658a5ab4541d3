"""Delivery from a rank to the collector, after OpenTelemetry's BatchProcessor.

`emit()` is O(1), never blocks and never raises: it appends a record dict to a bounded deque
(full: the oldest is dropped and counted). A named daemon thread wakes every `send_interval_s`,
cuts the queue into batches with consecutive `seq` numbers and writes each batch ahead to the
on-disk spool, then delivers the spool in order. A batch leaves the spool only after the
collector acknowledged it, so a collector outage, a hung request or the job exiting loses
nothing that reached the spool: the next attempt (or the next incarnation of this rank, or
`trainvitals replay` on the spool file) delivers it, and the collector's idempotency on
(run, rank, incarnation, seq) drops anything delivered twice.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.parse
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainvitals.agent._config import AgentConfig
from trainvitals.agent._guard import ErrorBudget
from trainvitals.agent._spill import Spool, spool_path


def _dumps(obj: Any) -> str:
    """Compact JSON, the wire format's spelling (NaN allowed as in json.dumps' default)."""
    return json.dumps(obj, separators=(",", ":"))


class Transport(Protocol):
    def post(self, path: str, body: bytes, timeout: float) -> int:
        """POST JSON; return the HTTP status, raise OSError when the collector is unreachable."""
        ...


class HttpTransport:
    """Keep-alive HTTP/1.1 to one collector, standard library only (the agent imports torch only)."""

    def __init__(self, base_url: str, token: str | None = None) -> None:
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"collector URL must be http(s)://host[:port], got {base_url!r}")
        self._https = parsed.scheme == "https"
        self._host = parsed.hostname
        self._port = parsed.port or (443 if self._https else 80)
        self._prefix = parsed.path.rstrip("/")
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._conn: http.client.HTTPConnection | None = None

    def post(self, path: str, body: bytes, timeout: float) -> int:
        for attempt in (0, 1):  # one silent retry: a keep-alive connection may have been closed
            conn = self._connection(timeout)
            try:
                conn.request("POST", self._prefix + path, body=body, headers=self._headers)
                resp = conn.getresponse()
                resp.read()
                return resp.status
            except (http.client.HTTPException, OSError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=timeout)
        else:
            self._conn.timeout = timeout
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


@dataclass(slots=True)
class ExporterStats:
    """Counters a user (or a test) can read from `agent.stats()`."""

    emitted_records: int = 0
    dropped_records: int = 0
    delivered_batches: int = 0
    delivered_records: int = 0
    failed_attempts: int = 0
    rejected_batches: int = 0
    spool_dropped_batches: int = 0


# HTTP statuses after which retrying the same bytes cannot succeed: the batch is set aside.
_PERMANENT = {400, 413, 422}


class Exporter:
    """Bounded queue -> batches -> write-ahead spool -> collector, in a background thread.

    Usage::

        exp = Exporter(config=cfg, run="r1", rank=0, incarnation=inc, registration={...})
        exp.start()
        exp.emit({"kind": "step", "step": 1, ...})
        exp.shutdown()          # idempotent; waits at most cfg.flush_timeout_s
    """

    def __init__(
        self,
        *,
        config: AgentConfig,
        run: str,
        rank: int,
        incarnation: int,
        registration: dict[str, Any],
        transport: Transport | None = None,
        errors: ErrorBudget | None = None,
    ) -> None:
        self._cfg = config
        self._run = run
        self._rank = rank
        self._incarnation = incarnation
        self._registration_line = json.dumps(registration, separators=(",", ":")).encode()
        if transport is None and config.collector:
            transport = HttpTransport(config.collector, config.token)
        self._transport = transport
        self._errors = errors or ErrorBudget(config.log_every_s)
        # Items are record dicts, or objects whose records() expands them off the training thread.
        self._queue: deque[Any] = deque()
        self._seq = 0
        self._spool = Spool(spool_path(str(config.spill_dir), run, rank), config.spill_max_bytes)
        self._record_path = (
            Path(config.record_file.replace("{rank}", str(rank))) if config.record_file else None
        )
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # serialises run_once between the worker and shutdown
        self._next_attempt = 0.0
        self._registered = False  # the collector acknowledged our registration in this process
        self._closed = False
        self._in_forked_child = False
        self.stats = ExporterStats()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (e := ref()) is not None and e._after_fork())

    # ------------------------------------------------------------------ training-thread side

    def emit(self, record: Any) -> None:
        """O(1), never blocks: a full queue drops its oldest record and counts it."""
        if self._closed or self._in_forked_child:
            return
        if len(self._queue) >= self._cfg.queue_max_records:
            self._queue.popleft()
            self.stats.dropped_records += 1
        self._queue.append(record)
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
        timeout = self._cfg.flush_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self._stopping.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            # No worker (or it finished): one last synchronous pass within what is left.
            self.run_once(deadline=deadline)
        if self._transport is not None and (self._thread is None or not self._thread.is_alive()):
            close = getattr(self._transport, "close", None)
            if close is not None:
                close()

    def flush(self, timeout: float = 10.0) -> bool:
        """Deliver everything queued now; True when the spool is empty afterwards."""
        self.run_once(deadline=time.monotonic() + timeout, ignore_backoff=True)
        return len(self._spool) == 0 and not self._queue

    # ------------------------------------------------------------------ background side

    def _worker(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self._cfg.send_interval_s)
            self._wake.clear()
            if self._stopping.is_set():
                break
            self.run_once(deadline=time.monotonic() + self._cfg.send_interval_s + self._cfg.http_timeout_s)
        self.run_once(deadline=time.monotonic() + self._cfg.flush_timeout_s, ignore_backoff=True)

    def run_once(self, *, deadline: float, ignore_backoff: bool = False) -> None:
        """One pass: queue -> spool, then spool -> collector until done, failing or out of time.

        The thread body; tests call it synchronously.
        """
        with self._lock:
            try:
                self._cut_batches()
                if ignore_backoff or time.monotonic() >= self._next_attempt:
                    self._drain(deadline)
            except Exception as exc:  # noqa: BLE001 - the exporter must outlive any bug
                self._errors.record("exporter", exc)

    def _cut_batches(self) -> None:
        while self._queue:
            n = min(len(self._queue), self._cfg.max_batch_records)
            # Encoded one queue item (one step's records) at a time and joined: the same bytes as
            # json.dumps of the whole batch, but the C encoder holds the GIL for one step's worth
            # of records per call instead of a whole send interval's, so the training thread never
            # waits long for the GIL while a batch is being encoded.
            parts: list[str] = []
            for _ in range(n):
                item = self._queue.popleft()
                records = [item] if isinstance(item, dict) else item.records()
                if records:
                    parts.append(_dumps(records)[1:-1])
            header = _dumps(
                {
                    "wire_version": 1,
                    "run": self._run,
                    "rank": self._rank,
                    "incarnation": self._incarnation,
                    "seq": self._seq,
                    "sent_at": time.time(),
                    "records": [],
                }
            )
            self._seq += 1
            line = (header[:-2] + ",".join(parts) + "]}").encode()
            if self._record_path is not None:
                self._record(line)
            if len(self._spool) == 0 and not self._spool.path.exists():
                # A spool file always starts with the registration: on its own it is replayable.
                # Written with the batch in one append: one fsync instead of two.
                line_to_spool = self._registration_line + b"\n" + line
            else:
                line_to_spool = line
            if not self._spool.append(line_to_spool):
                self.stats.spool_dropped_batches += 1
                self._errors.record("spool", OSError(f"spool {self._spool.path} full; batch dropped"))

    def _record(self, line: bytes) -> None:
        assert self._record_path is not None
        new = not self._record_path.exists()
        self._record_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._record_path, "ab") as fh:
            if new:
                fh.write(self._registration_line + b"\n")
            fh.write(line + b"\n")

    def _drain(self, deadline: float) -> None:
        if self._transport is None:
            return
        for offset, line in self._spool.pending():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            if not self._deliver(line, min(self._cfg.http_timeout_s, remaining)):
                self.stats.failed_attempts += 1
                self._next_attempt = time.monotonic() + self._cfg.retry_backoff_s
                return
            self._spool.mark_delivered(offset)

    def _deliver(self, line: bytes, timeout: float) -> bool:
        """True when the collector has the message (or it can never take it and was set aside)."""
        assert self._transport is not None
        is_batch = b'"records":' in line
        if not is_batch and self._registered:
            return True  # every spool file starts with the registration; send it once per process
        path = "/v1/batches" if is_batch else "/v1/runs"
        try:
            status = self._transport.post(path, line, timeout)
            if status == 409 and is_batch:
                # The collector lost or never saw the registration (e.g. a fresh database): resend it.
                if self._transport.post("/v1/runs", self._registration_line, timeout) < 300:
                    status = self._transport.post(path, line, timeout)
        except OSError as exc:
            self._errors.record("deliver", exc)
            return False
        if status < 300:
            if not is_batch:
                self._registered = True
            if is_batch:
                self.stats.delivered_batches += 1
                self.stats.delivered_records += line.count(b'"kind":')
            return True
        if status in _PERMANENT:
            self.stats.rejected_batches += 1
            rejected = self._spool.path.with_suffix(".rejected.jsonl")
            with open(rejected, "ab") as fh:
                fh.write(line + b"\n")
            self._errors.record(
                "deliver", ValueError(f"collector rejected a message ({status}); kept in {rejected}")
            )
            return True
        self._errors.record("deliver", OSError(f"collector answered {status}"))
        return False

    def _after_fork(self) -> None:
        # DataLoader workers are forked from the training process: they must not export.
        self._in_forked_child = True
        self._queue = deque()
