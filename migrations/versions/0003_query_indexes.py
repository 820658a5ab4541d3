"""indexes for scrape and post-mortem queries at 16,384 ranks (docs/performance.md)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Per-group gradient norms of one step (the scrape): 230 ms -> 0.2 ms on PostgreSQL.
    op.create_index("ix_grad_summaries_run_step", "grad_summaries", ["run_id", "step"])
    # Newest persisted checkpoint and per-status counts as index lookups, not scans of every rank's rows.
    op.create_index("ix_checkpoints_run_status_step", "checkpoints", ["run_id", "status", "step"])


def downgrade() -> None:
    op.drop_index("ix_checkpoints_run_status_step", table_name="checkpoints")
    op.drop_index("ix_grad_summaries_run_step", table_name="grad_summaries")
