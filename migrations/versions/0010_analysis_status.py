"""analysis_status: the analysis worker's counters (cycles, cycle seconds, errors, newest cycle),
written by the process that analyses and exported by every process that serves /metrics

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "analysis_status",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("cycles", sa.BigInteger(), nullable=False),
        sa.Column("cycle_seconds_total", sa.Float(), nullable=False),
        sa.Column("errors", sa.BigInteger(), nullable=False),
        sa.Column("last_cycle_seconds", sa.Float(), nullable=True),
        sa.Column("last_cycle_at", sa.Float(), nullable=True),
        sa.Column("holder", sa.String(256), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("analysis_status")
