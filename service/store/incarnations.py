"""The newest incarnation of a (rank, step) wins: the one rule for steps that a restart replayed.

A rank that restarts (a new agent incarnation, numbered by its start time in milliseconds) resumes
from its last checkpoint and runs some steps again. The store keeps every record it received, so
a replayed (rank, step) has records from two incarnations. Only the newest incarnation's count:
the older ones describe work the job threw away, and counting both would add that rank twice to
the step's sums (tokens, FLOPs, owned squares, non-finite counts).

Which incarnations ran a step is what the `steps` table says: a record of any raw table (steps,
tensor_stats, grad_stats) is dropped when `steps` holds the same (rank, step) from a newer
incarnation. The rule has two forms, one per place the rows are in:

- `newest_incarnation_only(table, run_id=..., first=..., last=...)`: a WHERE clause, for every SQL
  statement over raw rows (the reduction's FP8 tensor summary and gradient reads, the detectors'
  per-rank timing, the post-mortem queries);
- `newest_incarnation(rows)`: for step rows already in memory (the reduction's step rows).

A replayed step's summaries are rebuilt from its newest incarnations' records alone: when those
sent no FP8 or gradient records for it, it has none (`replayed_steps` says which steps to clear).

tests/service/store/test_incarnations.py holds the two to the same answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import Protocol, TypeVar

from sqlalchemy import ColumnElement, exists, func, or_, select, tuple_
from sqlalchemy.orm import aliased

from trainvitals.service.store.models import GradStatRow, StepRow, TensorStatRow

RawRecords = type[StepRow] | type[TensorStatRow] | type[GradStatRow]


def newest_incarnation_only(
    records: RawRecords, *, run_id: str, first: int | None = None, last: int | None = None
) -> ColumnElement[bool]:
    """WHERE clause keeping the records of `records` (a raw table's model, in the statement's FROM)
    that no newer incarnation of their rank replaced: no step row of the same (run, step, rank) has
    a higher incarnation. first/last: steps the statement reads lie within first..last (None:
    unbounded).

    Cost. A record from its rank's newest incarnation in first..last (all of them, unless the rank
    restarted within the range) is kept by a lookup in the (rank, newest incarnation) set, a
    subquery computed once per statement (a hashed IN list); only the others pay a probe of the
    steps (run_id, step, rank) index. Both planners keep to this shape whatever their statistics
    (none yet right after a replay). Forms that did not: an anti-join against a grouped subquery
    of the replayed (rank, step)s, which they re-evaluated per record when they misjudged its size
    (minutes for 37,600 step rows), and the probe for every record, which doubled the reduction of
    a 16,384-rank step (786k FP8 records)."""
    s = aliased(StepRow)  # own aliases: `records` may be the steps table itself
    newest = select(s.rank, func.max(s.incarnation)).where(s.run_id == run_id)
    if first is not None:
        newest = newest.where(s.step >= first)
    if last is not None:
        newest = newest.where(s.step <= last)
    newer = aliased(StepRow)
    replaced = exists().where(
        newer.run_id == run_id,
        newer.step == records.step,
        newer.rank == records.rank,
        newer.incarnation > records.incarnation,
    )
    return or_(tuple_(records.rank, records.incarnation).in_(newest.group_by(s.rank)), ~replaced)


class RankStepRecord(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def step(self) -> int: ...

    @property
    def incarnation(self) -> int: ...


R = TypeVar("R", bound=RankStepRecord)


def newest_incarnation(rows: Iterable[R]) -> list[R]:
    """The same rule over step rows in memory: per (rank, step), the row of the newest incarnation."""
    best: dict[tuple[int, int], R] = {}
    for r in rows:
        key = (r.rank, r.step)
        cur = best.get(key)
        if cur is None or r.incarnation > cur.incarnation:
            best[key] = r
    return list(best.values())


def replayed_steps(rows: Sequence[RankStepRecord]) -> set[int]:
    """Steps that some rank reported from more than one incarnation (a restart ran them again)."""
    if len(set(map(attrgetter("incarnation"), rows))) < 2:
        return set()  # the common case, one pass in C
    first: dict[tuple[int, int], int] = {}
    return {r.step for r in rows if first.setdefault((r.rank, r.step), r.incarnation) != r.incarnation}
