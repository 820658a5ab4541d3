"""The PostgreSQL pool pings a connection only after it sat idle, and replaces one that died; its
connections carry the name of the collector's process that opened them."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import text

from trainvitals.service.store import db


def _backend_pid(engine: object) -> int:
    with engine.connect() as conn:  # type: ignore[attr-defined]
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_a_connection_in_use_is_not_pinged_again(empty_pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = db.make_engine(empty_pg_url)
    pings: list[object] = []
    real_ping = engine.dialect.do_ping
    monkeypatch.setattr(engine.dialect, "do_ping", lambda c: pings.append(c) or real_ping(c))
    try:
        pids = {_backend_pid(engine) for _ in range(20)}
        assert len(pids) == 1  # one pooled connection, reused
        assert pings == []  # each checkout came within the idle window of the last use
        monkeypatch.setattr(db, "_PING_AFTER_IDLE_S", 0.0)
        _backend_pid(engine)
        assert len(pings) == 1
    finally:
        engine.dispose()


def test_an_idle_connection_that_died_is_replaced_at_checkout(
    empty_pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = db.make_engine(empty_pg_url)
    try:
        dead = _backend_pid(engine)
        admin = empty_pg_url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(admin, autocommit=True) as conn:
            assert conn.execute("SELECT pg_terminate_backend(%s)", (dead,)).fetchone() == (True,)
        monkeypatch.setattr(db, "_PING_AFTER_IDLE_S", 0.0)  # as if it sat idle past the window
        assert _backend_pid(engine) not in (dead, 0)  # the statement ran on a fresh connection
    finally:
        engine.dispose()


def _application_name(engine: object) -> str:
    with engine.connect() as conn:  # type: ignore[attr-defined]
        return str(conn.execute(text("SHOW application_name")).scalar_one())


def test_connections_say_which_process_of_the_collector_opened_them(empty_pg_url: str) -> None:
    """pg_stat_activity tells serve's connections from the analysis worker's; a name given in the
    URL wins."""
    for kwargs, expected in (
        ({}, "trainvitals"),
        ({"application_name": db.ANALYSE_APPLICATION_NAME}, "trainvitals-analyse"),
    ):
        engine = db.make_engine(empty_pg_url, **kwargs)
        try:
            assert _application_name(engine) == expected
        finally:
            engine.dispose()
    engine = db.make_engine(empty_pg_url + "?application_name=mine", application_name=db.SERVE_APPLICATION_NAME)
    try:
        assert _application_name(engine) == "mine"
    finally:
        engine.dispose()
