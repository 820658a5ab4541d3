"""Delivery of encoded batches to the collector: the network first, the spool when it fails.

While the collector keeps up, a batch goes from memory to the collector and never touches the
disk. A batch that cannot be sent now (the collector is down, slow or answering 5xx, the retry
backoff is running, or older batches are still waiting) is appended to the per-rank spool file
and delivered from there, oldest first, by a later pass or by the next process of the same rank
(or with `trainvitals replay` on the file); the collector's idempotency on
(run, rank, incarnation, seq) drops anything delivered twice. When the process is about to end
(the last pass), every batch is written to the spool before anything is sent. Why not every
batch ahead of sending: docs/agent.md, "Spool".

A message the collector refuses for good (agent/_refusals.py: malformed, another project's run,
or an auth refusal that outlasted its retry window) is moved to the quarantine file next to the
spool, so that delivery in order never lets one refusal hold back later data; what the user is
told about it is agent/_notices.py. Every batch is also appended to `record_file` when one is set.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from trainvitals.agent import _refusals
from trainvitals.agent._config import AgentConfig
from trainvitals.agent._guard import ErrorBudget
from trainvitals.agent._notices import Notices
from trainvitals.agent._processor import BatchProcessor, DeliveryReport, EncodedBatch
from trainvitals.agent._spool import Quarantine, Spool, spool_path
from trainvitals.agent._transport import HttpTransport, Reply, Transport
from trainvitals.wire.builders import JsonObject

MessageKind = Literal["registration", "batch"]
_PATHS: dict[MessageKind, str] = {"registration": "/v1/runs", "batch": "/v1/batches"}

_Outcome = Literal["delivered", "set_aside", "failed"]


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
            retry_backoff_s=config.retry_backoff_s,
        )
        self._record_path = Path(config.record_file.replace("{rank}", str(rank))) if config.record_file else None
        self._next_attempt = 0.0
        self._backoff_s = config.retry_backoff_s  # after the latest failure
        self._registered = False  # the collector acknowledged this process's registration
        # The collector refused this process's registration for good (409: another project's run, or
        # another job's): it refuses its batches too, so they are set aside without asking again.
        self._refused_for_good = False
        # Record counts of the batches this process spooled, oldest first; lines that an earlier
        # process left (the first `_leftover_end` bytes of the file) are not this process's records.
        self._spooled_records: deque[int] = deque()
        self._leftover_end = len(self._spool)
        # An earlier process's lines travel under its own registration: if the collector refuses
        # that for good, they are set aside with it rather than stored under this process's.
        self._leftover_registration = self._spool.first_line() if self._leftover_end else None
        self._leftover_refused = False

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
            outcome = self._send_batch(batch.body, deadline, report, leftover=False)
            if outcome is None or outcome == "failed":
                # Out of time or failed: this batch and the ones after it wait in the spool.
                if outcome == "failed":
                    self._failed(report)
                self._to_spool(batches[i:], report)
                break
            self._count("batch", outcome, batch.records, report)
        return report

    def undelivered(self) -> bool:
        return len(self._spool) > 0

    def exit_wait(self, seconds: float, queued_batches: int) -> None:
        try:
            self._notices.exit_wait(seconds, queued_batches + self._spool.pending_batches())
        except OSError as exc:
            self._errors.record("exit_wait", exc)

    def exit_report(self) -> None:
        if self._transport is None:
            return  # sending is off (collector ""): the spool is the output
        try:
            self._notices.exit_report(waiting=self._spool.pending_batches(), set_aside=self._quarantine.batches)
        except OSError as exc:
            self._errors.record("exit_report", exc)

    def close(self) -> None:
        close = getattr(self._transport, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ sending

    def _send_batch(self, body: bytes, deadline: float, report: DeliveryReport, *, leftover: bool) -> _Outcome | None:
        """One batch, preceded by this process's registration while the collector has not
        acknowledged it (an earlier process's batches follow their own, from the spool); None
        when out of time before trying."""
        if not leftover and self._refused_for_good:
            return self._set_aside(body, report, leftover=False)
        if not leftover and not self._registered:
            outcome = self._send("registration", self._registration, deadline, report, leftover=False)
            if outcome is None or outcome == "failed":
                return outcome
        return self._send("batch", body, deadline, report, leftover=leftover)

    def _send(
        self, kind: MessageKind, body: bytes, deadline: float, report: DeliveryReport, *, leftover: bool
    ) -> _Outcome | None:
        assert self._transport is not None
        timeout = min(self._cfg.http_timeout_s, deadline - time.monotonic())
        if timeout <= 0:
            return None
        refused: MessageKind = kind
        try:
            reply = self._transport.post(_PATHS[kind], body, timeout)
            if reply.status == 409 and kind == "batch":
                # The collector does not know the run (a fresh database, or its registration was
                # refused): register, then try the batch once more.
                reg = self._transport.post(_PATHS["registration"], self._registration, timeout)
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
        return self._set_aside(body, report, leftover=leftover)

    def _acknowledged(self, reply: Reply) -> None:
        """The collector took this process's registration; note the project it filled in."""
        self._registered = True
        self._accepted.add(self._registration)
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

    def _set_aside(self, line: bytes, report: DeliveryReport, *, leftover: bool) -> _Outcome:
        registration = (self._leftover_registration or self._registration) if leftover else self._registration
        header = registration if registration in self._accepted else None
        if not self._quarantine.add(line, registration=header):
            report.spool_dropped_batches += 1
            self._errors.record("quarantine", OSError(f"quarantine {self._quarantine.path} full; batch dropped"))
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
            leftover = item.end <= self._leftover_end
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
                outcome = self._set_aside(item.line, report, leftover=True)
            else:
                outcome = self._send_batch(item.line, deadline, report, leftover=leftover)
            if outcome is None:
                return
            if outcome == "failed":
                self._failed(report)
                return
            ours = kind == "batch" and not leftover and bool(self._spooled_records)
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
    """The agent's exporter: a BatchProcessor delivering through a SpoolingDelivery.

    The registration it sends names `incarnation`, the one its batches carry: when the collector
    refuses the registration (another job under this run id), it refuses those batches too, so none
    of this process's steps join the other job's history (docs/wire-format.md, "Run ids")."""
    errors = errors or ErrorBudget(config.log_every_s)
    registration = {**registration, "incarnation": incarnation}
    delivery = SpoolingDelivery(
        config=config, run=run, rank=rank, registration=registration, transport=transport, errors=errors
    )
    return BatchProcessor(
        config=config, run=run, rank=rank, incarnation=incarnation, delivery=delivery, errors=errors
    )
