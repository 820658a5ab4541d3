"""drop the (run, tensor, role, step) index of raw tensor_stats (ingest cost, no reader)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Every per-tensor query reads tensor_summaries; the reducer reads raw rows by (run_id, step).
    # This string-keyed index was maintained for every ingested tensor record (most records) and
    # read by nothing: about a third of PostgreSQL's insert cost per row (docs/performance.md).
    op.drop_index("ix_tensor_stats_run_tensor_step", table_name="tensor_stats")


def downgrade() -> None:
    op.create_index("ix_tensor_stats_run_tensor_step", "tensor_stats", ["run_id", "tensor", "role", "step"])
