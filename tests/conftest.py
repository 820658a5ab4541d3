"""Shared fixtures: real SQLite files, a real PostgreSQL database, a real collector server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
import uvicorn
from sqlalchemy import text

from trainvitals.service.main import create_app
from trainvitals.service.settings import Settings
from trainvitals.service.store import db
from trainvitals.service.store.models import Base

PG_ADMIN_DSN = os.environ.get("TRAINVITALS_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def postgres_database() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for the duration; dropped afterwards."""
    name = f"tv_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + f"/{name}"
    try:
        yield url
    finally:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def empty_pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database with no schema at all."""
    with postgres_database() as url:
        yield url


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """One migrated PostgreSQL database for the session (tables emptied per test by db_url)."""
    with postgres_database() as url:
        db.upgrade(url)
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated, empty database on each backend."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'tv.db'}"
        db.upgrade(url)
        return url
    url = request.getfixturevalue("pg_url")
    engine = db.make_engine(url)
    with engine.begin() as conn:
        names = ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables)
        conn.execute(text(f"TRUNCATE {names} CASCADE"))
    engine.dispose()
    return url


class CollectorServer:
    """The real collector app served by uvicorn in a thread; stop() and start() again on the same
    port to simulate an outage."""

    def __init__(self, db_url: str, port: int | None = None, *, auth: bool = False) -> None:
        self.db_url = db_url
        self.auth = auth
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = None

    def start(self) -> CollectorServer:
        self.app = create_app(Settings(db=self.db_url, port=self.port, auth=self.auth))
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="test-collector", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("collector did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            assert self._thread is not None
            self._thread.join(20)
            self._server = None


@pytest.fixture
def collector(db_url: str) -> Iterator[CollectorServer]:
    server = CollectorServer(db_url).start()
    yield server
    server.stop()


@pytest.fixture
def unused_port() -> int:
    return free_port()


def promtool_check_metrics(exposition: str) -> subprocess.CompletedProcess[str]:
    """Run the real `promtool check metrics` on an exposition text."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool not installed: run `make system-deps` (Debian package prometheus)"
    return subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, text=True)


@pytest.fixture
def promtool_check() -> Callable[[str], subprocess.CompletedProcess[str]]:
    return promtool_check_metrics
