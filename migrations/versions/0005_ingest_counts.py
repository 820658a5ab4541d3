"""ingest counters in the database (exact, shared by every collector process)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ingest_counts",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("writer", sa.String(length=128), nullable=False),
        sa.Column("batches", sa.BigInteger(), nullable=False),
        sa.Column("records", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "outcome", "writer"),
    )


def downgrade() -> None:
    op.drop_table("ingest_counts")
