"""step_summaries.peak_flops_total: the MFU's denominator, stored by the reduction beside the MFU
(readers divide by it instead of inverting the MFU)

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("step_summaries") as batch:
        batch.add_column(sa.Column("peak_flops_total", sa.Float(), nullable=True))
    # Summaries reduced before this revision: the peak their MFU was computed with, recovered once
    # here (mfu = flops / (step_seconds_max x peak)), so /metrics keeps their window MFU.
    op.execute(
        "UPDATE step_summaries SET peak_flops_total = flops / (mfu * step_seconds_max) "
        "WHERE mfu > 0 AND flops > 0 AND step_seconds_max > 0"
    )


def downgrade() -> None:
    with op.batch_alter_table("step_summaries") as batch:
        batch.drop_column("peak_flops_total")
