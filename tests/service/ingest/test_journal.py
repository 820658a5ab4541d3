"""The ingest journal: its files, and the writer that acknowledges from it (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from tests.service.ingest.test_batch_writer import _count
from trainvitals.service.ingest import journal as journal_module
from trainvitals.service.ingest.batch_writer import BatchWriter
from trainvitals.service.ingest.journal import IngestJournal, JournalError
from trainvitals.service.ingest.journal_replay import replay_journal
from trainvitals.service.store import batches, run_keys
from trainvitals.service.store.models import DeliveredBatch, RefusedIncarnation, StepRow
from trainvitals.wire import Batch, BatchAck


def _batch(rank: int, seq: int, *, incarnation: int = 1) -> Batch:
    records = [{"kind": "step", "step": s, "ts": 100.0 + s, "step_seconds": 0.5} for s in (2 * seq, 2 * seq + 1)]
    return Batch.model_validate({"run": "r1", "rank": rank, "incarnation": incarnation, "seq": seq, "records": records})


def _body(batch: Batch) -> bytes:
    return batch.model_dump_json().encode()


def _segments(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("slot-*/*.seg"))


def test_entries_come_back_in_order_and_a_torn_last_one_is_dropped(tmp_path: Path) -> None:
    first = IngestJournal.open(tmp_path)
    first.append("proj", b'{"a": 1}')
    first.append(None, b'{"b": 2}')
    first.append("proj", b'{"c": 3}')
    segment = next((tmp_path / "slot-0").glob("*.seg"))
    # The process dies inside its last write: only part of that entry reached the file.
    segment.write_bytes(segment.read_bytes()[:-3])
    first.close()  # releases the slot, keeps the file (its entries were never committed)

    again = IngestJournal.open(tmp_path)
    assert again.slot == first.slot  # the free slot is taken again
    assert list(again.leftovers()) == [("proj", b'{"a": 1}'), (None, b'{"b": 2}')]
    again.forget_leftovers()
    assert _segments(tmp_path) == [f"{again._segment:08d}.seg"]  # only the new, empty segment
    again.close()
    assert _segments(tmp_path) == []  # empty and closed: deleted


def test_a_closed_segment_goes_once_each_of_its_batches_is_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_module, "SEGMENT_BYTES", 100)  # a new segment after every entry of 100 bytes
    journal = IngestJournal.open(tmp_path)
    seg_a = journal.append("p", b"x" * 100)
    seg_b = journal.append("p", b"y" * 100)
    seg_b2 = journal.append("p", b"z" * 10)
    assert seg_a < seg_b < seg_b2
    assert len(_segments(tmp_path)) == 3
    journal.committed([seg_b])  # closed and done: gone
    assert len(_segments(tmp_path)) == 2
    journal.committed([seg_b2])  # done but still the one being written: stays until closed
    assert len(_segments(tmp_path)) == 2
    journal.close()
    assert len(_segments(tmp_path)) == 1  # seg_a's batch never committed: kept for the next start
    assert [body for _, body in IngestJournal.open(tmp_path).leftovers()] == [b"x" * 100]


def test_processes_sharing_a_directory_take_slots_of_their_own(tmp_path: Path) -> None:
    one, two = IngestJournal.open(tmp_path), IngestJournal.open(tmp_path)  # two lock holders, as two processes
    assert (one.slot.name, two.slot.name) == ("slot-0", "slot-1")
    two.append("p", b"left by two")
    two.close()  # as if it died: its batch never committed
    one.close()  # a clean stop: nothing left
    # The next process takes the lowest free slot and replays slot-1 beside it, holding it meanwhile.
    three = IngestJournal.open(tmp_path)
    assert three.slot.name == "slot-0" and [b for _, b in three.leftovers()] == [b"left by two"]
    four = IngestJournal.open(tmp_path)  # starting meanwhile: both slots held, so a new one
    assert four.slot.name == "slot-2" and not list(four.leftovers())
    three.forget_leftovers()  # replayed: slot-1 is free again, and empty
    five = IngestJournal.open(tmp_path)
    assert five.slot.name == "slot-1" and not list(five.leftovers())
    for journal in (three, four, five):
        journal.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slot-0", "slot-1", "slot-2"]
    assert _segments(tmp_path) == []  # clean stops leave no files


def test_an_unusable_directory_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    problem = IngestJournal.problem(blocker / "journal")
    assert problem is not None and "TRAINVITALS_INGEST_JOURNAL_DIR" in problem and "\n" not in problem
    with pytest.raises(JournalError, match="not usable"):
        IngestJournal.open(blocker / "journal")


def test_a_known_runs_batch_is_acknowledged_from_the_journal_and_stored(sessions, tmp_path: Path) -> None:
    journal = IngestJournal.open(tmp_path)
    writer = BatchWriter(sessions, journal=journal)
    try:
        first = writer.submit(_batch(0, 0), project=None, body=_body(_batch(0, 0)))
        assert first.result(10) == BatchAck(accepted=2, duplicate=False)
        assert writer.journal_acks == 0  # a run this process has not stored yet: the database answers
        later = [writer.submit(_batch(0, seq), project=None, body=_body(_batch(0, seq))) for seq in range(1, 6)]
        assert all(f.done() for f in later)  # answered on submit, before any commit
        assert [f.result() for f in later] == [BatchAck(accepted=2, duplicate=False)] * 5
        assert writer.journal_acks == 5
        no_body = writer.submit(_batch(1, 0), project=None)  # another rank: its own key, not known yet
        assert no_body.result(10) == BatchAck(accepted=2, duplicate=False)
    finally:
        writer.stop()
        journal.close()
    assert _count(sessions, StepRow) == 14  # 6 batches of rank 0 and one of rank 1, 2 steps each
    assert _segments(tmp_path) == []  # every entry committed: nothing left to replay


def test_batches_acknowledged_from_the_journal_wait_for_a_fuller_group_until_one_that_waits_comes(
    sessions, tmp_path: Path
) -> None:
    """Nobody waits for the commit of batches acknowledged from the journal: the writer holds them
    (here for up to 30 s) for a fuller group instead of committing each as it comes, which without a
    group wait (group_wait_s 0, SQLite's default) it would. A batch that waits for its commit ends
    that wait: it is stored at once, in the same transaction as the ones held."""
    journal = IngestJournal.open(tmp_path)
    writer = BatchWriter(sessions, journal=journal, group_wait_s=0.0, journal_group_wait_s=30.0)
    try:
        assert writer.submit(_batch(0, 0), project=None, body=_body(_batch(0, 0))).result(10).accepted == 2
        assert writer.groups == 1
        for seq in range(1, 4):
            assert writer.submit(_batch(0, seq), project=None, body=_body(_batch(0, seq))).done()
            threading.Event().wait(0.1)
        threading.Event().wait(0.3)
        assert _count(sessions, StepRow) == 2 and writer.groups == 1  # held: none of the three committed
        waits = writer.submit(_batch(1, 0), project=None)  # another rank's first batch: answered after its commit
        assert waits.result(10) == BatchAck(accepted=2, duplicate=False)  # long before the 30 s
        assert writer.groups == 2  # the three held batches and this one, one transaction
    finally:
        writer.stop()
        journal.close()
    assert _count(sessions, StepRow) == 10 and _segments(tmp_path) == []


def test_batches_acknowledged_from_the_journal_are_written_once_the_flow_pauses_for_half_the_wait(
    sessions, tmp_path: Path
) -> None:
    """The fuller group is worth waiting for only while batches keep coming: when none comes within
    half the group wait (here 2 of 4 s) the held ones are written, as a lone batch at a low rate is,
    rather than held to the end of the wait (which delayed every step to screen by all of it)."""
    journal = IngestJournal.open(tmp_path)
    writer = BatchWriter(sessions, journal=journal, group_wait_s=0.0, journal_group_wait_s=4.0)
    try:
        assert writer.submit(_batch(0, 0), project=None, body=_body(_batch(0, 0))).result(10).accepted == 2
        submitted = time.monotonic()
        assert writer.submit(_batch(0, 1), project=None, body=_body(_batch(0, 1))).done()
        threading.Event().wait(1.0)
        assert _count(sessions, StepRow) == 2  # held for a fuller group: the next batch may still come
        while _count(sessions, StepRow) < 4 and time.monotonic() - submitted < 10:
            threading.Event().wait(0.05)
        written = time.monotonic() - submitted
        assert 1.9 < written < 3.5  # after the 2 s pause, well before the 4 s wait's end
    finally:
        writer.stop()
        journal.close()
    assert _segments(tmp_path) == []


def test_a_journaled_batch_survives_a_database_failure_and_is_stored_after_it(
    sessions, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The database fails the writer's transaction (a table renamed away); the batch acknowledged from
    the journal is written again every second until it is stored. Meanwhile nothing more is
    acknowledged before its commit, and a batch that waits for its commit is told of the failure."""
    journal = IngestJournal.open(tmp_path)
    writer = BatchWriter(sessions, journal=journal)
    try:
        assert writer.submit(_batch(0, 0), project=None, body=_body(_batch(0, 0))).result(10).accepted == 2
        with sessions() as s:
            s.execute(text("ALTER TABLE steps RENAME TO steps_away"))
            s.commit()
        caplog.set_level(logging.ERROR, "trainvitals.service.ingest.batch_writer")
        acked = writer.submit(_batch(0, 1), project=None, body=_body(_batch(0, 1)))
        assert acked.done() and acked.result() == BatchAck(accepted=2, duplicate=False)
        deadline = threading.Event()
        for _ in range(100):  # the writer tried and failed at least once
            if "storing batch run=r1 rank=0 incarnation=1 seq=1 failed" in caplog.text:
                break
            deadline.wait(0.05)
        else:
            raise AssertionError("the writer never tried the journaled batch")
        waits = writer.submit(_batch(0, 2), project=None, body=_body(_batch(0, 2)))
        assert not waits.done()  # the last group failed: this one waits for its commit
        with pytest.raises(Exception, match="steps"):
            waits.result(10)
        with sessions() as s:
            s.execute(text("ALTER TABLE steps_away RENAME TO steps"))
            s.commit()
        for _ in range(100):
            if _count(sessions, DeliveredBatch) == 2:
                break
            deadline.wait(0.05)
    finally:
        writer.stop()
        journal.close()
    assert _count(sessions, DeliveredBatch) == 2 and _count(sessions, StepRow) == 4  # seq 0 and the journaled seq 1
    assert _segments(tmp_path) == []


def test_a_journaled_batch_of_an_incarnation_fenced_meanwhile_is_counted_as_refused(
    sessions, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = IngestJournal.open(tmp_path)
    writer = BatchWriter(sessions, journal=journal)
    try:
        assert writer.submit(_batch(0, 0), project=None, body=_body(_batch(0, 0))).result(10).accepted == 2
        with sessions() as s:  # incarnation 1 is refused from now on (a restarted job's fence)
            fence = RefusedIncarnation(
                run_id=run_keys.key_for("a", "r1"), incarnation=1, refused_at=0.0, reason="newer"
            )
            s.add(fence)
            s.commit()
        acked = writer.submit(_batch(0, 1), project=None, body=_body(_batch(0, 1)))
        assert acked.result() == BatchAck(accepted=2, duplicate=False)  # it could not know yet
        for _ in range(200):  # written (and refused) by the writer
            if not writer.pending_records:
                break
            threading.Event().wait(0.05)
        # Stored nothing, and the next batch of that incarnation is answered by the database.
        refused = writer.submit(_batch(0, 2), project=None, body=_body(_batch(0, 2)))
        assert isinstance(refused.result(10), batches.RefusedIncarnationError)
    finally:
        writer.stop()
        journal.close()
    assert _count(sessions, DeliveredBatch) == 1
    assert "acknowledged from the ingest journal, was refused" in caplog.text


def test_leftovers_are_stored_at_start_and_then_deleted(sessions, tmp_path: Path) -> None:
    dead = IngestJournal.open(tmp_path)  # a process that acknowledged three batches and died
    for seq in range(3):
        dead.append(None, _body(_batch(2, seq)))
    dead.append(None, b'{"not": "a batch"}')  # a damaged entry is skipped, not fatal
    dead.close()

    journal = IngestJournal.open(tmp_path)
    writer = BatchWriter(sessions, journal=journal)
    writer.start()

    async def start() -> None:
        from trainvitals.service.api.routes.ingest import decode_body

        await replay_journal(journal, writer, decode_body)

    try:
        asyncio.run(start())
    finally:
        writer.stop()
        journal.close()
    assert _count(sessions, StepRow) == 6
    assert _segments(tmp_path) == []


def test_a_journal_that_cannot_be_written_leaves_batches_to_wait_for_their_commit(
    sessions, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    journal = IngestJournal.open(tmp_path)
    writer = BatchWriter(sessions, journal=journal)

    def disk_full(project: str | None, body: bytes) -> int:
        raise OSError(28, "No space left on device")

    try:
        assert writer.submit(_batch(0, 0), project=None, body=_body(_batch(0, 0))).result(10).accepted == 2
        monkeypatch.setattr(journal, "append", disk_full)  # the real file system's refusal, without filling a disk
        answers = [writer.submit(_batch(0, seq), project=None, body=_body(_batch(0, seq))) for seq in (1, 2)]
        assert [f.result(10) for f in answers] == [BatchAck(accepted=2, duplicate=False)] * 2  # after their commits
        assert writer.journal_acks == 0
    finally:
        writer.stop()
        journal.close()
    assert caplog.text.count("No space left on device") == 1  # said once, not once a batch
    assert _count(sessions, StepRow) == 6


def test_the_memory_of_stored_runs_is_bounded(sessions, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank's process is an incarnation: a long-lived collector forgets them past a bound, and a
    forgotten one's next batch is answered after its commit again (then journaled as before)."""
    from trainvitals.service.ingest import batch_writer

    monkeypatch.setattr(batch_writer, "_STORED_KEYS_MAX", 2)
    journal = IngestJournal.open(tmp_path)
    writer = BatchWriter(sessions, journal=journal)
    try:
        for incarnation in (1, 2, 3):  # the third forgets the first two
            first = _batch(0, 0, incarnation=incarnation)
            assert writer.submit(first, project=None, body=_body(first)).result(10).accepted == 2
        assert writer.journal_acks == 0
        again = _batch(0, 1, incarnation=1)
        assert writer.submit(again, project=None, body=_body(again)).result(10).accepted == 2
        assert writer.journal_acks == 0  # forgotten: it waited for its commit
        latest = _batch(0, 1, incarnation=3)
        assert writer.submit(latest, project=None, body=_body(latest)).done()  # remembered: journaled
        assert writer.journal_acks == 1
    finally:
        writer.stop()
        journal.close()
    assert _count(sessions, StepRow) == 10


def test_a_journaled_batch_no_retry_can_store_is_refused_and_the_others_are_stored(
    sessions, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A failure that is neither a value the database refuses nor the database being down (here a
    fault put into the real store for one batch) must not come back for ever, nor hold the batches
    queued beside it."""
    import sqlalchemy.exc

    from trainvitals.service.ingest import batch_writer

    monkeypatch.setattr(batch_writer, "_MAX_ATTEMPTS", 3)
    monkeypatch.setattr(batch_writer, "_RETRY_S", 0.05)
    real_store = batches.store_batches

    def store(session, items, **kwargs):
        if any(batch.seq == 2 for batch, _ in items):
            raise sqlalchemy.exc.ProgrammingError("INSERT ...", {}, Exception("a fault only batch 2 meets"))
        return real_store(session, items, **kwargs)

    monkeypatch.setattr(batches, "store_batches", store)
    journal = IngestJournal.open(tmp_path)
    writer = BatchWriter(sessions, journal=journal)
    try:
        assert writer.submit(_batch(0, 0), project=None, body=_body(_batch(0, 0))).result(10).accepted == 2
        acked = [writer.submit(_batch(0, seq), project=None, body=_body(_batch(0, seq))) for seq in (1, 2, 3)]
        assert all(f.done() for f in acked)
        for _ in range(200):
            if not writer.pending_records:
                break
            threading.Event().wait(0.05)
    finally:
        writer.stop()
        journal.close()
    assert _count(sessions, DeliveredBatch) == 3  # seq 0, 1 and 3; seq 2 refused after 3 attempts
    assert "seq=2, acknowledged from the ingest journal, was refused" in caplog.text
    assert _segments(tmp_path) == []
