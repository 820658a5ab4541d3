"""Delivery of encoded batches to the collector: the network first, the spool when it fails.

While the collector keeps up, a batch goes from memory to the collector and never touches the
disk. A batch that cannot be sent now (the collector is down, slow or answering 5xx, the retry
backoff is running, or older batches are still waiting) is appended to the per-rank spool file
and delivered from there, oldest first, by a later pass or by the next process of the same rank
(or with `trainvitals replay` on the file); the collector's idempotency on
(run, rank, incarnation, seq) drops anything delivered twice. When the process is about to end
(the last pass), every batch is written to the spool before anything is sent. Why not every
batch ahead of sending: docs/agent.md, "Spool".

A message the collector refuses for good (400, 413, 422) is set aside in `<spool>.rejected.jsonl`
instead of being retried forever. Every batch is also appended to `record_file` when one is set.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from trainvitals.agent._config import AgentConfig
from trainvitals.agent._guard import ErrorBudget
from trainvitals.agent._processor import BatchProcessor, DeliveryReport, EncodedBatch
from trainvitals.agent._spool import Spool, spool_path
from trainvitals.agent._transport import HttpTransport, Transport
from trainvitals.wire.builders import JsonObject

MessageKind = Literal["registration", "batch"]
_PATHS: dict[MessageKind, str] = {"registration": "/v1/runs", "batch": "/v1/batches"}

# HTTP statuses after which retrying the same bytes cannot succeed: the message is set aside.
_PERMANENT = {400, 413, 422}

_Outcome = Literal["delivered", "rejected", "failed"]


class SpoolingDelivery:
    """The agent's `Delivery`: HTTP to the collector, the spool for what has to wait.

    Not thread-safe: the processor calls it from one pass at a time.

    Usage::

        delivery = SpoolingDelivery(config=cfg, run="r1", rank=0, registration=reg)
        report = delivery.deliver(batches, deadline=time.monotonic() + 5.0)
        delivery.close()
    """

    def __init__(
        self,
        *,
        config: AgentConfig,
        run: str,
        rank: int,
        registration: JsonObject,
        transport: Transport | None = None,
        errors: ErrorBudget | None = None,
    ) -> None:
        self._cfg = config
        self._registration = json.dumps(registration, separators=(",", ":")).encode()
        if transport is None and config.collector:
            transport = HttpTransport(config.collector, config.token)
        self._transport = transport
        self._errors = errors or ErrorBudget(config.log_every_s)
        self._spool = Spool(spool_path(str(config.spill_dir), run, rank), config.spill_max_bytes)
        self._rejected = self._spool.path.with_suffix(".rejected.jsonl")
        self._record_path = Path(config.record_file.replace("{rank}", str(rank))) if config.record_file else None
        self._next_attempt = 0.0
        self._registered = False  # the collector acknowledged a registration from this process
        # Record counts of the batches this process spooled, oldest first; lines that an earlier
        # process left (the first `_leftover_end` bytes of the file) are not this process's records.
        self._spooled_records: deque[int] = deque()
        self._leftover_end = len(self._spool)

    # ------------------------------------------------------------------ Delivery

    def deliver(
        self,
        batches: Sequence[EncodedBatch],
        *,
        deadline: float,
        ignore_backoff: bool = False,
        write_ahead: bool = False,
    ) -> DeliveryReport:
        report = DeliveryReport()
        if self._record_path is not None:
            for batch in batches:
                self._record(batch.body)
        can_send = self._transport is not None and (ignore_backoff or time.monotonic() >= self._next_attempt)
        if not can_send or write_ahead or len(self._spool):
            # Behind what already waits (seq order), or to disk first because the process ends.
            self._to_spool(batches, report)
            if can_send:
                self._drain(deadline, report)
            return report
        for i, batch in enumerate(batches):
            outcome = self._send_from_memory(batch, deadline, report)
            if outcome is None or outcome == "failed":
                # Out of time or failed: this batch and the ones after it wait in the spool.
                if outcome == "failed":
                    self._failed(report)
                self._to_spool(batches[i:], report)
                break
        return report

    def undelivered(self) -> bool:
        return len(self._spool) > 0

    def close(self) -> None:
        close = getattr(self._transport, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ sending

    def _send_from_memory(self, batch: EncodedBatch, deadline: float, report: DeliveryReport) -> _Outcome | None:
        """One batch, preceded by the registration if this process has not sent it yet; None when
        out of time before trying."""
        if not self._registered:
            outcome = self._send("registration", self._registration, deadline)
            if outcome != "rejected" and outcome != "delivered":
                return outcome
            self._count("registration", outcome, 0, report)
        outcome = self._send("batch", batch.body, deadline)
        if outcome is not None and outcome != "failed":
            self._count("batch", outcome, batch.records, report)
        return outcome

    def _send(self, kind: MessageKind, body: bytes, deadline: float) -> _Outcome | None:
        assert self._transport is not None
        timeout = min(self._cfg.http_timeout_s, deadline - time.monotonic())
        if timeout <= 0:
            return None
        try:
            status = self._transport.post(_PATHS[kind], body, timeout)
            if status == 409 and kind == "batch":
                # The collector lost or never saw the registration (e.g. a fresh database): resend it.
                if self._transport.post(_PATHS["registration"], self._registration, timeout) < 300:
                    status = self._transport.post(_PATHS[kind], body, timeout)
        except OSError as exc:
            self._errors.record("deliver", exc)
            return "failed"
        if status < 300:
            if kind == "registration":
                self._registered = True
            return "delivered"
        if status in _PERMANENT:
            self._rejected.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with open(self._rejected, "ab") as fh:
                fh.write(body + b"\n")
            self._errors.record(
                "deliver", ValueError(f"collector rejected a message ({status}); kept in {self._rejected}")
            )
            return "rejected"
        self._errors.record("deliver", OSError(f"collector answered {status}"))
        return "failed"

    def _failed(self, report: DeliveryReport) -> None:
        report.failed_attempts += 1
        self._next_attempt = time.monotonic() + self._cfg.retry_backoff_s

    @staticmethod
    def _count(kind: MessageKind, outcome: _Outcome, records: int, report: DeliveryReport) -> None:
        if outcome == "rejected":
            report.rejected_batches += 1
        elif outcome == "delivered" and kind == "batch":
            report.delivered_batches += 1
            report.delivered_records += records

    # ------------------------------------------------------------------ the spool

    def _to_spool(self, batches: Sequence[EncodedBatch], report: DeliveryReport) -> None:
        for batch in batches:
            line = batch.body
            if not self._spool.path.exists():
                # A spool file always starts with the registration: on its own it is replayable, and
                # its first line is known to be the registration. Written with the batch in one
                # append: one fsync instead of two.
                line = self._registration + b"\n" + line
                self._leftover_end = 0
            if self._spool.append(line):
                self._spooled_records.append(batch.records)
            else:
                report.spool_dropped_batches += 1
                self._errors.record("spool", OSError(f"spool {self._spool.path} full; batch dropped"))

    def _drain(self, deadline: float, report: DeliveryReport) -> None:
        """Spooled messages to the collector, oldest first, until done, failing or out of time."""
        for item in self._spool.pending():
            # The spool's structure says what a line is: its first line is the registration.
            kind: MessageKind = "registration" if item.first else "batch"
            if kind == "registration" and self._registered:
                outcome: _Outcome | None = "delivered"  # once per process is enough
            else:
                outcome = self._send(kind, item.line, deadline)
            if outcome is None:
                return
            if outcome == "failed":
                self._failed(report)
                return
            ours = kind == "batch" and item.end > self._leftover_end and bool(self._spooled_records)
            self._count(kind, outcome, self._spooled_records.popleft() if ours else 0, report)
            self._spool.mark_delivered(item.end)

    def _record(self, line: bytes) -> None:
        assert self._record_path is not None
        new = not self._record_path.exists()
        self._record_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._record_path, "ab") as fh:
            if new:
                fh.write(self._registration + b"\n")
            fh.write(line + b"\n")


def spooling_exporter(
    *,
    config: AgentConfig,
    run: str,
    rank: int,
    incarnation: int,
    registration: JsonObject,
    transport: Transport | None = None,
    errors: ErrorBudget | None = None,
) -> BatchProcessor:
    """The agent's exporter: a BatchProcessor delivering through a SpoolingDelivery."""
    errors = errors or ErrorBudget(config.log_every_s)
    delivery = SpoolingDelivery(
        config=config, run=run, rank=rank, registration=registration, transport=transport, errors=errors
    )
    return BatchProcessor(
        config=config, run=run, rank=rank, incarnation=incarnation, delivery=delivery, errors=errors
    )
