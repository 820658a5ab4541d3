"""detector_blocks: the detectors' input for fixed step ranges as numpy arrays, so the first
analysis cycle after a start or a lease takeover does not re-read millions of rows
(store/detector_blocks.py)

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "detector_blocks",
        sa.Column("run_id", sa.String(128), sa.ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True),
        sa.Column("source", sa.String(16), primary_key=True),
        sa.Column("first_step", sa.BigInteger(), primary_key=True),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
    )
    if op.get_bind().dialect.name == "postgresql":
        # Float arrays hardly compress: storing them as they are spares pglz's CPU on every write.
        op.execute("ALTER TABLE detector_blocks ALTER COLUMN payload SET STORAGE EXTERNAL")


def downgrade() -> None:
    op.drop_table("detector_blocks")
