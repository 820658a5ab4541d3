"""drop steps.mem_allocated_bytes and steps.mem_reserved_bytes (no agent ever filled them; the
memory signal will come back with its own design)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

COLUMNS = ("mem_allocated_bytes", "mem_reserved_bytes")


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        for column in COLUMNS:
            batch.drop_column(column)


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        for column in COLUMNS:
            batch.add_column(sa.Column(column, sa.BigInteger(), nullable=True))
