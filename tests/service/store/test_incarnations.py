"""The newest-incarnation rule: its SQL form and its in-memory form give the same answer, and the
post-mortem queries over raw rows count a replayed step once."""

import math
import random
from dataclasses import dataclass

import pytest
from sqlalchemy import select

from trainvitals.service.store import batches, queries
from trainvitals.service.store.incarnations import newest_incarnation, newest_incarnation_only
from trainvitals.service.store.models import GradStatRow, StepRow, TensorStatRow
from trainvitals.wire import Batch, RunRegistration


@dataclass(frozen=True)
class Key:
    rank: int
    step: int
    incarnation: int


def _store_restarts(session, seed: int) -> None:
    """4 ranks; each restarts 0-2 times, resuming a few steps before where it stopped. Now and then
    a step's own record is missing while its tensor record arrived (the agent's queue dropped it)."""
    rng = random.Random(seed)
    batches.register_run(session, RunRegistration(run="r", parallelism={"world_size": 4}))
    for rank in range(4):
        step, inc = 0, 1000
        for _ in range(rng.randint(1, 3)):
            end = step + rng.randint(3, 8)
            recs: list[dict] = []
            for s in range(step, end):
                if rng.random() > 0.1:
                    recs.append({"kind": "step", "step": s, "ts": 1.0, "step_seconds": rng.random()})
                recs.append({"kind": "grad", "step": s, "group": "__global__", "owned_sq": rng.random(),
                             "local_sq": 1.0})  # fmt: skip
                recs.append({"kind": "tensor", "step": s, "tensor": "fc", "role": "input", "format": "e4m3",
                             "amax": 1.0, "nonfinite": rng.randint(0, 3)})  # fmt: skip
            batches.store_batch(
                session, Batch.model_validate({"run": "r", "rank": rank, "incarnation": inc, "seq": 0, "records": recs})
            )
            step, inc = max(0, end - rng.randint(0, 5)), inc + rng.randint(1, 1000)


@pytest.mark.parametrize("seed", [0, 1])
def test_sql_and_in_memory_forms_agree(session, seed: int) -> None:
    _store_restarts(session, seed)
    steps = [Key(*r) for r in session.execute(select(StepRow.rank, StepRow.step, StepRow.incarnation))]
    assert len(newest_incarnation(steps)) < len(steps)  # the data has replays
    for table in (StepRow, GradStatRow, TensorStatRow):
        records = [Key(*r) for r in session.execute(select(table.rank, table.step, table.incarnation))]
        # The rule itself: a record counts unless a step row of its (rank, step) is newer.
        kept = {k for k in records if not any(
            s.rank == k.rank and s.step == k.step and s.incarnation > k.incarnation for s in steps)}  # fmt: skip
        if table is StepRow:
            assert kept == set(newest_incarnation(steps))  # the in-memory form
        for first, last in ((None, None), (3, 9), (0, 0), (12, None)):
            q = select(table.rank, table.step, table.incarnation).where(
                table.run_id == "r", newest_incarnation_only(table, run_id="r", first=first, last=last)
            )
            if first is not None:
                q = q.where(table.step >= first)
            if last is not None:
                q = q.where(table.step <= last)
            got = [Key(*r) for r in session.execute(q)]
            want = {k for k in kept if (first is None or k.step >= first) and (last is None or k.step <= last)}
            assert len(got) == len(set(got)) and set(got) == want, (table.__name__, first, last)


def test_post_mortem_queries_count_a_replayed_step_once(session) -> None:
    _store_restarts(session, 2)
    rows = session.execute(select(StepRow.rank, StepRow.step, StepRow.incarnation, StepRow.step_seconds)).all()
    newest = {(k.rank, k.step): k.incarnation for k in newest_incarnation(Key(*r[:3]) for r in rows)}
    assert len(newest) < len(rows)  # the data has replays
    seconds = {(rank, step): s for rank, step, inc, s in rows if newest[(rank, step)] == inc}
    matrix = queries.step_time_matrix(session, run_id="r", start=0, end=100)
    got = {(rank, step): matrix["seconds"][i][j] for i, step in enumerate(matrix["steps"])
           for j, rank in enumerate(matrix["ranks"]) if matrix["seconds"][i][j] is not None}  # fmt: skip
    assert got == seconds
    grads = session.execute(select(GradStatRow.rank, GradStatRow.step, GradStatRow.incarnation, GradStatRow.owned_sq))
    owned: dict[int, float] = {}
    for rank, step, inc, sq in grads:
        if newest.get((rank, step), inc) <= inc:  # no newer step row of its (rank, step)
            owned[step] = owned.get(step, 0.0) + sq
    for step, total in owned.items():
        assert queries.global_grad_norm(session, run_id="r", step=step) == pytest.approx(math.sqrt(total))
    by_rank = {r: m for r, m, _p50, _p99 in queries.rank_step_seconds(session, run_id="r")}
    for rank in by_rank:
        mine = [s for (r, _step), s in seconds.items() if r == rank]
        assert by_rank[rank] == pytest.approx(sum(mine) / len(mine))
