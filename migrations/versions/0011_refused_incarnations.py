"""refused_incarnations: processes whose run registration was refused as another job reusing the
run id; their batches are refused too (store/batches.py register_run)

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "refused_incarnations",
        sa.Column("run_id", sa.String(128), sa.ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True),
        sa.Column("incarnation", sa.BigInteger(), primary_key=True),
        sa.Column("refused_at", sa.Float(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("refused_incarnations")
