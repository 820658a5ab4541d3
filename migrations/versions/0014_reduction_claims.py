"""reduction_state.claimed_upto and dirty_marks: the claim protocol between ingest and the
reduction (store/summaries.py), so a row that arrives while its step is being reduced re-dirties it

Revision ID: 0014
Revises: 0011
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("reduction_state") as batch:
        batch.add_column(sa.Column("claimed_upto", sa.BigInteger(), nullable=False, server_default="-1"))
        batch.add_column(sa.Column("dirty_marks", sa.BigInteger(), nullable=False, server_default="0"))
    # No reduction is in flight across an upgrade: what is claimed is what was reduced.
    op.execute("UPDATE reduction_state SET claimed_upto = reduced_upto")


def downgrade() -> None:
    with op.batch_alter_table("reduction_state") as batch:
        batch.drop_column("dirty_marks")
        batch.drop_column("claimed_upto")
