"""Rank 0's list of the checkpoint generations it saved to local paths and has not seen deleted,
kept in a file beside the spool so that the next incarnation of the job (a restart) watches them
too. Without it a restart forgot the previous process's saves, and the retention that later
removed them (HF `save_total_limit` sorts every `checkpoint-*` in the output directory) left
them looking restorable to `trainvitals query rollback`.

The file is found where the spool is: a restart on the same node, or on any node when
TRAINVITALS_SPILL_DIR is on a shared file system. One JSON line per generation kept and per
generation gone; read and compacted once at attach, appended on the checksum thread after that."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

from trainvitals.agent._spool import safe_run_name


class Saved(NamedTuple):
    """A generation an earlier incarnation of rank 0 saved, and the local path holding it."""

    incarnation: int
    generation: int
    step: int
    path: str


def ledger_path(spill_dir: str, run: str) -> Path:
    """Not a .jsonl: `trainvitals replay <spill_dir>/*.jsonl` (README) takes the spool's batches, and
    this file holds none."""
    return Path(spill_dir) / f"{safe_run_name(run)}.checkpoint-ledger"


class CheckpointLedger:
    """Raises OSError from its file operations: the recorder counts those as agent errors."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def earlier(self) -> list[Saved]:
        """The generations earlier processes kept and did not see gone, oldest first; the file is
        rewritten to hold only those (a run without retention adds one line a save)."""
        try:
            text = self.path.read_bytes().decode("utf-8", errors="replace")  # garbage: lines skipped below
        except FileNotFoundError:
            return []
        kept: dict[tuple[int, int, str], Saved] = {}
        for line in text.splitlines():
            try:
                entry = json.loads(line)
                path = entry["path"]
                if not isinstance(path, str):
                    continue
                saved = Saved(int(entry["incarnation"]), int(entry["generation"]), int(entry["step"]), path)
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by a crash mid-write
            key = (saved.incarnation, saved.generation, saved.path)
            if entry.get("gone"):
                kept.pop(key, None)
            else:
                kept[key] = saved
        live = sorted(kept.values(), key=lambda s: (s.incarnation, s.generation))
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(_line(s, gone=False) for s in live), encoding="utf-8")
        os.replace(tmp, self.path)
        return live

    def note(self, saved: Saved, *, gone: bool) -> None:
        """Append that `saved.path` holds `saved` now, or (gone) holds it no longer."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(_line(saved, gone=gone))


def _line(saved: Saved, *, gone: bool) -> str:
    entry: dict[str, object] = saved._asdict()
    if gone:
        entry["gone"] = True
    return json.dumps(entry) + "\n"
