"""Alembic: upgrade from empty and downgrade back, on SQLite and on PostgreSQL."""

from pathlib import Path

import pytest
from sqlalchemy import String, inspect

from trainvitals.service.store import db
from trainvitals.service.store.models import Base


def _tables(url: str) -> set[str]:
    engine = db.make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _round_trip(url: str) -> None:
    db.upgrade(url)
    expected = {t.name for t in Base.metadata.sorted_tables}
    assert expected <= _tables(url)
    assert db.current_revision(url) is not None
    db.downgrade(url, "base")
    assert _tables(url) - {"alembic_version"} == set()
    assert db.current_revision(url) is None
    db.upgrade(url)  # and up again: downgrade left nothing behind that blocks it
    assert expected <= _tables(url)


def test_sqlite_upgrade_downgrade(tmp_path: Path) -> None:
    _round_trip(f"sqlite:///{tmp_path / 'm.db'}")


def test_postgresql_upgrade_downgrade(empty_pg_url: str) -> None:
    _round_trip(empty_pg_url)


def _sqlite_ignores_lengths(context, inspected, metadata, inspected_type, metadata_type) -> bool | None:
    """SQLite keeps a VARCHAR's declared length but never enforces it, so migration 0016 leaves the
    run_id columns' declared 128 there (widening would rebuild every table, and rebuilding `runs`
    with foreign keys on would cascade-delete its children); any other type difference counts."""
    if isinstance(inspected_type, String) and isinstance(metadata_type, String):
        return False  # the same: lengths aside, a String is VARCHAR here
    return None


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_models_and_migrations_agree(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Autogenerate finds nothing to do after upgrading: no schema change without a revision."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    url = f"sqlite:///{tmp_path / 'agree.db'}" if backend == "sqlite" else request.getfixturevalue("empty_pg_url")
    db.upgrade(url)
    engine = db.make_engine(url)
    opts = {"compare_type": _sqlite_ignores_lengths} if backend == "sqlite" else {}
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn, opts=opts), Base.metadata) == []
    engine.dispose()


def _backfill_case(url: str) -> None:
    from sqlalchemy import text

    from trainvitals.service.store import queries

    db.upgrade(url, "0005")
    engine = db.make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (run_id, project, registration, world_size, status, created_at, "
                          "last_seen_at) VALUES ('old', 'p', '{}', 2, 'running', 1.0, 1.0)"))  # fmt: skip
        for rank in range(2):
            for step in range(3):
                conn.execute(text("INSERT INTO steps (run_id, rank, incarnation, step, ts, step_seconds) "
                                  f"VALUES ('old', {rank}, 1, {step}, 1.0, 1.0)"))  # fmt: skip
            conn.execute(text("INSERT INTO tensor_stats (run_id, rank, incarnation, step, tensor, role, "
                              f"format, amax, shadow) VALUES ('old', {rank}, 1, 0, 'fc', 'input', 'e4m3', 1.0, "
                              "false)"))  # fmt: skip
    engine.dispose()
    db.upgrade(url)  # 0006 counts what is already stored
    engine = db.make_engine(url)
    with db.make_sessionmaker(engine)() as session:
        ov = queries.run_overview(session, run_id="p/old")  # project p's run, under its key since 0016
        assert ov is not None
        assert (ov.step_records, ov.tensor_records, ov.grad_records, ov.events) == (6, 2, 0, 0)
        assert (ov.steps, ov.ranks, ov.first_step, ov.last_step) == (3, 2, 0, 2)
    engine.dispose()
    db.downgrade(url, "0005")  # and the backfilled row goes with the columns
    engine = db.make_engine(url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM ingest_counts")).scalar() == 0
    engine.dispose()


def test_0006_counts_records_stored_before_it(tmp_path: Path, empty_pg_url: str) -> None:
    """The run overview reads stored-record counts from ingest_counts since 0006; the revision
    backfills them from the raw tables, on both backends."""
    _backfill_case(f"sqlite:///{tmp_path / 'b.db'}")
    _backfill_case(empty_pg_url)


def _peak_backfill_case(url: str) -> None:
    from sqlalchemy import text

    db.upgrade(url, "0007")
    engine = db.make_engine(url)
    with engine.begin() as conn:
        for step, flops, mfu in ((0, 1e9, 0.25), (1, None, None)):
            conn.execute(
                text("INSERT INTO step_summaries (run_id, step, ranks, ts, step_seconds_min, step_seconds_p50, "
                     "step_seconds_p90, step_seconds_p99, step_seconds_max, slowest_rank, loss_nonfinite, "
                     "grad_nonfinite, flops, mfu) VALUES ('old', :step, 1, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 0, 0, 0, "
                     ":flops, :mfu)"),
                {"step": step, "flops": flops, "mfu": mfu},
            )  # fmt: skip
    engine.dispose()
    db.upgrade(url)  # 0008 recovers the peak each stored MFU was computed with
    engine = db.make_engine(url)
    with engine.connect() as conn:
        peaks = conn.execute(text("SELECT peak_flops_total FROM step_summaries ORDER BY step")).scalars().all()
    engine.dispose()
    assert peaks[0] == pytest.approx(1e9 / (0.25 * 2.0)) and peaks[1] is None
    db.downgrade(url, "0007")


def test_0008_stores_the_peak_of_summaries_reduced_before_it(tmp_path: Path, empty_pg_url: str) -> None:
    """/metrics divides by the peak stored with each step summary since 0008; the revision fills
    it in for the summaries already stored, on both backends."""
    _peak_backfill_case(f"sqlite:///{tmp_path / 'p.db'}")
    _peak_backfill_case(empty_pg_url)


def _scoping_case(url: str) -> None:
    """0016 moves another project's run, with every row that names it, to its key "<project>/<run>";
    the default project's stays; downgrading moves it back, unless two projects now share an id."""
    from sqlalchemy import text

    from trainvitals.service.store import queries

    db.upgrade(url, "0015")
    engine = db.make_engine(url)
    with engine.begin() as conn:
        for run, project in (("d1", "default"), ("x1", "team/a")):
            conn.execute(text("INSERT INTO runs (run_id, project, registration, world_size, status, "
                              f"created_at, last_seen_at) VALUES ('{run}', '{project}', '{{}}', 2, 'running', 1.0, "
                              "1.0)"))  # fmt: skip
            conn.execute(text("INSERT INTO batches (run_id, rank, incarnation, seq, received_at, records) "
                              f"VALUES ('{run}', 0, 1, 0, 1.0, 2)"))  # fmt: skip
            conn.execute(text("INSERT INTO reduction_state (run_id, reduced_upto, claimed_upto, dirty_marks) "
                              f"VALUES ('{run}', 0, 0, 0)"))  # fmt: skip
            for step in range(2):
                conn.execute(text("INSERT INTO steps (run_id, rank, incarnation, step, ts, step_seconds) "
                                  f"VALUES ('{run}', 0, 1, {step}, 1.0, 1.0)"))  # fmt: skip
    engine.dispose()

    def keys() -> dict[str, set[str]]:
        engine = db.make_engine(url)
        with engine.connect() as conn:
            out = {t: {r[0] for r in conn.execute(text(f"SELECT run_id FROM {t}"))}
                   for t in ("runs", "batches", "reduction_state", "steps")}  # fmt: skip
        engine.dispose()
        return out

    db.upgrade(url)
    assert keys() == dict.fromkeys(("runs", "batches", "reduction_state", "steps"), {"d1", "team/a/x1"})
    engine = db.make_engine(url)
    with db.make_sessionmaker(engine)() as session:
        assert queries.count_step_rows(session, run_id="team/a/x1") == 2
        assert queries.run_overview(session, run_id="team/a/x1").run_id == "x1"  # type: ignore[union-attr]
    engine.dispose()
    db.downgrade(url, "0015")
    assert keys() == dict.fromkeys(("runs", "batches", "reduction_state", "steps"), {"d1", "x1"})
    db.upgrade(url)
    engine = db.make_engine(url)
    with engine.begin() as conn:  # project b's own d1, which bare ids cannot hold beside the default's
        conn.execute(text("INSERT INTO runs (run_id, project, registration, world_size, status, created_at, "
                          "last_seen_at) VALUES ('b/d1', 'b', '{}', 2, 'running', 1.0, 1.0)"))  # fmt: skip
    engine.dispose()
    with pytest.raises(db.MigrationRefused, match="run id 'd1' is used by two projects"):
        db.downgrade(url, "0015")


def test_0016_moves_other_projects_runs_to_their_keys(tmp_path: Path, empty_pg_url: str) -> None:
    _scoping_case(f"sqlite:///{tmp_path / 's.db'}")
    _scoping_case(empty_pg_url)


# Run in a process of its own, killed (SIGKILL: no exception handler, no clean-up) as 0007's batch
# rebuild of `steps` starts copying the rows into the new table.
_KILLED_MIDWAY = """
import os, signal, sys
from sqlalchemy import Engine, event
from trainvitals.service.store import db

def kill(_conn, _cursor, statement, *_rest):
    if statement.lstrip().upper().startswith("INSERT INTO _ALEMBIC_TMP_STEPS"):
        os.kill(os.getpid(), signal.SIGKILL)

event.listen(Engine, "before_cursor_execute", kill)
db.upgrade(sys.argv[1])
"""


def test_an_upgrade_killed_midway_leaves_the_database_as_it_was(tmp_path: Path) -> None:
    """pysqlite ran DDL outside the migration's transaction: an upgrade killed during 0007's rebuild
    of `steps` left `_alembic_tmp_steps` committed at revision 0006, and every later start failed
    with "table _alembic_tmp_steps already exists"."""
    import signal
    import subprocess
    import sys

    from sqlalchemy import text

    url = f"sqlite:///{tmp_path / 'i.db'}"
    db.upgrade(url, "0006")
    engine = db.make_engine(url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (run_id, project, registration, world_size, status, created_at, "
                          "last_seen_at) VALUES ('r', 'default', '{}', 1, 'running', 1.0, 1.0)"))  # fmt: skip
        conn.execute(text("INSERT INTO steps (run_id, rank, incarnation, step, ts, step_seconds) "
                          "VALUES ('r', 0, 1, 0, 1.0, 1.0)"))  # fmt: skip
    engine.dispose()
    killed = subprocess.run([sys.executable, "-c", _KILLED_MIDWAY, url], capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert db.current_revision(url) == "0006"
    assert "_alembic_tmp_steps" not in _tables(url)
    db.upgrade(url)  # the rerun, as the next start does
    assert db.current_revision(url) == db._revisions()[1]
    engine = db.make_engine(url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM steps")).scalar() == 1
    engine.dispose()


def test_two_upgrades_at_once_on_postgresql_both_succeed(empty_pg_url: str) -> None:
    """Replicas, and serve with its analysis child, migrate at every start: two at once both ran
    0018's ALTER TABLE and the second failed with a traceback (DuplicateColumn). Both are held at
    `runs` (a lock this test takes) until both are waiting, so that they really overlap."""
    import subprocess
    import sys
    import time

    import psycopg

    db.upgrade(empty_pg_url, "0017")
    dsn = empty_pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn) as holder:
        holder.execute("LOCK TABLE runs IN ACCESS EXCLUSIVE MODE")
        upgrades = [
            subprocess.Popen(
                [sys.executable, "-m", "trainvitals.service.cli", "db", "upgrade", "--db", empty_pg_url],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            for _ in range(2)
        ]
        try:
            deadline = time.monotonic() + 60
            with psycopg.connect(dsn, autocommit=True) as watcher:
                waiting = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"  # noqa: E501
                while watcher.execute(waiting).fetchone()[0] < 2:  # type: ignore[index]
                    assert time.monotonic() < deadline, [p.poll() for p in upgrades]
                    time.sleep(0.05)
        finally:
            holder.rollback()  # releases runs: the upgrades go on
        results = [p.communicate(timeout=60) for p in upgrades]
    assert [p.returncode for p in upgrades] == [0, 0], results
    assert db.current_revision(empty_pg_url) == db._revisions()[1]


def _paged_step_case(url: str) -> None:
    from sqlalchemy import text

    from trainvitals.service.store import queries
    from trainvitals.service.store.findings import store_findings

    db.upgrade(url, "0019")
    engine = db.make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO findings (run_id, kind, severity, subject_kind, subject, onset_step, detected_step, "
                "last_step, magnitude, summary, active, first_seen_at, updated_at) VALUES "
                "('r', 'straggler', 'page', 'rank', '3', 600, 650, 700, 1.2, 'rank 3 slow since step 600', "
                "true, 1.0, 1.0)"
            ))  # fmt: skip
    finally:
        engine.dispose()
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        with db.make_sessionmaker(engine)() as session:
            (before,) = queries.findings(session, run_id="r")
            assert (before["onset_step"], before["detected_step"], before["paged_step"]) == (600, 650, None)
            # The same episode's next cycle: its page step was not stored, so the detector's (recomputed) one.
            store_findings(session, run_id="r", findings=[_straggler(paged_step=900)], now=2.0)
            (after,) = queries.findings(session, run_id="r")
            assert (after["onset_step"], after["detected_step"], after["paged_step"]) == (600, 650, 900)
    finally:
        engine.dispose()


def _straggler(**kw: object) -> object:
    from trainvitals.service.detectors.findings import Finding

    return Finding(kind="straggler", severity="page", run="r", subject_kind="rank", subject="3", onset_step=900,
                   last_step=1000, magnitude=1.2, summary="rank 3 slow since step 900", detected_step=950,
                   **kw)  # type: ignore[arg-type]  # fmt: skip


def test_0020_findings_stored_before_it_have_no_paged_step(tmp_path: Path, empty_pg_url: str) -> None:
    _paged_step_case(f"sqlite:///{tmp_path / 'p.db'}")
    _paged_step_case(empty_pg_url)
