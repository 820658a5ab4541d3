"""Checkpoint generations: started / persisted / failed, stall and persist times, size, checksum."""

import hashlib
import logging
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from torch import nn

import trainvitals.agent as tv
from trainvitals.agent._checkpoints import content_digest
from trainvitals.wire import Batch


def _agent(tmp_path: Path) -> tuple[tv.Agent, nn.Module]:
    model = nn.Linear(4, 4)
    agent = tv.attach(
        model,
        None,
        run="ck",
        config=tv.AgentConfig(
            collector="", spill_dir=str(tmp_path / "spool"), record_file=str(tmp_path / "rec.jsonl")
        ),
    )
    assert isinstance(agent, tv.Agent)
    return agent, model


def _checkpoint_records(tmp_path: Path) -> list:
    lines = (tmp_path / "rec.jsonl").read_bytes().splitlines()[1:]
    return [r for line in lines for r in Batch.model_validate_json(line).records if r.kind == "checkpoint"]


def test_save_records_started_then_persisted_with_size_and_checksum(tmp_path: Path) -> None:
    agent, model = _agent(tmp_path)
    path = tmp_path / "gen7.pt"
    agent.save(model.state_dict(), str(path), step=7)
    agent.close()
    started, persisted = _checkpoint_records(tmp_path)
    assert (started.status, persisted.status) == ("started", "persisted")
    assert persisted.step == persisted.generation == 7
    assert persisted.bytes == path.stat().st_size
    assert persisted.checksum == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    assert persisted.stall_seconds is not None and persisted.stall_seconds >= 0


def test_failed_save_is_recorded_and_the_jobs_exception_propagates(tmp_path: Path) -> None:
    agent, _ = _agent(tmp_path)
    with pytest.raises(OSError, match="disk full"), agent.checkpoint(step=3, path=str(tmp_path / "x")):
        raise OSError("disk full")
    agent.close()
    statuses = [(r.status, r.error) for r in _checkpoint_records(tmp_path)]
    assert statuses[0] == ("started", None)
    assert statuses[1][0] == "failed" and "disk full" in statuses[1][1]


def test_async_save_persists_when_its_future_completes(tmp_path: Path) -> None:
    agent, _ = _agent(tmp_path)
    fut: Future[None] = Future()
    with agent.checkpoint(step=5, path=None) as ck:
        ck.track(fut)
    time.sleep(0.05)
    fut.set_result(None)
    agent.close()
    rec = _checkpoint_records(tmp_path)
    assert [r.status for r in rec] == ["started", "persisted"]
    assert rec[1].persist_seconds >= 0.05 > rec[1].stall_seconds


def test_close_waits_for_an_async_save_still_writing(tmp_path: Path) -> None:
    """A job that closes the agent right after its last async save (dcp.async_save, Lightning's
    AsyncCheckpointIO) lost that generation's persisted record: close() shut the checksum pool
    while the write went on, and the write's end raised 'cannot schedule new futures after shutdown'."""
    from concurrent.futures import ThreadPoolExecutor

    agent, model = _agent(tmp_path)
    path = tmp_path / "last.pt"

    def write() -> None:
        time.sleep(0.3)
        torch.save(model.state_dict(), path)

    with ThreadPoolExecutor(1) as writer:
        with agent.checkpoint(step=9, path=path) as ck:
            ck.track(writer.submit(write))
        agent.close()
    rec = _checkpoint_records(tmp_path)
    assert [r.status for r in rec] == ["started", "persisted"]
    assert rec[1].bytes == path.stat().st_size and rec[1].checksum is not None
    assert rec[1].persist_seconds >= 0.3 > rec[1].stall_seconds


def test_dcp_save_directory_checksum_and_after_the_fact_record(tmp_path: Path) -> None:
    agent, model = _agent(tmp_path)
    ckpt = tmp_path / "dcp-10"
    agent.dcp_save({"model": model.state_dict()}, checkpoint_id=str(ckpt), step=10)
    agent.checkpoint_saved(step=20, path=str(ckpt))
    agent.close()
    rec = _checkpoint_records(tmp_path)
    size, digest = content_digest(ckpt)
    assert [(r.step, r.status) for r in rec] == [(10, "started"), (10, "persisted"), (20, "persisted"), (10, "deleted")]
    assert rec[1].bytes == size and rec[1].checksum == digest and size > 0


def test_resume_is_an_event_and_sets_the_step(tmp_path: Path) -> None:
    agent, _ = _agent(tmp_path)
    agent.step(loss=1.0)
    agent.step(loss=1.0)
    agent.loaded(step=100, path="/ckpt/100")
    agent.step(loss=1.0)
    agent.step(loss=1.0, step=50)  # the counter going down is a resume too
    agent.close()
    lines = (tmp_path / "rec.jsonl").read_bytes().splitlines()[1:]
    records = [r for line in lines for r in Batch.model_validate_json(line).records]
    assert [r.step for r in records if r.kind == "step"] == [0, 1, 101, 50]
    resumes = [r for r in records if r.kind == "event" and r.event == "resume"]
    assert [r.step for r in resumes] == [100, 50]


def test_a_save_without_a_step_is_the_last_steps_and_resuming_from_it_leaves_no_gap(tmp_path: Path) -> None:
    """A save's step defaulted to the next step's number, and loaded(step=...) continues at step + 1:
    a save and a resume from it skipped a step (the resumed run had no record of it, and the crashed
    incarnation's stayed), and rollback passed over a clean save made right before an onset."""
    agent, model = _agent(tmp_path)
    for _ in range(3):
        agent.step(loss=1.0)  # steps 0, 1, 2
    agent.save(model.state_dict(), str(tmp_path / "a.pt"))  # holds step 2's update
    agent.checkpoint_saved(path=str(tmp_path / "a.pt"))
    with agent.checkpoint(path=str(tmp_path / "a.pt")):
        pass
    agent.loaded(step=2)  # the relaunched job loads it and trains on
    agent.step(loss=1.0)
    agent.close()
    lines = (tmp_path / "rec.jsonl").read_bytes().splitlines()[1:]
    records = [r for line in lines for r in Batch.model_validate_json(line).records]
    assert {(r.step, r.generation) for r in records if r.kind == "checkpoint"} == {(2, 2)}
    assert [r.step for r in records if r.kind == "step"] == [0, 1, 2, 3]


def test_a_pathlib_path_is_recorded_like_its_string(tmp_path: Path) -> None:
    """`agent.checkpoint(path=ckpt_dir / "model.pt")`: a pathlib.Path could not be JSON-encoded, so
    each record of the generation was lost with an agent error and the save went unrecorded."""
    agent, model = _agent(tmp_path)
    first, second = tmp_path / "a.pt", tmp_path / "b.pt"
    with agent.checkpoint(step=1, path=first):
        torch.save(model.state_dict(), first)
    agent.save(model.state_dict(), second, step=2)
    agent.checkpoint_saved(step=3, path=second)
    agent.loaded(step=3, path=second)
    agent.close()
    assert agent.stats()["errors"] == 0
    # A generation's persisted record comes from the background thread that reads its size: by step.
    rec = sorted(_checkpoint_records(tmp_path), key=lambda r: (r.step, r.status != "started"))
    assert [(r.step, r.status, r.path) for r in rec] == [
        (1, "started", str(first)), (1, "persisted", str(first)),
        (2, "started", str(second)), (2, "persisted", str(second)),
        (2, "deleted", str(second)),  # the same path holds generation 3 now
        (3, "persisted", str(second)),
    ]  # fmt: skip
    assert rec[1].bytes == first.stat().st_size and rec[5].bytes == second.stat().st_size


def test_a_relative_path_is_recorded_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's default output_dir is relative: the rollback query named "out/checkpoint-8", which
    says nothing to someone outside the job's working directory."""
    agent, model = _agent(tmp_path)
    monkeypatch.chdir(tmp_path)
    agent.save(model.state_dict(), "rel.pt", step=1)
    agent.checkpoint_saved(step=2, path="s3://bucket/run/step-2")
    agent.close()
    assert {r.path for r in _checkpoint_records(tmp_path)} == {str(tmp_path / "rel.pt"), "s3://bucket/run/step-2"}


def _deleted(tmp_path: Path) -> dict[int, str]:
    return {r.generation: r.error for r in _checkpoint_records(tmp_path) if r.status == "deleted"}


def test_saves_the_jobs_retention_removes_are_recorded_deleted_once(tmp_path: Path) -> None:
    """HF's save_total_limit, Lightning's save_top_k and a keep_last of the job's own remove old
    saves after newer ones: the rollback query named such a generation, whose files were gone. Each
    is recorded once more, as deleted, at the next save or at close(). A generation recorded at two
    paths (Lightning's last.ckpt beside its step file) is gone when both are: last.ckpt is
    overwritten by the next save, the step file removed by the retention."""
    agent, model = _agent(tmp_path)
    last = tmp_path / "last.pt"
    kept: list[Path] = []
    for step in (10, 20, 30, 40):
        path = tmp_path / f"step-{step}.pt"
        agent.save(model.state_dict(), path, step=step)
        torch.save(model.state_dict(), last)
        agent.checkpoint_saved(step=step, path=last)
        kept.append(path)
        if len(kept) > 2:  # keep_last=2, as HF rotates: after the newer one is written
            kept.pop(0).unlink()
    agent.close()
    deleted = _deleted(tmp_path)
    assert sorted(deleted) == [10, 20]
    # Named by the path it lost last: which one that is depends on how far the checksum thread lags.
    retention = "removed after its save (the job's retention: save_total_limit, save_top_k, keep_last)"
    for gen, why in deleted.items():
        assert why in (
            f"{tmp_path / f'step-{gen}.pt'} {retention}",
            f"{last} overwritten at the same path by generation {gen + 10} (step {gen + 10})",
        )
    assert agent.stats()["errors"] == 0


def test_a_save_to_the_same_path_retires_the_one_before(tmp_path: Path) -> None:
    agent, model = _agent(tmp_path)
    path = tmp_path / "model.pt"
    for step in (5, 10, 15):
        agent.save(model.state_dict(), path, step=step)
    agent.close()
    assert _deleted(tmp_path) == {
        5: f"{path} overwritten at the same path by generation 10 (step 10)",
        10: f"{path} overwritten at the same path by generation 15 (step 15)",
    }


def test_a_local_path_that_is_not_there_after_the_save_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A path the save did not write (a typo, the file's name where dcp.save wrote a directory) was
    recorded as persisted in silence, and the rollback query named it. It still is (the save may
    have written it elsewhere), with one line naming the fix; an object store's URL is not checked."""
    agent, model = _agent(tmp_path)
    missing = tmp_path / "ckpt" / "step-4"
    with caplog.at_level(logging.WARNING, logger="trainvitals.agent"):
        with agent.checkpoint(step=4, path=missing):
            torch.save(model.state_dict(), tmp_path / "elsewhere.pt")
        agent.checkpoint_saved(step=5, path=str(missing))
        agent.checkpoint_saved(step=6, path="s3://bucket/run/step-6")
    agent.close()
    rec = [(r.step, r.status, r.path, r.bytes) for r in _checkpoint_records(tmp_path) if r.status == "persisted"]
    assert rec == [(4, "persisted", str(missing), None), (5, "persisted", str(missing), None),
                   (6, "persisted", "s3://bucket/run/step-6", None)]  # fmt: skip
    assert [r.getMessage() for r in caplog.records if "checkpoint path" in r.getMessage()] == [
        f"trainvitals agent: checkpoint path {str(missing)!r} does not exist after its save: recorded as "
        "persisted without size or checksum, and `trainvitals query rollback` may name it; pass the path "
        "the save wrote (the directory, for dcp.save)"
    ]


def test_only_rank_0_checks_for_deleted_generations(tmp_path: Path) -> None:
    """A stat of every path still on disk at each save, on every rank of a large job, would load a
    shared file system with world size x generations metadata reads: other ranks record their
    saves and leave the check to rank 0."""
    from trainvitals.agent._checkpoints import CheckpointRecorder

    emitted: dict[bool, list[dict]] = {}
    for rank_0 in (True, False):
        records: list[dict] = []
        recorder = CheckpointRecorder(records.append, checksum="sha256", on_error=lambda *_: None,
                                      watch_files=rank_0)  # fmt: skip
        path = tmp_path / f"model-{rank_0}.pt"
        for step in (1, 2):
            with recorder.saving(step=step, generation=step, path=path):
                torch.save({"step": step}, path)
        recorder.close(timeout=10)
        emitted[rank_0] = records
    assert [(r["generation"], r["status"]) for r in emitted[True] if r["status"] == "deleted"] == [(1, "deleted")]
    assert sorted((r["generation"], r["status"]) for r in emitted[False]) == [
        (1, "persisted"), (1, "started"), (2, "persisted"), (2, "started")
    ]  # fmt: skip


def test_a_restart_goes_on_watching_the_previous_processs_saves(tmp_path: Path) -> None:
    """A restarted job's retention removes the previous process's saves too (HF sorts every
    checkpoint-* of the output directory), and a resume from an earlier generation saves over
    them: rank 0's ledger beside the spool carries them to the next process, whose deleted
    records name the incarnation that saved them."""

    def attach(name: str) -> tuple[tv.Agent, nn.Module]:
        model = nn.Linear(4, 4)
        config = tv.AgentConfig(collector="", spill_dir=str(tmp_path / "spool"), record_file=str(tmp_path / name))
        agent = tv.attach(model, None, run="ck", config=config)
        assert isinstance(agent, tv.Agent)
        return agent, model

    first, model = attach("first.jsonl")
    for step in (10, 20, 30):
        first.save(model.state_dict(), tmp_path / f"step-{step}.pt", step=step)
    first.close()
    (tmp_path / "step-10.pt").unlink()  # the retention, while the job was down
    time.sleep(0.002)  # incarnations are milliseconds
    second, model = attach("second.jsonl")
    second.loaded(step=10)
    second.save(model.state_dict(), tmp_path / "step-20.pt", step=20)  # the redo saves over the old 20
    second.close()
    assert second.stats()["errors"] == 0

    records = [
        r for line in (tmp_path / "second.jsonl").read_bytes().splitlines()[1:]
        for r in Batch.model_validate_json(line).records if r.kind == "checkpoint"
    ]  # fmt: skip
    deleted = {(r.generation, r.saved_by_incarnation): r.error for r in records if r.status == "deleted"}
    assert deleted == {
        (10, first.incarnation): f"{tmp_path / 'step-10.pt'} removed after its save (the job's retention: "
        "save_total_limit, save_top_k, keep_last) (saved by this rank's process before a restart)",
        (20, first.incarnation): f"{tmp_path / 'step-20.pt'} overwritten at the same path by generation 20 "
        "(step 20) (saved by this rank's process before a restart)",
    }
    assert all(r.saved_by_incarnation is None for r in records if r.status != "deleted")
    # What a third process would watch: the first's 30 and the second's 20.
    from trainvitals.agent._checkpoint_ledger import CheckpointLedger, ledger_path

    left = CheckpointLedger(ledger_path(str(tmp_path / "spool"), "ck")).earlier()
    assert [(s.incarnation, s.generation) for s in left] == [(first.incarnation, 30), (second.incarnation, 20)]
    # Not among the files the README's `trainvitals replay <spill_dir>/*.jsonl` takes (no batch in it).
    assert ledger_path(str(tmp_path / "spool"), "ck") not in set((tmp_path / "spool").glob("*.jsonl"))


def test_a_torn_or_unwritable_ledger_costs_the_watch_not_the_job(tmp_path: Path) -> None:
    """A line torn by a crash, or not text at all, is skipped; a ledger that cannot be written is an
    agent error, counted."""
    from trainvitals.agent._checkpoint_ledger import ledger_path

    spool = tmp_path / "spool"
    spool.mkdir()
    ledger_path(str(spool), "ck").write_bytes(b'\xff\xfe\x00garbage\n[1, 2]\n{"path": 7}\n'
                                              b'{"incarnation": 1, "generation": 3, "step": 3, "path": "/nowhere/3"}\n'
                                              b'{"incarnation": 1, "generation": 4, "st')  # fmt: skip
    agent, model = _agent(tmp_path)
    agent.close()
    assert [(r.generation, r.saved_by_incarnation, r.status) for r in _checkpoint_records(tmp_path)] == [
        (3, 1, "deleted")
    ]
    ledger_path(str(spool), "ck").unlink()
    ledger_path(str(spool), "ck").mkdir()  # a directory: neither readable nor writable as a file
    (tmp_path / "rec.jsonl").unlink()
    agent, model = _agent(tmp_path)
    agent.save(model.state_dict(), tmp_path / "step-5.pt", step=5)
    agent.close()
    assert agent.stats()["errors"] >= 1
    assert [r.status for r in _checkpoint_records(tmp_path) if r.generation == 5][-1] == "persisted"


def test_a_shared_directory_is_hashed_by_rank_0_alone(tmp_path: Path) -> None:
    """dcp.save's directory (and HF's checkpoint-N) is every rank's: each rank hashed all of it,
    so a 16k-rank job read the whole checkpoint 16k times from a shared file system per save, and
    the collector's `bytes` summed the directory once per rank. A file stays its saver's to hash."""
    from trainvitals.agent._checkpoints import CheckpointRecorder

    shared = tmp_path / "dcp-5"
    shared.mkdir()
    for rank in (0, 1):
        (shared / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 1000)
    own = tmp_path / "rank1.pt"
    own.write_bytes(b"x" * 10)
    persisted: dict[tuple[bool, str], dict] = {}
    for rank_0 in (True, False):
        records: list[dict] = []
        recorder = CheckpointRecorder(records.append, checksum="sha256", on_error=lambda *_: None,
                                      watch_files=rank_0)  # fmt: skip
        recorder.saved(step=5, generation=5, path=shared, stall=None)
        recorder.saved(step=6, generation=6, path=own, stall=None)
        recorder.close(timeout=10)
        for r in records:
            persisted[rank_0, Path(r["path"]).name] = r
    size, digest = content_digest(shared)
    assert (persisted[True, "dcp-5"]["bytes"], persisted[True, "dcp-5"]["checksum"]) == (size, digest) == (2000, digest)
    assert "bytes" not in persisted[False, "dcp-5"] and "checksum" not in persisted[False, "dcp-5"]
    assert persisted[False, "rank1.pt"]["checksum"] == "sha256:" + hashlib.sha256(b"x" * 10).hexdigest()


def test_a_save_to_a_buffer_is_saved_and_recorded_without_a_path(tmp_path: Path) -> None:
    """torch.save accepts a file-like object; the agent's os.fspath raised TypeError into the job
    before the save ran, so `agent.save(state, io.BytesIO())` saved nothing."""
    import io

    agent, model = _agent(tmp_path)
    buffer = io.BytesIO()
    agent.save(model.state_dict(), buffer, step=3)  # type: ignore[arg-type]
    torch.save(model.state_dict(), tmp_path / "b.pt")
    agent.checkpoint_saved(step=4, path=str(tmp_path / "b.pt").encode())  # type: ignore[arg-type]
    agent.close()
    assert buffer.getbuffer().nbytes > 0 and (tmp_path / "b.pt").exists()
    rec = _checkpoint_records(tmp_path)
    assert [(r.step, r.status, r.path) for r in rec] == [
        (3, "started", None), (3, "persisted", None), (4, "persisted", str(tmp_path / "b.pt")),
    ]  # fmt: skip
    assert agent.stats()["errors"] == 0


def test_an_async_save_response_is_tracked_by_its_upload(tmp_path: Path) -> None:
    """dcp.async_save with an async stager returns an AsyncSaveResponse (no add_done_callback):
    leaving the block raised AttributeError into the job, and dcp_async_save's result was lost."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    agent, _ = _agent(tmp_path)
    staged: Future[None] = Future()
    uploaded: Future[None] = Future()
    staged.set_result(None)
    with agent.checkpoint(step=5, path=None) as ck:
        response = ck.track(AsyncSaveResponse(staging_completion=staged, upload_completion=uploaded))
    assert isinstance(response, AsyncSaveResponse)
    time.sleep(0.05)
    uploaded.set_result(None)
    with agent.checkpoint(step=6, path=None) as ck:
        ck.track(object())  # not a future at all: recorded as done when the block ends, and said
    agent.close()
    rec = _checkpoint_records(tmp_path)
    assert [(r.step, r.status) for r in rec] == [(5, "started"), (5, "persisted"), (6, "started"), (6, "persisted")]
    assert rec[1].persist_seconds >= 0.05 > rec[1].stall_seconds
    assert agent.stats()["errors"] == 0


def test_exit_does_not_wait_for_hashes_still_queued() -> None:
    """The interpreter joins a ThreadPoolExecutor's threads at exit, before atexit: a queue of
    hashes of a large checkpoint held an ended job (and after a SIGTERM, until the SIGKILL). The
    checksum thread is a daemon: a process whose hash never finishes still exits at once."""
    import subprocess
    import sys

    script = """
import threading, time
from trainvitals.agent._checkpoints import CheckpointRecorder
recorder = CheckpointRecorder(lambda r: None, checksum="sha256", on_error=lambda *_: None)
recorder._submit(threading.Event().wait)  # a hash that never ends
recorder._submit(lambda: None)
print("queued", flush=True)
"""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "queued\n", done.stderr
    assert time.monotonic() - t0 < 30  # it exited: with a ThreadPoolExecutor it hung until the timeout
