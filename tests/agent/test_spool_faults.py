"""The agent never loses data silently (issue 15, item 1): a spool it cannot write, a spool on a
full disk (a file-size limit in a child process), torn spool lines, drop counts by reason that
reach the collector and the end-of-run message, and logs that never hide a new kind of error.

Real collector (uvicorn in a thread, SQLite and PostgreSQL), real sockets, real files; the
RLIMIT_FSIZE case runs in its own process (the limit applies to the whole process).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from trainvitals.agent import AgentConfig
from trainvitals.agent._delivery import spooling_exporter
from trainvitals.agent._guard import ErrorBudget
from trainvitals.agent._processor import DROP_REASONS, BatchProcessor
from trainvitals.agent._refusals import without_absent_later_fields
from trainvitals.agent._spool import Spool
from trainvitals.service.store import db
from trainvitals.service.store.models import EventRow, StepRow
from trainvitals.wire import RunRegistration

# As attach sends it: the later fields it has no value for left out (agent/_refusals.py).
REG = without_absent_later_fields(RunRegistration(run="r1", parallelism={"world_size": 1}).model_dump(mode="json"))
CHILD = Path(__file__).parent / "fault_scripts" / "spool_fsize_child.py"
NO_DROPS = dict.fromkeys(DROP_REASONS, 0)


def _exporter(url: str, spill_dir: Path, *, hold_max_bytes: int = 64 << 20, **cfg: object) -> BatchProcessor:
    settings: dict = {"http_timeout_s": 2.0, "retry_backoff_s": 0.0, "max_batch_records": 10, **cfg}
    config = AgentConfig(collector=url, spill_dir=str(spill_dir), **settings)
    return spooling_exporter(
        config=config, run="r1", rank=0, incarnation=1, registration=REG, hold_max_bytes=hold_max_bytes
    )


def _steps(exp: BatchProcessor, steps: range) -> None:
    for i in steps:
        exp.emit({"kind": "step", "step": i, "ts": 1.0, "step_seconds": 0.1})


def _stored(db_url: str, run: str = "r1") -> tuple[list[int], list[tuple[str, str | None, dict[str, str]]]]:
    """The run's stored steps, and its events other than start/stop."""
    engine = db.make_engine(db_url)
    with engine.connect() as conn:
        steps = [r[0] for r in conn.execute(select(StepRow.step).where(StepRow.run_id == run).order_by(StepRow.step))]
        events = [
            (r.event, r.detail, r.domains)
            for r in conn.execute(select(EventRow).where(EventRow.run_id == run).order_by(EventRow.id))
        ]
    engine.dispose()
    return steps, events


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trainvitals.agent" and r.levelno == logging.WARNING]


@pytest.fixture
def unwritable(tmp_path: Path) -> Path:
    """A spill directory no one can create or write, root included: its parent is a file."""
    (tmp_path / "a-file").write_text("not a directory")
    return tmp_path / "a-file" / "spool"


# --------------------------------------------------------------------------- an unwritable spool


def test_an_unwritable_spool_loses_nothing_to_a_healthy_collector(
    collector, unwritable: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The attack run's case (a): 2,000 records, spool directory unwritable, collector healthy.
    Before: 0 delivered, no drop counted. The last pass writes ahead, fails, and sends from memory."""
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    exp = _exporter(collector.url, unwritable, max_batch_records=100)
    for chunk in range(9):
        _steps(exp, range(chunk * 200, chunk * 200 + 200))
        exp.run_once(deadline=time.monotonic() + 10)
    _steps(exp, range(1800, 2000))
    exp.shutdown(timeout=10)  # the last pass: write-ahead, which fails here
    assert _stored(collector.db_url) == (list(range(2000)), [])
    assert exp.stats.delivered_records == 2000 and exp.stats.dropped == NO_DROPS
    said = _warnings(caplog)
    assert len(said) == 1 and said[0].startswith(f"trainvitals agent: cannot write {unwritable / 'r1.rank0.jsonl'}")
    assert "NotADirectoryError" in said[0] and "TRAINVITALS_SPILL_DIR" in said[0]


def test_an_unwritable_spool_holds_batches_in_memory_through_an_outage_and_counts_what_did_not_fit(
    collector, unwritable: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    # Batches of 10 steps are 636-656 bytes: 3 fit in 2,300 bytes of memory, a 4th does not.
    exp = _exporter(collector.url, unwritable, hold_max_bytes=2300)
    _steps(exp, range(0, 10))
    exp.run_once(deadline=time.monotonic() + 10)
    collector.stop()
    for b in range(1, 7):  # steps 10-69 while the collector is down: 3 held, 3 dropped (the newest)
        _steps(exp, range(b * 10, b * 10 + 10))
        exp.run_once(deadline=time.monotonic() + 10)
    assert exp.stats.dropped == {**NO_DROPS, "spool_error": 30}
    collector.start()
    _steps(exp, range(70, 80))
    exp.run_once(deadline=time.monotonic() + 10)  # memory first, then the new batch and the event
    steps, events = _stored(collector.db_url)
    assert steps == list(range(40)) + list(range(70, 80))
    # Cumulative counts: the event queued after the first drop waited in memory with the batches;
    # the second (20) found no room; the third says all 30.
    assert events == [
        ("dropped", "records lost by this process so far: 10 spool_error", {"spool_error": "10"}),
        ("dropped", "records lost by this process so far: 30 spool_error", {"spool_error": "30"}),
    ]
    exp.shutdown(timeout=10)
    assert exp.stats.delivered_records == 50 + 2 and exp.stats.dropped == {**NO_DROPS, "spool_error": 30}
    said = _warnings(caplog)
    assert said[-1] == (
        "trainvitals agent: 30 record(s) of this process were lost and never reach the collector: 30 spool_error "
        "(the spool could not be written (the reason is above) and memory was full or the job ended first)"
    )
    assert any(s.startswith("trainvitals agent: dropped 10 record(s) (spool_error: ") for s in said)


def test_what_is_only_in_memory_at_exit_is_counted_and_said(unwritable: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No collector for the whole run and nowhere to spool: every record is lost, and counted."""
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    exp = _exporter("http://127.0.0.1:9", unwritable, hold_max_bytes=2300)  # nothing listens on port 9
    for b in range(5):
        _steps(exp, range(b * 10, b * 10 + 10))
        exp.run_once(deadline=time.monotonic() + 10)
    assert exp.stats.dropped == {**NO_DROPS, "spool_error": 20}  # 3 batches held, 2 did not fit
    exp.shutdown(timeout=1)
    assert exp.stats.dropped == {**NO_DROPS, "spool_error": 50} and exp.stats.delivered_records == 0
    assert _warnings(caplog)[-1].startswith("trainvitals agent: 50 record(s) of this process were lost")


def test_a_spool_directory_the_job_may_not_write_loses_only_what_is_counted(collector) -> None:
    """The attack run's case (a) with a real permission error: the spill directory is mode 0500,
    and a child running as root runs without the capabilities that let root past mode bits
    (setpriv drops them). Nothing reaches the disk; batches 0-2 wait in memory, 3-7 do not fit and
    are counted; back online, memory, then the new batch; the last pass's write-ahead fails and
    its 3 batches are sent from memory."""
    base = Path(tempfile.mkdtemp(prefix="tv-unwritable-"))
    try:
        spill = base / "spool"
        spill.mkdir(mode=0o500)
        out = _run_child(collector, spill, limit=0, hold=2300, as_root_without_dac=os.geteuid() == 0)
    finally:
        shutil.rmtree(base)
    assert out["phase1"] == {"spool": None, "dropped": {**NO_DROPS, "spool_error": 50}}
    assert out["stats"] == {
        "delivered_records": 70 + 2,  # the steps and two 'dropped' events (below)
        "delivered_batches": 4 + 2 + 3,  # memory (3 and an event), the new one and an event, the last 3
        "emitted_records": 120,
        "dropped": {**NO_DROPS, "spool_error": 50},
        "spool_left": False,
    }
    steps, events = _stored(collector.db_url, run="fsize")
    assert steps == list(range(30)) + list(range(80, 120))  # 70 delivered + 50 dropped = 120 emitted
    assert [e[2] for e in events] == [{"spool_error": "10"}, {"spool_error": "50"}]
    assert "(PermissionError: [Errno 13] Permission denied" in out["log"][1]
    assert "Fix: set TRAINVITALS_SPILL_DIR (AgentConfig.spill_dir) to a node-local directory" in out["log"][1]


def _run_child(collector, spill: Path, *, limit: int, hold: int, as_root_without_dac: bool = False) -> dict:
    """The child's three phases (fault_scripts/spool_fsize_child.py), the collector down for the
    first; its first report under "phase1", its last as it is."""
    collector.stop()
    setpriv = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if as_root_without_dac else []
    child = subprocess.Popen(
        [*setpriv, sys.executable, str(CHILD), collector.url, str(spill), str(limit), str(hold)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        collector.start()
        if not line:
            raise AssertionError(child.communicate(timeout=60)[1])
        out, err = child.communicate("go\n", timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    return {"phase1": json.loads(line), **json.loads(out)}


# --------------------------------------------------------------------------- a full disk (file-size limit)


def test_a_file_size_limit_cuts_no_line_and_loses_only_what_is_counted(collector, tmp_path: Path) -> None:
    """The attack run's case (b) in a child process with RLIMIT_FSIZE (SIGXFSZ ignored: EFBIG).

    The limit fits the registration and 2 batches: the 3rd batch's write stops part-way and is cut
    back, so the spool stays whole; batches 3-5 wait in memory (2,300 bytes: 3 batches), 6-8 are
    dropped and counted. Back online: 2 from the spool, 3 from memory, the new one, the event. The
    last pass writes 3 batches ahead: 2 fit, the 3rd is sent from memory."""
    spill = tmp_path / "spool"
    final = _run_child(collector, spill, limit=1700, hold=2300)
    registration, *batches, end = final["phase1"]["spool"]
    assert json.loads(registration)["run"] == "fsize" and end == ""  # every line whole
    assert [[r["step"] for r in json.loads(b)["records"]] for b in batches] == [list(range(0, 10)), list(range(10, 20))]
    assert final["phase1"]["dropped"] == {**NO_DROPS, "spool_error": 30}
    assert final["stats"] == {
        "delivered_records": 90 + 2,  # the steps and two 'dropped' events (below)
        "delivered_batches": 11,
        "emitted_records": 120,
        "dropped": {**NO_DROPS, "spool_error": 30},
        "spool_left": False,
    }
    steps, events = _stored(collector.db_url, run="fsize")
    assert steps == list(range(50)) + list(range(80, 120))  # 90 delivered + 30 dropped = 120 emitted
    assert events == [
        ("dropped", "records lost by this process so far: 10 spool_error", {"spool_error": "10"}),
        ("dropped", "records lost by this process so far: 30 spool_error", {"spool_error": "30"}),
    ]
    log = final["log"]
    assert log[0].startswith(f"trainvitals agent: cannot reach the collector at {collector.url}")
    assert log[1].startswith(f"trainvitals agent: cannot write {spill / 'fsize.rank0.jsonl'} (OSError: [Errno 27]")
    assert "raise the quota or file-size limit" in log[1]
    assert log[2].startswith("trainvitals agent: dropped 10 record(s) (spool_error: ")
    assert log[3].startswith("trainvitals agent: 30 record(s) of this process were lost") and len(log) == 4


# --------------------------------------------------------------------------- torn lines


def test_a_torn_tail_is_cut_on_the_next_start_and_the_rest_delivered(
    collector, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A process killed mid-append leaves half a line; before, the next batch was glued onto it and
    both were refused. Now the next process cuts it, says so, and delivers the whole lines."""
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    spill = tmp_path / "spool"
    collector.stop()
    first = _exporter(collector.url, spill)
    _steps(first, range(10))
    first.run_once(deadline=time.monotonic() + 10)  # collector down: spooled
    spool = spill / "r1.rank0.jsonl"
    whole = spool.stat().st_size
    with open(spool, "ab") as fh:
        fh.write(b'{"wire_version":1,"run":"r1","rank":0,"incarnation":1,"seq":1,"records":[{"kind":"st')
    collector.start()
    second = spooling_exporter(
        config=AgentConfig(collector=collector.url, spill_dir=str(spill), retry_backoff_s=0.0),
        run="r1",
        rank=0,
        incarnation=2,
        registration=REG,
    )
    assert spool.stat().st_size == whole
    _steps(second, range(10, 15))
    second.run_once(deadline=time.monotonic() + 10)
    assert _stored(collector.db_url)[0] == list(range(15))
    assert second.stats.rejected_batches == 0 and not spool.exists()
    cut = f"trainvitals agent: cut off a torn last line (84 bytes) of {spool}: an earlier process"
    assert [s for s in _warnings(caplog) if s.startswith(cut)]
    second.shutdown()


def test_an_append_after_a_torn_line_starts_a_new_line(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s.jsonl", max_bytes=1 << 20)
    assert spool.append(b'{"n": 0}')
    with open(spool.path, "ab") as fh:
        fh.write(b'{"n": 1')  # a torn line the open at start did not see (written since)
    assert spool.append(b'{"n": 2}')
    assert spool.path.read_bytes() == b'{"n": 0}\n{"n": 2}\n'


def test_the_cap_counts_only_undelivered_bytes_and_delivered_ones_are_cut_off(tmp_path: Path) -> None:
    """A spool never emptied (the collector takes some batches, then fails again) kept its
    delivered lines, and counted them against the cap: 400 bytes delivered of a 500-byte cap left
    room for 100 pending ones. The cap is on what waits; once the delivered part reaches the cap,
    the file is rewritten without it but its registration line, which replay needs."""
    spool = Spool(tmp_path / "s.jsonl", max_bytes=500)
    registration, batch = b'{"run": "r1"}', b'{"seq": 0, "x": "' + b"y" * 80 + b'"}'  # 14 and 100 bytes a line
    assert spool.append(registration)
    for _ in range(4):
        assert spool.append(batch)
    spool.mark_delivered(list(spool.pending())[3].end)  # the registration and 3 batches: 314 bytes
    for _ in range(4):  # 500 bytes pending: room for them, not for one more
        assert spool.append(batch)
    assert len(spool) == 500 and not spool.append(batch)
    spool.mark_delivered(list(spool.pending())[1].end)  # 514 bytes delivered: past the cap
    assert spool.append(batch)
    assert spool.path.read_bytes() == registration + b"\n" + (batch + b"\n") * 4
    assert [item.line for item in spool.pending()] == [batch] * 4 and len(spool) == 400


def test_a_spool_holding_only_a_torn_line_is_emptied(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(b'{"run": "r1", "paral')
    assert Spool(path, max_bytes=1 << 20).torn_bytes == 20 and path.read_bytes() == b""


# --------------------------------------------------------------------------- logs


def test_a_repeating_error_does_not_hide_a_new_kind(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    budget = ErrorBudget(log_every_s=60.0)
    for _ in range(3):
        budget.record("exporter", OSError("disk"))
    budget.record("exporter", ValueError("bad sample"))
    budget.record("hook", OSError("disk"))
    said = _warnings(caplog)
    assert budget.errors == 5 and len(said) == 3
    assert ["OSError: disk" in said[0], "ValueError: bad sample" in said[1], " in hook " in said[2]] == [True] * 3


def test_an_error_is_one_line_however_long_its_message(caplog: pytest.LogCaptureFixture) -> None:
    """torch's dispatcher errors (an op with no kernel for a tensor's backend) run to 10 KB and a
    hundred lines; the job's log gets their first line."""
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    budget = ErrorBudget(log_every_s=60.0)
    dispatcher = "Could not run 'aten::op' with the 'SparseCPU' backend.\n\n" + "CPU: x\n" * 500
    budget.record("grads", NotImplementedError(dispatcher))
    budget.record("hook", RuntimeError("y" * 5000))
    budget.record("exporter", KeyError())
    said = _warnings(caplog)
    assert said[0].endswith("NotImplementedError: Could not run 'aten::op' with the 'SparseCPU' backend.")
    assert "\n" not in said[1] and len(said[1]) < 450 and said[1].endswith("y...")
    assert said[2].endswith("training continues): KeyError")


def test_each_kind_of_spool_failure_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Unwritable, then full (spill_max_bytes): two lines, each once, however often each repeats."""
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    spill = tmp_path / "spool"
    spill.write_text("a file where the directory should be")
    exp = _exporter("http://127.0.0.1:9", spill, spill_max_bytes=1500, hold_max_bytes=0)
    for b in range(3):
        _steps(exp, range(b * 10, b * 10 + 10))
        exp.run_once(deadline=time.monotonic() + 10)
    spill.unlink()
    for b in range(3, 6):  # the first fits (registration + 1 batch < 1,500 bytes), then full
        _steps(exp, range(b * 10, b * 10 + 10))
        exp.run_once(deadline=time.monotonic() + 10)
    assert exp.stats.dropped == {**NO_DROPS, "spool_error": 30, "spool_full": 20}
    said = [s.split(": ", 1)[1] for s in _warnings(caplog)]
    assert [s.split(" (")[0] for s in said] == [
        "cannot reach the collector at http://127.0.0.1:9",
        f"cannot write {spill / 'r1.rank0.jsonl'}",
        "dropped 10 record(s)",
        f"{spill / 'r1.rank0.jsonl'} has reached spill_max_bytes",
        "dropped 10 record(s)",
    ]
    assert "spool_full" in said[4] and os.path.exists(spill / "r1.rank0.jsonl")
    exp.shutdown(timeout=0.5)


def test_the_agents_drop_reasons_are_the_ones_the_wire_names_for_the_collector() -> None:
    # The collector exports these reasons by name (and any other key as "other").
    from trainvitals.agent import _processor
    from trainvitals.wire.conventions import DROP_REASONS

    assert _processor.DROP_REASONS == DROP_REASONS
