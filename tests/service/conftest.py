"""Fixtures shared by the collector's unit tests."""

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from trainvitals.service.store import db


@pytest.fixture
def session(db_url: str):
    """A session on a migrated, empty database of each backend (db_url is parametrised)."""
    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as s:
        yield s
    engine.dispose()


class WriteLockProbe:
    """Called: notes whether another connection could take a SQLite database's one write lock at
    that moment (ingest's writer, in another process, waits whenever it cannot)."""

    def __init__(self, path: Path) -> None:
        self._other = sqlite3.connect(path, timeout=0, isolation_level=None)
        self.locked: list[bool] = []

    def __call__(self) -> None:
        try:
            self._other.execute("BEGIN IMMEDIATE")
            self._other.execute("ROLLBACK")
            self.locked.append(False)
        except sqlite3.OperationalError:
            self.locked.append(True)

    def close(self) -> None:
        self._other.close()


@pytest.fixture
def write_lock_probe() -> Iterator[Callable[[Path], WriteLockProbe]]:
    probes: list[WriteLockProbe] = []

    def make(path: Path) -> WriteLockProbe:
        probes.append(WriteLockProbe(path))
        return probes[-1]

    yield make
    for probe in probes:
        probe.close()
