"""The ingest journal: batches acknowledged before their database commit, on local disk until then.

Without it a batch is acknowledged after the commit that stores it, so a sender with one request
in flight waits for a whole group's write (on PostgreSQL 20-40 ms under load) and a closed loop of
senders leaves the cores idle between groups. With it (`ingest_journal_dir`), the route appends the
batch's body to this journal and answers at once while the writers' backlog is small
(service/ingest/batch_writer.py, "Acknowledged from the journal"); the writers store it in fuller
groups, and each segment file is deleted once every batch in it is committed.

Durability: an append is one write(2) to the page cache, no fsync. A collector crash loses nothing:
the next start replays whatever the journal still holds (the database ignores batches it already
has, by their idempotency keys). A crash of the host, or losing the directory's disk, loses what was
not yet committed (at most the backlog allowed, `ingest_journal_ack_records`): the same class of
trade as `ingest_synchronous_commit` off, so the directory belongs on a disk that outlives the
collector's process (not a container's scratch layer).

Several collector processes (`serve --workers N`, replicas on one host) share a directory: each
takes a slot of its own (`slot-K/`, the lowest free one, held by an exclusive lock on `slot-K/lock`
for the process's life), and on start replays its own slot and every other that no live process
holds and that still has files (a crashed process's), holding those only while it replays them.

Entry format: a header (`<QiI`: entry number, project's byte length or -1 for none, body's byte
length), the project's UTF-8, the body as received. A torn last entry (the process died inside the
write) is ignored: its sender was never answered and sends it again.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<QiI")
SEGMENT_BYTES = 64 << 20
"""A segment is closed after this many bytes and a new one started: at 100k records/s of the
benchmark's batches (37 KB) about every 4 s, so committed batches leave the disk within seconds."""


class JournalError(RuntimeError):
    """The journal directory cannot be used (not writable, not a directory): said at start."""


class IngestJournal:
    """Usage::

    journal = IngestJournal.open(directory)      # takes a slot, creates the directory if needed
    for project, body in journal.leftovers():   # what earlier processes acknowledged and may not have stored
        ...                                      # store them, then
    journal.forget_leftovers()
    segment = journal.append(project, body)      # before acknowledging a batch
    journal.committed([segment, ...])            # after the commit that stored those batches
    journal.close()
    """

    def __init__(self, slot: Path, lock_fd: int, others: list[tuple[Path, int]]) -> None:
        self.slot = slot
        self._lock_fd = lock_fd
        self._others = others  # other slots no process held at start: (dir, lock fd), replayed then released
        self._leftover_files = sorted(self._segments(slot)) + [f for d, _ in others for f in sorted(self._segments(d))]
        self._lock = threading.Lock()
        self._next_entry = 0
        self._segment = max((int(f.stem) for f in self._segments(slot)), default=-1) + 1
        self._open: dict[int, int] = {}  # segment number -> entries appended and not yet committed
        self._fd = -1
        self._size = 0
        self._start_segment()

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> IngestJournal:
        root = Path(directory)
        try:
            root.mkdir(parents=True, exist_ok=True)
            slots = sorted(
                (p for p in root.iterdir() if p.name.startswith("slot-") and p.name[5:].isdigit()),
                key=lambda p: int(p.name[5:]),
            )
            held: list[tuple[Path, int]] = []  # the first is this process's own slot
            for slot in slots:
                fd = _try_lock(slot)
                if fd is None:
                    continue
                if not held or any(cls._segments(slot)):  # its own, or another's to replay
                    held.append((slot, fd))
                else:  # free and empty: left for the next process (clean stops leave every slot so)
                    os.close(fd)
            if not held:
                number = int(slots[-1].name[5:]) + 1 if slots else 0
                slot = root / f"slot-{number}"
                slot.mkdir(exist_ok=True)
                fd = _try_lock(slot)
                if fd is None:  # another process made it first: a fresh name
                    return cls.open(directory)
                held.append((slot, fd))
        except OSError:
            problem = IngestJournal.problem(directory) or f"ingest journal {str(directory)!r}: not usable"
            raise JournalError(problem) from None
        (own, own_fd), others = held[0], held[1:]
        return cls(own, own_fd, others)

    @staticmethod
    def problem(directory: str | os.PathLike[str]) -> str | None:
        """Why `directory` cannot hold a journal (one line naming the fix), or None when it can."""
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            probe = Path(directory) / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            return (
                f"ingest journal directory {str(directory)!r} is not usable ({exc.strerror or exc}): set "
                "TRAINVITALS_INGEST_JOURNAL_DIR (--ingest-journal) to a writable directory, or leave it unset"
            )
        return None

    @staticmethod
    def _segments(slot: Path) -> Iterator[Path]:
        return (p for p in slot.glob("*.seg") if p.stem.isdigit())

    def leftovers(self) -> Iterator[tuple[str | None, bytes]]:
        """(project, body) of every whole entry earlier processes left in this slot and in the
        unheld slots, oldest segment first."""
        for path in self._leftover_files:
            yield from _entries(path)

    @property
    def leftover_count(self) -> int:
        return len(self._leftover_files)

    def forget_leftovers(self) -> None:
        """The leftovers are stored: delete their files and let the other slots go."""
        for path in self._leftover_files:
            path.unlink(missing_ok=True)
        self._leftover_files = []
        for _, fd in self._others:
            os.close(fd)  # releases its lock: the slot is free for a later process
        self._others = []

    def append(self, project: str | None, body: bytes) -> int:
        """Write one batch's entry; returns its segment, for `committed`. Called on the event loop.
        OSError when the disk refuses it (nothing of the entry is left in the file)."""
        name = b"" if project is None else project.encode()
        header = _HEADER.pack(self._next_entry, -1 if project is None else len(name), len(body))
        with self._lock:
            if self._size >= SEGMENT_BYTES:
                self._rotate()
            entry = header + name + body
            if os.write(self._fd, entry) != len(entry):  # a full disk takes part of it: undo that part
                os.ftruncate(self._fd, self._size)
                raise OSError(errno.ENOSPC, "the ingest journal's disk took only part of an entry")
            self._next_entry += 1
            self._size += len(entry)
            self._open[self._segment] += 1
            return self._segment

    def committed(self, segments: list[int]) -> None:
        """These entries' batches are committed (or refused for good): a closed segment with none
        left open is deleted."""
        done: list[int] = []
        with self._lock:
            for segment in segments:
                self._open[segment] -= 1
                if not self._open[segment] and segment != self._segment:
                    del self._open[segment]
                    done.append(segment)
        for segment in done:
            self._delete(segment)

    def close(self) -> None:
        """Close the current segment (deleted if all of it is committed) and release the slot."""
        with self._lock:
            os.close(self._fd)
            if not self._open[self._segment]:
                del self._open[self._segment]
                self._delete(self._segment)
        for _, fd in self._others:  # a replay that failed kept them
            os.close(fd)
        self._others = []
        os.close(self._lock_fd)

    def _path(self, segment: int) -> Path:
        return self.slot / f"{segment:08d}.seg"

    def _start_segment(self) -> None:
        self._fd = os.open(self._path(self._segment), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)
        self._size = 0
        self._open[self._segment] = 0

    def _rotate(self) -> None:
        """The next segment first (if it cannot be made, nothing changes and append raises), then
        the full one closed, and deleted when none of its batches wait for a commit."""
        fd = os.open(self._path(self._segment + 1), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)
        full, full_fd = self._segment, self._fd
        self._segment, self._fd, self._size = full + 1, fd, 0
        self._open[self._segment] = 0
        os.close(full_fd)
        if not self._open[full]:
            del self._open[full]
            self._delete(full)

    def _delete(self, segment: int) -> None:
        """A segment whose batches are all committed. Failing to delete it (permissions) only means
        the next start replays batches the database already has: logged, not raised into a writer."""
        try:
            self._path(segment).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("ingest journal: could not delete %s (%s); the next start replays it", self._path(segment), exc)


def _try_lock(slot: Path) -> int | None:
    fd = os.open(slot / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _entries(path: Path) -> Iterator[tuple[str | None, bytes]]:
    data = path.read_bytes()
    at = 0
    while at + _HEADER.size <= len(data):
        _, name_len, body_len = _HEADER.unpack_from(data, at)
        start = at + _HEADER.size
        end = start + max(name_len, 0) + body_len
        if end > len(data):
            log.warning("ingest journal %s: a torn last entry (%d of %d bytes) ignored", path, len(data) - at, end - at)
            return
        project = None if name_len < 0 else data[start : start + name_len].decode()
        yield project, data[start + max(name_len, 0) : end]
        at = end
