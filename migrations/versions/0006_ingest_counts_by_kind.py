"""stored records counted per kind in ingest_counts (the run overview no longer scans raw tables)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

KINDS = {
    "step": "steps",
    "tensor": "tensor_stats",
    "grad": "grad_stats",
    "checkpoint": "checkpoints",
    "event": "events",
}
BACKFILL_WRITER = "migration-0006"


def upgrade() -> None:
    with op.batch_alter_table("ingest_counts") as batch:
        for kind in KINDS:
            batch.add_column(sa.Column(f"{kind}_records", sa.BigInteger(), nullable=False, server_default="0"))
    # What was stored before this revision: counted once from the raw tables, in a row of its own
    # (batches and records 0, so the existing totals stay as they were).
    columns = ", ".join(f"{kind}_records" for kind in KINDS)
    counts = ", ".join(f"(SELECT count(*) FROM {table} t WHERE t.run_id = r.run_id)" for table in KINDS.values())
    op.execute(
        f"INSERT INTO ingest_counts (run_id, outcome, writer, batches, records, {columns}) "
        f"SELECT r.run_id, 'stored', '{BACKFILL_WRITER}', 0, 0, {counts} FROM runs r"
    )


def downgrade() -> None:
    op.execute(f"DELETE FROM ingest_counts WHERE writer = '{BACKFILL_WRITER}'")
    with op.batch_alter_table("ingest_counts") as batch:
        for kind in KINDS:
            batch.drop_column(f"{kind}_records")
