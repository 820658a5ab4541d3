"""Column types that behave the same on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter, ne
from typing import Any

from sqlalchemy import Float
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

NAN_TEXT = "NaN"


class Real(TypeDecorator[float]):
    """A float column that keeps NaN on SQLite.

    SQLite stores a NaN REAL as NULL: a NaN amax would violate NOT NULL and lose its whole batch,
    and a NaN loss would read back as 'not reported'. Exactly the values a diverging run sends.
    On SQLite NaN is written as the text 'NaN' (a column of REAL affinity keeps text that is not a
    number) and read back as float NaN; it sorts above every number there, as NaN does on
    PostgreSQL, so max/min/ORDER BY agree between the backends. PostgreSQL stores NaN natively.
    Writers that bypass SQLAlchemy (the SQLite executemany fast path) apply `nan_as_text` themselves.
    """

    impl = Float
    cache_ok = True

    def bind_processor(self, dialect: Dialect) -> Callable[[Any], Any] | None:
        if dialect.name != "sqlite":
            return None
        return lambda v: NAN_TEXT if v != v else v  # only NaN differs from itself

    def result_processor(self, dialect: Dialect, coltype: object) -> Callable[[Any], Any] | None:
        if dialect.name != "sqlite":
            return None
        return lambda v: float(v) if isinstance(v, str) else v


def nan_as_text(rows: list[tuple[Any, ...]], float_positions: tuple[int, ...]) -> list[tuple[Any, ...]]:
    """Rows for a raw SQLite insert with NaN as 'NaN' (see Real). The scan is C-level (map over a
    column, NaN != NaN); rows are only rebuilt when a NaN is present, which is rare."""
    for k in float_positions:
        column = list(map(itemgetter(k), rows))
        if any(map(ne, column, column)):
            return [tuple(NAN_TEXT if v != v else v for v in row) for row in rows]
    return rows
