"""A bounded on-disk spool of undelivered messages, read back in order.

One JSONL file per (run, rank). Lines are only ever appended; the reader keeps a byte offset, and
the file is removed once everything in it is delivered, so the next append starts a new file.
The exporter writes the run registration as a new file's first line (docs/agent.md), which makes
every spool file a stream `trainvitals replay` ingests as it is, and tells a reader each line's
kind from where it sits: the first line is the registration, every other line a batch.

An append is all or nothing: a write the disk, a quota or a file-size limit cuts short is cut off
again before the error is raised, so the next line never glues onto half a line. A torn last line
that survives anyway (the process was killed mid-write) is cut off when a file is next opened for
appending and when a spool is opened at the start of a process.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

_DISK_FULL = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
_TAIL_CHUNK = 64 * 1024  # read back from the end at a time when looking for a torn line's start


def safe_run_name(run: str) -> str:
    """The run id as it names the files of a run in the spill directory."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", run)


def spool_path(spill_dir: str, run: str, rank: int) -> Path:
    return Path(spill_dir) / f"{safe_run_name(run)}.rank{rank}.jsonl"


def disk_full(exc: OSError) -> bool:
    """Whether a failed write means no room (disk full, quota, RLIMIT_FSIZE) rather than no access."""
    return exc.errno in _DISK_FULL


class SpoolLine(NamedTuple):
    """One complete line of the spool: `end` is the offset just past it (for mark_delivered)."""

    end: int
    line: bytes

    @property
    def first(self) -> bool:
        """Whether this is the file's first line (the exporter's run registration)."""
        return self.end == len(self.line) + 1


class Spool:
    """Append-only JSONL spool with a read cursor; not thread-safe (the exporter thread owns it).

    Usage::

        spool = Spool(path, max_bytes=512 << 20)
        spool.append(b'{"run": "r1"}')      # False when full; OSError when it cannot be written
        for end, line in spool.pending():
            if send(line):
                spool.mark_delivered(end)
    """

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._offset = 0  # bytes of the file already delivered
        self.torn_bytes = 0
        """Bytes of a torn last line an earlier process left, cut off when this spool was opened."""
        try:
            self.torn_bytes = cut_torn_tail(path)
        except OSError:
            pass  # unreadable: pending() skips a torn tail, and append() cuts it if it ever can

    def __len__(self) -> int:
        """Undelivered bytes (0 when the file cannot be read)."""
        return max(0, self._size() - self._offset)

    def empty(self) -> bool:
        """Whether the file is absent or empty: the next append starts it (with a registration)."""
        return self._size() == 0

    def append(self, line: bytes) -> bool:
        """Append one message (or several, newline-separated, with one fsync); False when full:
        max_bytes undelivered. Raises OSError when the file cannot be written, having left it as
        it was."""
        # The file keeps its delivered lines until everything is delivered: they count against
        # the cap no more, and once they are max_bytes the file is rewritten without them.
        if self._offset >= self.max_bytes:
            self._cut_delivered()
        return _append(self.path, line, self.max_bytes + self._offset)

    def _cut_delivered(self) -> None:
        """Rewrite the file as its first line (the registration, which replay needs) and its
        undelivered lines: a copy of at most max_bytes, in the exporter thread, once per
        max_bytes delivered without the spool emptying. On an error the file stays as it was."""
        first = self.first_line()
        if first is None or self._offset < len(first) + 1:
            return
        tmp = self.path.with_name(self.path.name + ".cut")
        try:
            with open(self.path, "rb") as src, open(tmp, "wb") as dst:
                dst.write(first + b"\n")
                src.seek(self._offset)
                shutil.copyfileobj(src, dst)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            return
        self._offset = len(first) + 1

    def first_line(self) -> bytes | None:
        """The file's first line (the registration it was written under), if the file exists."""
        try:
            with open(self.path, "rb") as fh:
                line = fh.readline()
        except OSError:
            return None
        return line.rstrip(b"\n") if line.endswith(b"\n") else None

    def pending_batches(self) -> int:
        """Undelivered batch lines (the registration line not counted). Reads the file: for
        messages at the end of a run, not for the delivery itself."""
        n = 0
        for item in self.pending():
            n += not item.first
        return n

    def pending(self) -> Iterator[SpoolLine]:
        """Undelivered lines with the offset just past each, oldest first, read lazily: after a
        long outage the spool can hold up to max_bytes, and a delivery attempt that fails at the
        first line must not have read (or hold) the rest."""
        try:
            fh = open(self.path, "rb")  # noqa: SIM115 - closed by the with below, also on early exit
        except OSError:
            return
        with fh:
            fh.seek(self._offset)
            pos = self._offset
            for raw in fh:
                pos += len(raw)
                if raw.endswith(b"\n") and raw.strip():  # a torn last line (crash mid-write) waits
                    yield SpoolLine(pos, raw.rstrip(b"\n"))

    def mark_delivered(self, offset: int) -> None:
        self._offset = offset
        if self._offset >= self._size():
            # Everything delivered: start the file afresh so it does not grow forever.
            try:
                self.path.unlink(missing_ok=True)
            except OSError:
                return  # kept, and read on from the offset
            self._offset = 0

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0


class Quarantine:
    """Batches the collector refused for good, set aside next to the spool
    (`<run>.rank<r>.quarantine.jsonl`) so that later data flows; `trainvitals replay` takes the
    file as it is. A batch follows the registration it was sent under when the collector took that
    registration (written again whenever it changes), so the file registers the run on its own;
    under a refused registration it is written alone (agent/_delivery.py says why).

    Usage::

        q = Quarantine(spool.path, max_bytes=512 << 20)
        q.add(batch_line, registration=registration_line)
    """

    def __init__(self, spool: Path, max_bytes: int) -> None:
        self.path = spool.with_name(spool.name.removesuffix(".jsonl") + ".quarantine.jsonl")
        self.max_bytes = max_bytes
        self.batches = 0  # set aside by this process
        self._header: bytes | None = None  # the registration this process wrote last

    def add(self, line: bytes, *, registration: bytes | None) -> bool:
        """Set a batch aside, after `registration` unless that was the last one written; False
        when the file is full. Raises OSError when it cannot be written, having left it as it was."""
        if registration is not None and registration != self._header:
            line = registration + b"\n" + line
        if not _append(self.path, line, self.max_bytes):
            return False
        self._header = registration or self._header
        self.batches += 1
        return True


def cut_torn_tail(path: Path) -> int:
    """Cut off a last line without its newline (a write cut short by a kill or a crash); returns
    the bytes cut. A missing file has none."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return 0
    try:
        size = os.fstat(fd).st_size
        keep = _complete_lines_end(fd, size)
        if keep < size:
            os.ftruncate(fd, keep)
        return size - keep
    finally:
        os.close(fd)


def _complete_lines_end(fd: int, size: int) -> int:
    """The offset just past the file's last newline (0 when it has none)."""
    end = size
    while end > 0:
        start = max(0, end - _TAIL_CHUNK)
        chunk = os.pread(fd, end - start, start)
        i = chunk.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        end = start
    return 0


def _append(path: Path, data: bytes, max_bytes: int) -> bool:
    """Append `data` and a newline with one fsync, unless the file would pass max_bytes; on a
    failed write the file is cut back to where it was and the OSError raised."""
    # Private to the user: a node-local spool usually sits under a shared /tmp.
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            # A torn line this file kept (a kill mid-write, or a cut-back that failed): the next
            # line must not glue onto it and make both unreadable. One 1-byte read per append.
            size = _complete_lines_end(fd, size)
            os.ftruncate(fd, size)
        if size + len(data) + 1 > max_bytes:
            return False
        view = memoryview(data + b"\n")
        try:
            while view:  # a short write (RLIMIT_FSIZE, a nearly full disk) is followed by its error
                view = view[os.write(fd, view) :]
            # What reached write() survives the process being killed (page cache); the fsync is for
            # a crash of the node's kernel, and costs the exporter thread a disk flush per append.
            os.fsync(fd)
        except OSError:
            # All or nothing: shrinking needs no space and passes any file-size limit. Should it
            # fail too, the next append (or the next process) cuts the torn line.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
                if size == 0:
                    path.unlink(missing_ok=True)
            raise
        return True
    finally:
        os.close(fd)
