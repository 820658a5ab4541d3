"""steps indexed by (run_id, step, rank, ts) instead of (run_id, step, rank) (the settle test)

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Every analysis cycle asks for the newest unreduced step with a row older than the settle time
    # (store/summaries.py reducible_upto): through the old index, a row lookup per unreduced step
    # row, 41-57 ms for 65k rows of a 16,384-rank run on SQLite; with ts in the index, 6-11 ms
    # (docs/performance.md, "Session 64"). Every reader of the old index reads a prefix of this one.
    op.create_index("ix_steps_run_step_rank_ts", "steps", ["run_id", "step", "rank", "ts"])
    op.drop_index("ix_steps_run_step_rank", table_name="steps")


def downgrade() -> None:
    op.create_index("ix_steps_run_step_rank", "steps", ["run_id", "step", "rank"])
    op.drop_index("ix_steps_run_step_rank_ts", table_name="steps")
