"""Delivery of encoded batches to the collector: the network first, the spool when it fails.

While the collector keeps up, a batch goes from memory to the collector and never touches the
disk. A batch that cannot be sent now (the collector is down, slow or answering 5xx, the retry
backoff is running, or older batches are still waiting) is appended to the per-rank spool file
and delivered from there, oldest first, by a later pass or by the next process of the same rank
(or with `trainvitals replay` on the file); the collector's idempotency on
(run, rank, incarnation, seq) drops anything delivered twice. When the process is about to end
(the last pass), every batch is written to the spool before anything is sent. Why not every
batch ahead of sending: docs/agent.md, "Spool".

A message the collector refuses for good (agent/_refusals.py: malformed, a refused registration,
or an auth refusal that outlasted its retry window) is moved to the quarantine file next to the
spool, so that delivery in order never lets one refusal hold back later data; what the user is
told about it is agent/_notices.py. Every batch is also appended to `record_file` when one is set.

When the spool cannot take a batch (an unwritable directory, a full disk, a file-size limit, or
spill_max_bytes reached), the batch is kept in memory instead, behind the spool's lines and ahead
of newer batches (so delivery stays in seq order), up to `hold_max_bytes`, and is sent from there;
it moves to the spool as soon as the spool takes it again. A batch that fits nowhere, or is still
only in memory when the process ends, is dropped and counted by reason (agent/_processor.py).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

from trainvitals.agent import _refusals
from trainvitals.agent._config import AgentConfig
from trainvitals.agent._guard import ErrorBudget
from trainvitals.agent._notices import Notices
from trainvitals.agent._processor import (
    EXIT_TIMEOUT,
    QUARANTINE_ERROR,
    QUARANTINE_FULL,
    SPOOL_ERROR,
    SPOOL_FULL,
    BatchProcessor,
    DeliveryReport,
    EncodedBatch,
)
from trainvitals.agent._spool import Quarantine, Spool, spool_path
from trainvitals.agent._transport import HttpTransport, Reply, Transport
from trainvitals.wire.builders import JsonObject

MessageKind = Literal["registration", "batch"]
_PATHS: dict[MessageKind, str] = {"registration": "/v1/runs", "batch": "/v1/batches"}

_Outcome = Literal["delivered", "set_aside", "failed"]

HOLD_MAX_BYTES = 64 << 20
"""Encoded batches kept in memory while the spool cannot take them: ~3,000 of the default agent's
~20 KiB batches, over 1.5 h of a 2 s send interval; a bound the training process can afford."""


class _Held(NamedTuple):
    """A batch kept in memory, and why it is not in the spool (its drop reason if it is lost)."""

    batch: EncodedBatch
    reason: str


class _Spooled(NamedTuple):
    """What one of this process's spool lines holds: wire records, queue items."""

    records: int
    items: int


def _encode(obj: JsonObject) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class SpoolingDelivery:
    """The agent's `Delivery`: HTTP to the collector, the spool for what has to wait, the
    quarantine file for what the collector refused for good.

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
        hold_max_bytes: int = HOLD_MAX_BYTES,
    ) -> None:
        self._cfg = config
        # A registration without a project takes the token's (the collector fills it in and says
        # which); later copies of it (new spool files, the quarantine) then name it.
        self._registration_fields: dict[str, Any] = dict(registration)
        self._registration = _encode(registration)
        self._own_registrations = {self._registration}
        # Registrations the collector took (this process's, a leftover's): the only ones a set-aside
        # batch is written under. Replaying a refused one would store the run under the project (or
        # with the token) the collector refused; without it, replay stores the batches only into
        # the run as it is registered by then (by the corrected rerun), and says so when it is not.
        self._accepted: set[bytes] = set()
        if transport is None and config.collector:
            transport = HttpTransport(config.collector, config.token)
        self._transport = transport
        self._errors = errors or ErrorBudget(config.log_every_s)
        self._spool = Spool(spool_path(str(config.spill_dir), run, rank), config.spill_max_bytes)
        self._quarantine = Quarantine(self._spool.path, config.spill_max_bytes)
        self._auth = _refusals.AuthWindow(config.auth_retry_s)
        self._notices = Notices(
            collector=config.collector or "",
            spool=self._spool.path,
            quarantine=self._quarantine.path,
            token=config.token,
            # A retry waits for the processor's next pass: what the user is told is the longer of the two.
            retry_backoff_s=max(config.retry_backoff_s, config.send_interval_for(world_size_of(registration))),
            hold_max_bytes=hold_max_bytes,
        )
        self._record_path = Path(config.record_file.replace("{rank}", str(rank))) if config.record_file else None
        self._next_attempt = 0.0
        self._backoff_s = config.retry_backoff_s  # after the latest failure
        self._registered = False  # the collector acknowledged this process's registration
        # The collector refused this process's registration for good (409: another job's run id, or
        # with auth off another project's): it refuses its batches too, so they are set aside without asking again.
        self._refused_for_good = False
        # Record counts of the batches this process spooled, oldest first; lines that an earlier
        # process left (the first `_leftover_end` bytes of the file) are not this process's records.
        self._spooled: deque[_Spooled] = deque()
        # Batches the spool could not take, oldest first; all newer than every spool line.
        self._held: deque[_Held] = deque()
        self._held_bytes = 0
        self._hold_max_bytes = hold_max_bytes
        self._in_hand = 0  # queue items of the pass in progress not yet delivered, spooled or held
        self._leftover_end = len(self._spool)
        # An earlier process's lines travel under its own registration: if the collector refuses
        # that for good, they are set aside with it rather than stored under this process's.
        self._leftover_registration = self._spool.first_line() if self._leftover_end else None
        self._leftover_refused = False
        if self._spool.torn_bytes:
            self._notices.torn_tail(self._spool.torn_bytes)

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
        self._in_hand = sum(b.items for b in batches)
        if self._record_path is not None:
            self._record(batches)
        can_send = self._transport is not None and (ignore_backoff or time.monotonic() >= self._next_attempt)
        if not can_send or write_ahead:
            # To disk first because the process ends (or nothing can be sent now).
            self._keep(batches, report)
            if can_send:
                self._drain(deadline, report)
            return report
        if self.undelivered():
            # What already waits goes first (seq order); new batches follow it only if it all went,
            # so a full memory hold is emptied before a new batch would find no room in it.
            self._drain(deadline, report)
            if self.undelivered():
                self._keep(batches, report)
                return report
        for i, batch in enumerate(batches):
            outcome = self._send_batch(batch.body, deadline, report, leftover=False, items=batch.items)
            if outcome is None or outcome == "failed":
                # Out of time or failed: this batch and the ones after it wait in the spool.
                if outcome == "failed":
                    self._failed(report)
                self._keep(batches[i:], report)
                break
            self._in_hand -= batch.items
            self._count("batch", outcome, batch.records, report)
        return report

    def undelivered(self) -> bool:
        return bool(self._held) or len(self._spool) > 0

    def unsaved(self) -> dict[str, int]:
        lost: dict[str, int] = {}
        for held in list(self._held):  # a copy: a hung worker may still be using the deque
            lost[held.reason] = lost.get(held.reason, 0) + held.batch.items
        if self._in_hand:
            lost[EXIT_TIMEOUT] = lost.get(EXIT_TIMEOUT, 0) + self._in_hand
        return lost

    def exit_wait(self, seconds: float, queued_batches: int) -> None:
        try:
            self._notices.exit_wait(seconds, queued_batches + self._spool.pending_batches())
        except OSError as exc:
            self._errors.record("exit_wait", exc)

    def exit_report(self, dropped: Mapping[str, int]) -> None:
        try:
            self._notices.exit_dropped(dropped)
            if self._transport is None:
                return  # sending is off (collector ""): the spool is the output
            self._notices.exit_report(waiting=self._spool.pending_batches(), set_aside=self._quarantine.batches)
        except OSError as exc:
            self._errors.record("exit_report", exc)

    def close(self) -> None:
        close = getattr(self._transport, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ sending

    def _send_batch(
        self, body: bytes, deadline: float, report: DeliveryReport, *, leftover: bool, items: int | None
    ) -> _Outcome | None:
        """One batch, preceded by this process's registration while the collector has not
        acknowledged it (an earlier process's batches follow their own, from the spool); None
        when out of time before trying. items: see _set_aside."""
        if not leftover and self._refused_for_good:
            return self._set_aside(body, report, leftover=False, items=items)
        if not leftover and not self._registered:
            outcome = self._send("registration", self._registration, deadline, report, leftover=False)
            if outcome is None or outcome == "failed":
                return outcome
        return self._send("batch", body, deadline, report, leftover=leftover, items=items)

    def _send(
        self,
        kind: MessageKind,
        body: bytes,
        deadline: float,
        report: DeliveryReport,
        *,
        leftover: bool,
        items: int | None = None,
    ) -> _Outcome | None:
        assert self._transport is not None
        timeout = min(self._cfg.http_timeout_s, deadline - time.monotonic())
        if timeout <= 0:
            return None
        refused: MessageKind = kind
        try:
            reply = self._transport.post(_PATHS[kind], body, timeout)
            if kind == "registration":
                body, reply = self._without_later_fields(body, reply, timeout)
            elif reply.status == 409:
                # The collector does not know the run (a fresh database, or its registration was
                # refused): register, then try the batch once more.
                reg = self._transport.post(_PATHS["registration"], self._registration, timeout)
                _, reg = self._without_later_fields(self._registration, reg, timeout)
                if reg.status < 300:
                    self._acknowledged(reg)
                    reply = self._transport.post(_PATHS[kind], body, timeout)
                else:
                    reply, refused = reg, "registration"
        except OSError as exc:
            self._notices.unreachable(exc)
            self._backoff_s = self._cfg.retry_backoff_s
            return "failed"
        now = time.monotonic()
        verdict = _refusals.verdict(reply.status, leftover=leftover, window=self._auth, now=now)
        if verdict == "delivered":
            if kind == "registration":
                self._accepted.add(body)
                if body in self._own_registrations:
                    self._acknowledged(reply)
            return "delivered"
        retry_for: float | None = None  # what is left of the auth window
        self._backoff_s = self._cfg.retry_backoff_s
        if verdict == "retry" and reply.status in _refusals.AUTH and self._auth.since is not None:
            retry_for = self._auth.since + self._auth.retry_s - now
            self._backoff_s = max(self._backoff_s, min(_refusals.AUTH_BACKOFF_S, self._cfg.auth_retry_s))
        self._notices.refused(
            refused,
            reply,
            verdict,
            reason=_refusals.reason(reply),
            leftover=leftover,
            retry_for_s=retry_for,
            project_named="project" in self._registration_fields,
        )
        if verdict == "retry":
            return "failed"
        if refused == "registration" and reply.status == 409 and not leftover:
            self._refused_for_good = True
        if kind == "registration":
            return "set_aside"  # a refused registration is not kept (see _accepted); the log says why
        return self._set_aside(body, report, leftover=leftover, items=items)

    def _without_later_fields(self, body: bytes, reply: Reply, timeout: float) -> tuple[bytes, Reply]:
        """A registration refused only for fields the collector is older than, sent again without
        them (this process's later registrations too), and the collector's answer to that; the
        body and reply as they were for any other answer. Raises OSError as the transport does."""
        refused = _refusals.unknown_later_fields(reply)
        if not refused:
            return body, reply
        fields = json.loads(body)
        for section, name in refused:
            fields[section] = {k: v for k, v in fields[section].items() if k != name}
        stripped = _encode(fields)
        if body in self._own_registrations:
            self._registration_fields, self._registration = fields, stripped
            self._own_registrations.add(stripped)
        self._notices.older_collector([f"{section}.{name}" for section, name in refused])
        assert self._transport is not None
        return stripped, self._transport.post(_PATHS["registration"], stripped, timeout)

    def _acknowledged(self, reply: Reply) -> None:
        """The collector took this process's registration; note the project it filled in."""
        self._registered = True
        self._accepted.add(self._registration)
        self._notices.registered()
        if "project" in self._registration_fields:
            return
        try:
            project = json.loads(reply.body).get("project")
        except (ValueError, AttributeError):
            return
        if isinstance(project, str):
            self._registration_fields["project"] = project
            self._registration = _encode(self._registration_fields)
            self._own_registrations.add(self._registration)
            self._accepted.add(self._registration)

    def _set_aside(self, line: bytes, report: DeliveryReport, *, leftover: bool, items: int | None) -> _Outcome:
        """items: the batch's queue items, counted as dropped when the quarantine file cannot take
        it; None for an earlier process's batch, which then counts its wire records."""
        registration = (self._leftover_registration or self._registration) if leftover else self._registration
        header = registration if registration in self._accepted else None
        try:
            if self._quarantine.add(line, registration=header):
                return "set_aside"
            reason = QUARANTINE_FULL
            self._notices.file_full(self._quarantine.path, self._quarantine.max_bytes)
        except OSError as exc:
            reason = QUARANTINE_ERROR
            self._notices.cannot_write(self._quarantine.path, exc)
        n = _wire_records(line) if items is None else items
        report.dropped[reason] += n
        self._notices.dropped(reason, n)
        return "set_aside"

    def _failed(self, report: DeliveryReport) -> None:
        report.failed_attempts += 1
        self._next_attempt = time.monotonic() + self._backoff_s

    @staticmethod
    def _count(kind: MessageKind, outcome: _Outcome, records: int, report: DeliveryReport) -> None:
        if kind != "batch":
            return
        if outcome == "set_aside":
            report.rejected_batches += 1
        elif outcome == "delivered":
            report.delivered_batches += 1
            report.delivered_records += records

    # ------------------------------------------------------------------ the spool

    def _keep(self, batches: Sequence[EncodedBatch], report: DeliveryReport) -> None:
        """Batches that cannot be delivered now: to the spool, else into memory, in seq order
        (every spool line is older than every batch held in memory)."""
        reason = self._spill_held()
        for batch in batches:
            if not self._held:
                reason = self._to_spool(batch)
            if reason is not None:
                self._hold(batch, reason, report)
        self._in_hand = 0

    def _spill_held(self) -> str | None:
        """Move batches kept in memory to the spool, oldest first, while it takes them; the
        reason it does not, if it does not take them all."""
        while self._held:
            held = self._held[0]
            reason = self._to_spool(held.batch)
            if reason is not None:
                return reason
            self._held.popleft()
            self._held_bytes -= len(held.batch.body)
        return None

    def _to_spool(self, batch: EncodedBatch) -> str | None:
        """Append one batch; None when it is on disk, else the drop reason should it be lost."""
        line = batch.body
        if self._spool.empty():
            # A spool file always starts with the registration: on its own it is replayable, and
            # its first line is known to be the registration. Written with the batch in one
            # append: one fsync instead of two.
            line = self._registration + b"\n" + line
            self._leftover_end = 0
        try:
            if not self._spool.append(line):
                self._notices.file_full(self._spool.path, self._spool.max_bytes)
                return SPOOL_FULL
        except OSError as exc:
            self._notices.cannot_write(self._spool.path, exc)
            return SPOOL_ERROR
        self._spooled.append(_Spooled(batch.records, batch.items))
        return None

    def _hold(self, batch: EncodedBatch, reason: str, report: DeliveryReport) -> None:
        if self._held_bytes + len(batch.body) > self._hold_max_bytes:
            # Nowhere to keep it: the newest goes, as when the spool is full. (A batch of the
            # processor's 'dropped' event alone has no items: the next event says it all again.)
            if batch.items:
                report.dropped[reason] += batch.items
                self._notices.dropped(reason, batch.items)
            return
        self._held.append(_Held(batch, reason))
        self._held_bytes += len(batch.body)

    def _drain(self, deadline: float, report: DeliveryReport) -> None:
        """Waiting messages to the collector, oldest first (the spool, then the batches held in
        memory), until done, failing or out of time."""
        for item in self._spool.pending():
            leftover = item.end <= self._leftover_end
            ours = self._spooled[0] if not leftover and not item.first and self._spooled else None
            # The spool's structure says what a line is: its first line is the registration.
            kind: MessageKind = "registration" if item.first else "batch"
            outcome: _Outcome | None
            if kind == "registration":
                if item.line in self._accepted:
                    outcome = "delivered"  # once per process is enough
                else:
                    outcome = self._send(kind, item.line, deadline, report, leftover=leftover)
                    self._leftover_refused = leftover and outcome == "set_aside"
            elif leftover and self._leftover_refused:
                outcome = self._set_aside(item.line, report, leftover=True, items=None)
            else:
                items = ours.items if ours else None
                outcome = self._send_batch(item.line, deadline, report, leftover=leftover, items=items)
            if outcome is None:
                return
            if outcome == "failed":
                self._failed(report)
                return
            if ours:
                self._spooled.popleft()
            self._count(kind, outcome, ours.records if ours else 0, report)
            self._spool.mark_delivered(item.end)
        while self._held:
            held = self._held[0]
            outcome = self._send_batch(held.batch.body, deadline, report, leftover=False, items=held.batch.items)
            if outcome is None:
                return
            if outcome == "failed":
                self._failed(report)
                return
            self._held.popleft()
            self._held_bytes -= len(held.batch.body)
            self._count("batch", outcome, held.batch.records, report)

    def _record(self, batches: Sequence[EncodedBatch]) -> None:
        """A copy of every batch for the user (record_file); its failure costs the copy only."""
        assert self._record_path is not None
        try:
            new = not self._record_path.exists()
            self._record_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self._record_path, "ab") as fh:
                if new:
                    fh.write(self._registration + b"\n")
                for batch in batches:
                    fh.write(batch.body + b"\n")
        except OSError as exc:
            self._notices.cannot_write(self._record_path, exc)


def _wire_records(line: bytes) -> int:
    """Records in an encoded batch (an earlier process's, whose queue items are unknown)."""
    try:
        records = json.loads(line).get("records")
    except (ValueError, AttributeError):
        return 0
    return len(records) if isinstance(records, list) else 0


def spooling_exporter(
    *,
    config: AgentConfig,
    run: str,
    rank: int,
    incarnation: int,
    registration: JsonObject,
    transport: Transport | None = None,
    errors: ErrorBudget | None = None,
    hold_max_bytes: int = HOLD_MAX_BYTES,
) -> BatchProcessor:
    """The agent's exporter: a BatchProcessor delivering through a SpoolingDelivery.

    The registration it sends names `incarnation`, the one its batches carry: when the collector
    refuses the registration (another job under this run id), it refuses those batches too, so none
    of this process's steps join the other job's history (docs/wire-format.md, "Run ids")."""
    errors = errors or ErrorBudget(config.log_every_s)
    registration = {**registration, "incarnation": incarnation}
    delivery = SpoolingDelivery(
        config=config,
        run=run,
        rank=rank,
        registration=registration,
        transport=transport,
        errors=errors,
        hold_max_bytes=hold_max_bytes,
    )
    return BatchProcessor(
        config=config,
        run=run,
        rank=rank,
        incarnation=incarnation,
        delivery=delivery,
        errors=errors,
        world_size=world_size_of(registration),
    )


def world_size_of(registration: JsonObject) -> int:
    """The job's size as the registration declares it (1 when it does not)."""
    return int(registration.get("parallelism", {}).get("world_size") or 1)
