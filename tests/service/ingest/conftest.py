"""Fixtures of the ingest tests: a database (SQLite and PostgreSQL) with runs registered."""

import pytest

from trainvitals.service.store import batches, db
from trainvitals.wire import RunRegistration


@pytest.fixture
def sessions(db_url: str):
    """A session factory on a database holding run r1 of project a (8 ranks) and r2 of project b."""
    engine = db.make_engine(db_url)
    factory = db.make_sessionmaker(engine)
    with factory() as s:
        batches.register_run(s, RunRegistration(run="r1", project="a", parallelism={"world_size": 8}))
        batches.register_run(s, RunRegistration(run="r2", project="b"))
    yield factory
    engine.dispose()
