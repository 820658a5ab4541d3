"""Replay of the ingest journal at start: what earlier processes acknowledged and may not have stored."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from trainvitals.service.ingest.batch_writer import BatchWriter, WriterBusyError
from trainvitals.service.ingest.journal import IngestJournal
from trainvitals.service.store.batches import AnyBatch

log = logging.getLogger(__name__)


async def replay_journal(journal: IngestJournal, writer: BatchWriter, decode: Callable[[bytes], AnyBatch]) -> None:
    """Store every batch the journal's leftovers hold (the database ignores those it has: their
    idempotency keys), then delete them. On a database failure they stay, for the next start."""
    files = journal.leftover_count
    if not files:
        return
    waiting: list[asyncio.Future[object]] = []  # each batch's answer (an outcome, or the database's failure)
    replayed = undecodable = 0
    try:
        for project, body in journal.leftovers():
            try:
                batch = decode(body)
            except Exception:  # noqa: BLE001 - accepted once, so only a damaged file decodes badly
                undecodable += 1
                continue
            while True:
                try:
                    waiting.append(asyncio.wrap_future(writer.submit(batch, project=project)))  # type: ignore[arg-type]
                    break
                except WriterBusyError:  # the backlog is full: let what is queued commit first
                    await asyncio.gather(*waiting)
                    waiting.clear()
            replayed += 1
        await asyncio.gather(*waiting)
    except Exception as exc:  # noqa: BLE001 - the database failed: keep the files for the next start
        log.error("ingest journal: replaying %s failed (%s); kept for the next start", journal.slot, exc)
        return
    journal.forget_leftovers()
    log.info(
        "ingest journal: %d batch(es) replayed from %d file(s)%s",
        replayed, files, f", {undecodable} damaged entries skipped" if undecodable else "",
    )  # fmt: skip
