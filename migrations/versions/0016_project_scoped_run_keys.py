"""Run ids belong to their project: every run_id column holds the run's key (store/run_keys.py), the
bare id for the default project and "<project>/<run>" for any other, so it widens to 385

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-29

Only runs of other projects than `default` are rewritten, with every row that names them: a
single-project deployment's rows stay as they are. The rewrite goes through a copy of each runs row
(insert the new key, move the children, delete the old key), so no foreign key is ever dangling.
It touches every row of those runs, so it takes time in proportion to their history (docs/schema.md).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from trainvitals.service.store.db import MigrationRefused

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

_CHILDREN = (
    "refused_incarnations",
    "batches",
    "steps",
    "tensor_stats",
    "grad_stats",
    "checkpoints",
    "events",
    "step_summaries",
    "tensor_summaries",
    "grad_summaries",
    "rank_windows",
    "reduction_state",
    "findings",
    "ingest_counts",
    "detector_blocks",
)
_RUN_COLUMNS = "project, registration, world_size, status, created_at, last_seen_at"
# Runs stored under a bare id that are not the default project's: the ones to rewrite (a run id
# cannot contain "/", so a key with one is already scoped).
_OLD = "project <> 'default' AND run_id NOT LIKE '%/%'"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":  # SQLite does not enforce VARCHAR lengths
        for table in ("runs", *_CHILDREN):
            op.alter_column(table, "run_id", type_=sa.String(385), existing_type=sa.String(128))
    op.execute(
        f"INSERT INTO runs (run_id, {_RUN_COLUMNS}) "
        f"SELECT project || '/' || run_id, {_RUN_COLUMNS} FROM runs WHERE {_OLD}"
    )
    for table in _CHILDREN:
        op.execute(
            f"UPDATE {table} SET run_id = "
            f"(SELECT r.project || '/' || r.run_id FROM runs r WHERE r.run_id = {table}.run_id) "
            f"WHERE run_id IN (SELECT run_id FROM runs WHERE {_OLD})"
        )
    op.execute(f"DELETE FROM runs WHERE {_OLD}")


def downgrade() -> None:
    """Back to bare ids. Refused when two projects have a run of the same id (they cannot share one)."""
    bind = op.get_bind()
    clash = bind.execute(
        sa.text(
            "SELECT rid FROM (SELECT CASE WHEN run_id LIKE '%/%' THEN substr(run_id, length(project) + 2) "
            "ELSE run_id END AS rid FROM runs) AS ids GROUP BY rid HAVING count(*) > 1"
        )
    ).first()
    if clash is not None:
        raise MigrationRefused(
            f"run id {clash.rid!r} is used by two projects: delete or rename one before downgrading"
        )
    scoped = "run_id LIKE '%/%'"
    op.execute(
        f"INSERT INTO runs (run_id, {_RUN_COLUMNS}) SELECT substr(run_id, length(project) + 2), {_RUN_COLUMNS} "
        f"FROM runs WHERE {scoped}"
    )
    for table in _CHILDREN:
        op.execute(
            f"UPDATE {table} SET run_id = (SELECT substr(r.run_id, length(r.project) + 2) FROM runs r "
            f"WHERE r.run_id = {table}.run_id) WHERE run_id IN (SELECT run_id FROM runs WHERE {scoped})"
        )
    op.execute(f"DELETE FROM runs WHERE {scoped}")
    if op.get_bind().dialect.name == "postgresql":
        for table in ("runs", *_CHILDREN):
            op.alter_column(table, "run_id", type_=sa.String(128), existing_type=sa.String(385))
