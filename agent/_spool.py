"""A bounded on-disk spool of undelivered messages, read back in order.

One JSONL file per (run, rank). Lines are only ever appended; the reader keeps a byte offset, and
the file is removed once everything in it is delivered, so the next append starts a new file.
The exporter writes the run registration as a new file's first line (docs/agent.md), which makes
every spool file a stream `trainvitals replay` ingests as it is, and tells a reader each line's
kind from where it sits: the first line is the registration, every other line a batch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple


def spool_path(spill_dir: str, run: str, rank: int) -> Path:
    safe_run = re.sub(r"[^A-Za-z0-9._-]", "_", run)
    return Path(spill_dir) / f"{safe_run}.rank{rank}.jsonl"


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
        spool.append(b'{"run": "r1"}')
        for end, line in spool.pending():
            if send(line):
                spool.mark_delivered(end)
    """

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._offset = 0  # bytes of the file already delivered

    def __len__(self) -> int:
        """Undelivered bytes."""
        try:
            return max(0, self.path.stat().st_size - self._offset)
        except FileNotFoundError:
            return 0

    def append(self, line: bytes) -> bool:
        """Append one message (or several, newline-separated, with one fsync); False when full."""
        return _append(self.path, line, self.max_bytes)

    def first_line(self) -> bytes | None:
        """The file's first line (the registration it was written under), if the file exists."""
        try:
            with open(self.path, "rb") as fh:
                line = fh.readline()
        except FileNotFoundError:
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
        except FileNotFoundError:
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
        if self._offset >= self.path.stat().st_size:
            # Everything delivered: start the file afresh so it does not grow forever.
            self.path.unlink(missing_ok=True)
            self._offset = 0


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
        when the file is full."""
        if registration is not None and registration != self._header:
            line = registration + b"\n" + line
        if not _append(self.path, line, self.max_bytes):
            return False
        self._header = registration or self._header
        self.batches += 1
        return True


def _append(path: Path, data: bytes, max_bytes: int) -> bool:
    """Append `data` and a newline with one fsync, unless the file would pass max_bytes."""
    size = path.stat().st_size if path.exists() else 0
    if size + len(data) + 1 > max_bytes:
        return False
    # Private to the user: a node-local spool usually sits under a shared /tmp.
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(path, "ab") as fh:
        fh.write(data + b"\n")
        fh.flush()
        # What reached write() survives the process being killed (page cache); the fsync is for
        # a crash of the node's kernel, and costs the exporter thread a disk flush per append.
        os.fsync(fh.fileno())
    return True
