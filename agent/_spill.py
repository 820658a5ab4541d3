"""A bounded on-disk spool of undelivered messages, drained in order.

One JSONL file per (run, rank): each line is a wire-format message (a run registration or a
batch), so a spool is also a file `trainvitals replay` can ingest. Lines are only ever appended;
the reader keeps a byte offset, and the file is truncated once everything in it is delivered.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path


def spool_path(spill_dir: str, run: str, rank: int) -> Path:
    safe_run = re.sub(r"[^A-Za-z0-9._-]", "_", run)
    return Path(spill_dir) / f"{safe_run}.rank{rank}.jsonl"


class Spool:
    """Append-only JSONL spool with a read cursor; not thread-safe (the exporter thread owns it)."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.dropped_lines = 0
        self._offset = 0  # bytes of the file already delivered

    def __len__(self) -> int:
        """Undelivered bytes."""
        try:
            return max(0, self.path.stat().st_size - self._offset)
        except FileNotFoundError:
            return 0

    def append(self, line: bytes) -> bool:
        """Append one message; False (and counted) when the spool is full."""
        size = self.path.stat().st_size if self.path.exists() else 0
        if size + len(line) + 1 > self.max_bytes:
            self.dropped_lines += 1
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as fh:
            fh.write(line + b"\n")
            fh.flush()
            os.fsync(fh.fileno())  # the point of spilling is to survive the process
        return True

    def pending(self) -> Iterator[tuple[int, bytes]]:
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
                    yield pos, raw.rstrip(b"\n")

    def mark_delivered(self, offset: int) -> None:
        self._offset = offset
        if self._offset >= self.path.stat().st_size:
            # Everything delivered: start the file afresh so it does not grow forever.
            self.path.unlink(missing_ok=True)
            self._offset = 0
