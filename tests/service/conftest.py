"""Fixtures shared by the collector's unit tests."""

import pytest

from trainvitals.service.store import db


@pytest.fixture
def session(db_url: str):
    """A session on a migrated, empty database of each backend (db_url is parametrised)."""
    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as s:
        yield s
    engine.dispose()
