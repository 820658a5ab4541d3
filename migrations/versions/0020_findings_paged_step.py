"""findings.paged_step: the first step a finding's episode was a page (a ticket that escalated
pages later than it was raised), kept while the episode stays open like detected_step, so that a
post-mortem reads when it paged from the collector and not only from Alertmanager

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, no default: no table rewrite. NULL for findings stored before this revision (their
    # page step is unknown, as their detected_step was before 0009) and for ones that never paged.
    op.add_column("findings", sa.Column("paged_step", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("findings") as batch:
        batch.drop_column("paged_step")
