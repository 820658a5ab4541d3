"""runs.last_step_at: when the collector last stored a step record of the run (its own clock), so
that a run's stall age follows a relaunched incarnation replaying older steps and does not compare
the agents' clocks with the collector's

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, no default: no table rewrite. NULL until the run's next step record (readers then
    # fall back to the newest step's own end time).
    op.add_column("runs", sa.Column("last_step_at", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("last_step_at")
