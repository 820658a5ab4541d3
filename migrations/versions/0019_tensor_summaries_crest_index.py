"""tensor_summaries: a partial index on (run_id, step) of the rows with a crest, for the scrape's
newest measured crest (trainvitals_fp8_worst_crest_log2)

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

_MEASURED = sa.text("crest_bits IS NOT NULL")


def upgrade() -> None:
    # Crest is measured on the agent's expensive steps only: the newest such step lies up to 200
    # steps back (the default cadence), and without this index every scrape read each tensor row of
    # those steps to find it. Partial: only the measured rows have entries.
    op.create_index(
        "ix_tensor_summaries_run_crest_step",
        "tensor_summaries",
        ["run_id", "step"],
        sqlite_where=_MEASURED,
        postgresql_where=_MEASURED,
    )


def downgrade() -> None:
    op.drop_index("ix_tensor_summaries_run_crest_step", table_name="tensor_summaries")
