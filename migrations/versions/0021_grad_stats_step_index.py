"""grad_stats indexed by (run_id, step) instead of (run_id, step, group_name) (ingest cost)

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Every rank sends each step's gradient groups, so a batch's rows fell at the ends of separate
    # (step, group) ranges of the old index, a leaf page each: a commit of one benchmark batch
    # wrote 86-113 pages to SQLite's WAL, 65-66 with this index, whose new rows of a step share its
    # last pages. Every reader selects by run and step range; the reduction groups by
    # (step, group_name) itself (docs/performance.md, "Session 54").
    op.create_index("ix_grad_stats_run_step", "grad_stats", ["run_id", "step"])
    op.drop_index("ix_grad_stats_run_step_group", table_name="grad_stats")


def downgrade() -> None:
    op.create_index("ix_grad_stats_run_step_group", "grad_stats", ["run_id", "step", "group_name"])
    op.drop_index("ix_grad_stats_run_step", table_name="grad_stats")
