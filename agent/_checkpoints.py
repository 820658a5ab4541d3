"""Checkpoint generations: one line around a save records started / persisted / failed, the stall
(training blocked), the time to durability, the size and a content checksum. Hashing runs on a
background thread, never on the training thread.

A generation whose files are gone later is recorded once more, as deleted: a job's retention
(HF `save_total_limit`, Lightning `save_top_k`, a `keep_last` of its own) removes old saves, and a
save to a fixed path overwrites the one before. `trainvitals query rollback` must not name those.
Local paths only (an object store's URL is not for os.path), checked after each save and at close,
on rank 0 only: a check is a stat of each path still on disk, and on every rank of a 16k-rank job
without retention that is world size x generations metadata reads of a shared file system at each
save. The collector takes a generation as deleted when any rank says so. Rank 0 keeps the list of
the generations it watches in a ledger beside the spool (agent/_checkpoint_ledger.py), so that a
restarted job goes on watching its previous process's saves; their deleted records carry that
process's incarnation.

A directory every rank names (dcp.save's checkpoint_id, HF's checkpoint-N) is hashed by rank 0
alone: on every rank, a 16k-rank job read the whole checkpoint 16k times from a shared file
system at each save. A file is hashed by the rank that saved it. The collector takes a
generation as verified when each of its paths has a checksum from some rank."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainvitals.agent._checkpoint_ledger import CheckpointLedger, Saved
from trainvitals.agent._guard import warn_once
from trainvitals.wire import checkpoint_record
from trainvitals.wire.builders import JsonObject
from trainvitals.wire.conventions import CheckpointStatus

StrPath = str | os.PathLike[str]
"""A checkpoint's path as jobs pass it: a string or a pathlib.Path (`ckpt_dir / "model.pt"`)."""

_CHUNK = 8 * 1024 * 1024
MAX_QUEUED_HASHES = 4
"""With this many background jobs (hashes, file checks) waiting (saves faster than hashing), a
save's hash is not made: it is recorded without a checksum (persisted, not verified), said once."""


def content_digest(path: str | os.PathLike[str], algorithm: str = "sha256") -> tuple[int, str | None]:
    """(bytes, hex digest) of a file, or of every file under a directory in sorted path order
    (a DCP checkpoint is a directory of shards plus metadata)."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    total = 0
    digest = hashlib.new(algorithm) if algorithm != "none" else None
    for f in files:
        if digest is not None and root.is_dir():
            digest.update(str(f.relative_to(root)).encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                total += len(chunk)
                if digest is not None:
                    digest.update(chunk)
    return total, (f"{algorithm}:{digest.hexdigest()}" if digest is not None else None)


class _ChecksumThread:
    """Runs the recorder's background work in order on one daemon thread, started on first use.

    A daemon, not a ThreadPoolExecutor: the interpreter joins an executor's threads at exit, before
    atexit handlers run, so a queue of hashes of a large checkpoint held the ended job (and the
    agent's last flush) for as long as they took, and after a SIGTERM until the SIGKILL."""

    def __init__(self) -> None:
        self._jobs: deque[Callable[[], None]] = deque()
        self._idle = threading.Condition()
        self._busy = 0  # queued plus running
        self._thread: threading.Thread | None = None
        self._closed = False  # drain() ran: nothing more is queued

    def submit(self, work: Callable[[], None]) -> bool:
        """Queue `work`; False when closed (nothing queued)."""
        with self._idle:
            if self._closed:
                return False
            self._jobs.append(work)
            self._busy += 1
            self._idle.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trainvitals-checksum", daemon=True)
                self._thread.start()
        return True

    @property
    def busy(self) -> int:
        return self._busy

    def _run(self) -> None:
        while True:
            with self._idle:
                while not self._jobs:
                    if self._closed:
                        return
                    self._idle.wait()
                work = self._jobs.popleft()
            try:
                work()
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()

    def drain(self, timeout: float) -> None:
        """Wait until the queue is done or `timeout` passed, then accept nothing more; what is left
        runs on, and the process's exit does not wait for it."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._busy and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)
            self._closed = True
            self._idle.notify_all()


class CheckpointHandle:
    """Yielded by `Agent.checkpoint()`; attach an async save's future to time its persistence."""

    __slots__ = ("future",)

    def __init__(self) -> None:
        self.future: Any = None

    def track(self, future: Any) -> Any:
        self.future = future
        return future


@dataclass(frozen=True, slots=True)
class _Generation:
    step: int
    generation: int
    path: str | None
    saved_by: int | None = None
    """The earlier incarnation that saved it (from the ledger); None: this process."""

    @classmethod
    def of(cls, step: int, generation: int, path: Any) -> _Generation:
        # The path as text: a pathlib.Path (what `ckpt_dir / "model.pt"` gives) cannot be
        # JSON-encoded, and each record of the generation was lost with an agent error. A local
        # path made absolute: the rollback query names it to someone not in the job's directory
        # (HF's default output_dir is relative: "out/checkpoint-8" until 2026-11-29). What is not
        # a path (torch.save to a BytesIO) has none: os.fspath raised into the job before its save.
        if not isinstance(path, str | bytes | os.PathLike):
            return cls(step, generation, None)
        text = os.fsdecode(path)
        return cls(step, generation, text if "://" in text else os.path.abspath(text))


class CheckpointRecorder:
    """Emits wire-format checkpoint records through `emit` (the exporter's O(1) emit)."""

    def __init__(
        self,
        emit: Callable[[JsonObject], None],
        *,
        checksum: str,
        on_error: Callable[[str, BaseException], None],
        said: set[tuple[str, str]] | None = None,
        watch_files: bool = True,
        incarnation: int = 0,
        ledger: CheckpointLedger | None = None,
    ) -> None:
        self._emit = emit
        self._checksum = checksum
        self._on_error = on_error
        self._said: set[tuple[str, str]] = set() if said is None else said  # the agent's: said once
        self._thread = _ChecksumThread()
        self._saving: set[threading.Event] = set()  # async saves not yet done (set when done)
        # Local path -> the generation whose content it holds, for the generations still on disk
        # (rank 0: `watch_files`). Touched on the checksum thread only (one worker): no lock.
        self._on_disk: dict[str, _Generation] = {}
        self._watch_files = watch_files
        self._incarnation = incarnation
        self._ledger = ledger if watch_files else None
        if self._ledger is not None:
            try:
                for saved in self._ledger.earlier():
                    self._on_disk[saved.path] = _Generation(saved.step, saved.generation, saved.path, saved.incarnation)
            except OSError as exc:
                on_error("checkpoint ledger", exc)
                self._ledger = None
            if self._on_disk:
                self._submit(self._sweep)  # what went while the job was down

    def _record(
        self,
        gen: _Generation,
        status: CheckpointStatus,
        *,
        stall: float | None = None,
        persist: float | None = None,
        size: int | None = None,
        checksum: str | None = None,
        error: str | None = None,
    ) -> None:
        self._emit(
            checkpoint_record(
                step=gen.step,
                generation=gen.generation,
                status=status,
                ts=time.time(),
                path=gen.path,
                bytes=size,
                stall_seconds=stall,
                persist_seconds=persist,
                checksum=checksum,
                error=error,
                saved_by_incarnation=gen.saved_by,
            )
        )

    @contextmanager
    def saving(self, *, step: int, generation: int, path: StrPath | None) -> Iterator[CheckpointHandle]:
        """Around the job's save: its exception propagates, the agent's never does (an agent error
        before the save would have skipped it)."""
        handle = CheckpointHandle()
        t0 = time.perf_counter()
        gen: _Generation | None = None
        try:
            gen = _Generation.of(step, generation, path)
            self._record(gen, "started")
        except Exception as exc:  # noqa: BLE001
            self._on_error("checkpoint", exc)
            gen = None
        try:
            yield handle
        except BaseException as exc:
            # The job's own save failed: record it, then let the job see its exception as usual.
            if gen is not None:
                self._guarded(self._record, gen, "failed", stall=time.perf_counter() - t0, error=repr(exc)[:4000])
            raise
        if gen is None:
            return
        stall = time.perf_counter() - t0
        if handle.future is None:
            self._guarded(self._finish, gen, stall=stall, persist=stall)
        else:
            self._guarded(self._track_async, handle.future, gen, t0=t0, stall=stall)

    def _guarded(self, work: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        try:
            work(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - recorded, counted; never the job's
            self._on_error("checkpoint", exc)

    def saved(self, *, step: int, generation: int, path: StrPath | None, stall: float | None) -> None:
        self._finish(_Generation.of(step, generation, path), stall=stall, persist=None)

    def _track_async(self, future: Any, gen: _Generation, *, t0: float, stall: float) -> None:
        # dcp.async_save with an async stager returns an AsyncSaveResponse: its upload is the save.
        future = getattr(future, "upload_completion", future)
        if not hasattr(future, "add_done_callback"):
            warn_once(self._said, ("checkpoint future", type(future).__name__),
                      f"ck.track() was given a {type(future).__name__}, not a future: the save is recorded as "
                      "persisted when its block ended; pass the future (or AsyncSaveResponse) the save returned")
            self._finish(gen, stall=stall, persist=stall)
            return
        finished = threading.Event()
        self._saving.add(finished)

        def done(fut: Any) -> None:
            try:
                persist = time.perf_counter() - t0
                exc = fut.exception() if hasattr(fut, "exception") else None
                if exc is not None:
                    self._record(gen, "failed", stall=stall, persist=persist, error=repr(exc)[:4000])
                else:
                    self._finish(gen, stall=stall, persist=persist)
            finally:
                finished.set()
                self._saving.discard(finished)

        future.add_done_callback(done)

    def _finish(self, gen: _Generation, *, stall: float | None, persist: float | None) -> None:
        path = gen.path
        if path is None or not os.path.exists(path):
            if path is not None and "://" not in path:  # an object store's URL is not for os.path
                text = (
                    f"checkpoint path {path!r} does not exist after its save: recorded as persisted without size "
                    "or checksum, and `trainvitals query rollback` may name it; pass the path the save wrote (the "
                    "directory, for dcp.save)"
                )
                warn_once(self._said, ("checkpoint path", "missing"), text)
            self._record(gen, "persisted", stall=stall, persist=persist)
            return

        hash_it = self._thread.busy < MAX_QUEUED_HASHES
        if not hash_it:
            warn_once(self._said, ("checksum", "behind"),
                      f"checkpoint checksums fall behind the saves ({MAX_QUEUED_HASHES} waiting): generation "
                      f"{gen.generation} and others while they wait are recorded without one (persisted, not verified)")

        def hash_and_record() -> None:
            size, digest = None, None
            try:
                # A directory is every rank's (dcp.save, HF): rank 0 reads it, once for the job.
                if hash_it and (self._watch_files or not os.path.isdir(path)):
                    size, digest = content_digest(path, self._checksum)
            except FileNotFoundError:  # removed before its turn here (a retention quicker than hashing)
                pass
            except OSError as exc:
                self._on_error("checksum", exc)
            self._record(gen, "persisted", stall=stall, persist=persist, size=size, checksum=digest)
            self._keep(gen)

        self._submit(hash_and_record, or_else=lambda: self._record(gen, "persisted", stall=stall, persist=persist))

    def _submit(self, work: Callable[[], None], *, or_else: Callable[[], None] | None = None) -> None:
        """Run `work` on the checksum thread; `or_else` here when it is closed already (an async
        save that outlived close()'s wait is recorded as it is)."""
        if not self._thread.submit(work) and or_else is not None:
            or_else()

    def _key(self, gen: _Generation) -> tuple[int, int]:
        return (self._incarnation if gen.saved_by is None else gen.saved_by, gen.generation)

    def _keep(self, gen: _Generation) -> None:
        """Note that `gen.path` now holds `gen` (taking it from the generation it held before), then
        record every generation left with no file on disk as deleted (the checksum thread)."""
        path = gen.path
        if not self._watch_files or path is None:
            return
        lost: dict[tuple[int, int], tuple[_Generation, str]] = {}
        before = self._on_disk.get(path)
        replaced = before is not None and self._key(before) != self._key(gen)
        if before is None or replaced:
            self._note(gen, gone=False)
        if before is not None and replaced:
            self._note(before, gone=True)
            lost[self._key(before)] = (before, f"overwritten at the same path by generation {gen.generation} "
                                               f"(step {gen.step})")  # fmt: skip
        self._on_disk[path] = gen
        self._sweep(lost)

    def _sweep(self, lost: dict[tuple[int, int], tuple[_Generation, str]] | None = None) -> None:
        """Record as deleted each generation none of whose paths is on disk any more."""
        lost = {} if lost is None else lost
        for path, gen in list(self._on_disk.items()):
            if not os.path.exists(path):
                del self._on_disk[path]
                self._note(gen, gone=True)
                lost[self._key(gen)] = (gen, "removed after its save (the job's retention: save_total_limit, "
                                             "save_top_k, keep_last)")  # fmt: skip
        still = {self._key(g) for g in self._on_disk.values()}
        for key, (gen, why) in sorted(lost.items()):
            if key not in still:
                before_restart = "" if gen.saved_by is None else " (saved by this rank's process before a restart)"
                self._record(gen, "deleted", error=f"{gen.path} {why}{before_restart}")

    def _note(self, gen: _Generation, *, gone: bool) -> None:
        """The ledger's line for `gen`'s path (the checksum thread); its errors are the agent's, counted."""
        if self._ledger is None or gen.path is None:
            return
        try:
            self._ledger.note(Saved(self._key(gen)[0], gen.generation, gen.step, gen.path), gone=gone)
        except OSError as exc:
            self._on_error("checkpoint ledger", exc)

    def close(self, timeout: float) -> None:
        """Wait (bounded, `timeout` in all) for async saves still writing, then for pending
        checksums, so that their records make the final flush."""
        deadline = time.monotonic() + timeout
        for finished in list(self._saving):
            finished.wait(max(0.0, deadline - time.monotonic()))
        if self._on_disk:
            self._submit(self._sweep)  # saves the job removed after its last one
        self._thread.drain(max(0.0, deadline - time.monotonic()))
