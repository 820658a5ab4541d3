"""steps.skipped and step_summaries.skipped_ranks: steps whose update the optimizer did not apply
(a loss scaler's skip on inf/NaN gradients), so that the gradient detectors tell them from a
divergence

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN with a constant default: no table rewrite on either backend (steps is large).
    op.add_column("steps", sa.Column("skipped", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.add_column("step_summaries", sa.Column("skipped_ranks", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("step_summaries") as batch:
        batch.drop_column("skipped_ranks")
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("skipped")
