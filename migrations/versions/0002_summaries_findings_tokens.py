"""summaries findings tokens

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("project", sa.String(length=256), nullable=False),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("name", sa.String(length=256), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("revoked", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("digest"),
    )
    op.create_table(
        "findings",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("severity", sa.String(length=8), nullable=False),
        sa.Column("subject_kind", sa.String(length=16), nullable=False),
        sa.Column("subject", sa.String(length=256), nullable=False),
        sa.Column("onset_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("magnitude", sa.Float(), nullable=False),
        sa.Column("summary", sa.Text(), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.Column("first_seen_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("findings", schema=None) as batch_op:
        batch_op.create_index(
            "ux_findings_identity", ["run_id", "kind", "subject_kind", "subject"], unique=True
        )

    op.create_table(
        "grad_summaries",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("group_name", sa.String(length=256), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("norm", sa.Float(), nullable=False),
        sa.Column("nonfinite", sa.BigInteger(), nullable=False),
        sa.Column("replica_spread", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "group_name", "step"),
    )
    op.create_table(
        "rank_windows",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("window_start", sa.BigInteger(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("pp_stage", sa.Integer(), nullable=True),
        sa.Column("step_seconds_mean", sa.Float(), nullable=False),
        sa.Column("step_seconds_p50", sa.Float(), nullable=False),
        sa.Column("step_seconds_max", sa.Float(), nullable=False),
        sa.Column("compute_seconds_mean", sa.Float(), nullable=True),
        sa.Column("wait_seconds_mean", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "window_start", "rank"),
    )
    with op.batch_alter_table("rank_windows", schema=None) as batch_op:
        batch_op.create_index("ix_rank_windows_run_rank", ["run_id", "rank", "window_start"], unique=False)

    op.create_table(
        "step_summaries",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("ranks", sa.Integer(), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("step_seconds_min", sa.Float(), nullable=False),
        sa.Column("step_seconds_p50", sa.Float(), nullable=False),
        sa.Column("step_seconds_p90", sa.Float(), nullable=False),
        sa.Column("step_seconds_p99", sa.Float(), nullable=False),
        sa.Column("step_seconds_max", sa.Float(), nullable=False),
        sa.Column("slowest_rank", sa.Integer(), nullable=False),
        sa.Column("compute_seconds_p50", sa.Float(), nullable=True),
        sa.Column("wait_seconds_p50", sa.Float(), nullable=True),
        sa.Column("data_seconds_p50", sa.Float(), nullable=True),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("loss_nonfinite", sa.Integer(), nullable=False),
        sa.Column("grad_norm", sa.Float(), nullable=True),
        sa.Column("agent_grad_norm", sa.Float(), nullable=True),
        sa.Column("grad_nonfinite", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.Float(), nullable=True),
        sa.Column("flops", sa.Float(), nullable=True),
        sa.Column("mfu", sa.Float(), nullable=True),
        sa.Column("stage_step_seconds_p50", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "step"),
    )
    op.create_table(
        "tensor_summaries",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("tensor", sa.String(length=256), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("format", sa.String(length=8), nullable=False),
        sa.Column("amax", sa.Float(), nullable=False),
        sa.Column("headroom_bits", sa.Float(), nullable=True),
        sa.Column("lag_bits", sa.Float(), nullable=True),
        sa.Column("staleness_steps", sa.Integer(), nullable=True),
        sa.Column("sat_frac", sa.Float(), nullable=True),
        sa.Column("underflow_frac", sa.Float(), nullable=True),
        sa.Column("crest_bits", sa.Float(), nullable=True),
        sa.Column("nonfinite", sa.BigInteger(), nullable=True),
        sa.Column("shadow", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "tensor", "role", "step"),
    )
    with op.batch_alter_table("tensor_summaries", schema=None) as batch_op:
        batch_op.create_index("ix_tensor_summaries_run_step", ["run_id", "step"], unique=False)

    op.create_table(
        "reduction_state",
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("reduced_upto", sa.BigInteger(), nullable=False),
        sa.Column("dirty_from", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.run_id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id"),
    )


def downgrade() -> None:
    op.drop_table("reduction_state")
    with op.batch_alter_table("tensor_summaries", schema=None) as batch_op:
        batch_op.drop_index("ix_tensor_summaries_run_step")

    op.drop_table("tensor_summaries")
    op.drop_table("step_summaries")
    with op.batch_alter_table("rank_windows", schema=None) as batch_op:
        batch_op.drop_index("ix_rank_windows_run_rank")

    op.drop_table("rank_windows")
    op.drop_table("grad_summaries")
    with op.batch_alter_table("findings", schema=None) as batch_op:
        batch_op.drop_index("ux_findings_identity")

    op.drop_table("findings")
    op.drop_table("api_tokens")
