"""findings.detected_step: the step a finding was first raised at, kept with its first onset while
it stays open (store/findings.py)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Findings stored before this revision keep NULL: when they were first raised was not recorded
    # (the onset is where the evidence starts, not when a collector saw it; copying it would claim
    # a detection with no delay). The next analysis cycle fills it for findings opened from then on.
    with op.batch_alter_table("findings") as batch:
        batch.add_column(sa.Column("detected_step", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("findings") as batch:
        batch.drop_column("detected_step")
